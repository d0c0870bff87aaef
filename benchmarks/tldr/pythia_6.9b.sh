#!/usr/bin/env bash
# TL;DR summarization at real scale, Pythia 6.9B: SFT on trl-lib/tldr -> reward model on
# trl-lib/tldr-preference -> DPO, KTO, online DPO, RLOO, GRPO and PPO from the SFT model (the online
# ones rewarded by the trained reward model) -> the SFT model and every policy judged against the
# human reference summaries by an LLM (benchmarks/judge_tldr.py).
#
#   OPENAI_API_KEY=... bash benchmarks/tldr/pythia_6.9b.sh
#
# Hardware: one machine with 8 GPUs of 80 GB (A100 / H100), DeepSpeed ZeRO-2 in bf16 with gradient
# checkpointing; PPO (policy, value model, reference and reward model: four 6.9B networks) under
# ZeRO-3 (pip install -e ".[deepspeed]"). NUM_GPUS=4 also works where memory allows (gradient
# accumulation doubles: every global batch stays the 8-GPU one). Network: the HF hub and the
# judge's endpoint (JUDGE_URL, default OpenAI; a local `vllm serve` works too).
# Hyperparameters:
#   SFT, reward model, DPO: Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO: A
#     Case Study on TL;DR Summarization": lr 3e-6, cosine, no warmup, 1 epoch; 128 examples (SFT)
#     or 64 pairs (RM, DPO) per step; DPO beta 0.05.
#   Online DPO, RLOO, PPO: TRL's documented TL;DR runs, whose judged win rates are the published
#     anchors at 1B and 6.9B (docs/benchmarks.md), with the same global batches at every size.
#   KTO, GRPO: no published TL;DR recipe; given the budgets of DPO and of RLOO / PPO (untuned).
set -euo pipefail

MODEL=EleutherAI/pythia-6.9b-deduped
OUT=${OUT:-output/pythia-6.9b}
NUM_GPUS=${NUM_GPUS:-8}
JUDGE_URL=${JUDGE_URL:-https://api.openai.com/v1}
JUDGE_MODEL=${JUDGE_MODEL:-gpt-4o-mini-2024-07-18}
: "${OPENAI_API_KEY:?set OPENAI_API_KEY for the judge (EMPTY for a local vllm serve)}"
(( 8 % NUM_GPUS == 0 )) || { echo "NUM_GPUS must be 1, 2, 4 or 8" >&2; exit 1; }
ACC=$((8 / NUM_GPUS))  # gradient accumulation multiplier: global batches as on 8 GPUs
LAUNCH="accelerate launch --config_file configs/deepspeed_zero2.yaml --num_processes $NUM_GPUS"
LAUNCH_ZERO3="accelerate launch --config_file configs/deepspeed_zero3.yaml --num_processes $NUM_GPUS"
PRECISION=(--bf16 --torch_dtype bfloat16 --gradient_checkpointing)  # DeepSpeed keeps fp32 master weights

# 1. SFT: 116,722 posts with reference summaries, 1 epoch of 128 per step (911 steps); 512 prompt
#    tokens + 53 summary tokens at most (N+ dataset limits), so max_length 576 cuts none
$LAUNCH algos/sft.py --model_name_or_path $MODEL "${PRECISION[@]}" \
    --dataset_name trl-lib/tldr --max_length 576 \
    --learning_rate 3e-6 --warmup_ratio 0 --num_train_epochs 1 \
    --per_device_train_batch_size 4 --gradient_accumulation_steps $((4 * ACC)) --per_device_eval_batch_size 8 \
    --max_new_tokens 53 --output_dir $OUT/sft

# 2. Reward model from the SFT model: 92,858 pairs, 1 epoch of 64 per step (~1,450 steps); the full
#    86k-pair validation split is scored at every eval, hence eval_steps 500
$LAUNCH algos/reward.py --model_name_or_path $OUT/sft "${PRECISION[@]}" \
    --dataset_name trl-lib/tldr-preference --max_length 704 \
    --learning_rate 3e-6 --warmup_ratio 0 --num_train_epochs 1 \
    --per_device_train_batch_size 2 --gradient_accumulation_steps $((4 * ACC)) --per_device_eval_batch_size 8 \
    --eval_steps 500 --output_dir $OUT/rm

# 3. DPO: beta 0.05, the same pairs and budget as the reward model
$LAUNCH algos/dpo.py --model_name_or_path $OUT/sft "${PRECISION[@]}" \
    --dataset_name trl-lib/tldr-preference --max_prompt_length 512 --max_completion_length 192 --max_length 704 \
    --beta 0.05 --learning_rate 3e-6 --warmup_ratio 0 --num_train_epochs 1 \
    --per_device_train_batch_size 2 --gradient_accumulation_steps $((4 * ACC)) --precompute_ref_logps \
    --per_device_eval_batch_size 4 --eval_steps 500 --max_new_tokens 53 --output_dir $OUT/dpo

# 4. KTO: each pair as a desirable and an undesirable row (class ratio 1); DPO's budget, 128 rows
#    = 64 pairs per step; beta 0.1 (Ethayarajh et al. 2024)
$LAUNCH algos/kto.py --model_name_or_path $OUT/sft "${PRECISION[@]}" \
    --dataset_name trl-lib/tldr-preference --max_prompt_length 512 --max_completion_length 192 --max_length 704 \
    --beta 0.1 --learning_rate 3e-6 --warmup_ratio 0 --num_train_epochs 1 \
    --per_device_train_batch_size 4 --gradient_accumulation_steps $((4 * ACC)) \
    --per_device_eval_batch_size 4 --eval_steps 500 --max_new_tokens 53 --output_dir $OUT/kto

# 5. Online DPO (TRL): 2 samples per prompt ranked by the RM, lr 5e-7, beta 0.1, 10% warmup, 53 new
#    tokens, EOS trick 1.0, 128 prompts per step for 3 epochs. online_dpo.py counts steps, not
#    epochs: 3 x floor(116,722 / 128) = 2,733 steps (a single --beta value holds for every epoch)
$LAUNCH algos/online_dpo.py --model_name_or_path $OUT/sft "${PRECISION[@]}" \
    --dataset_name trl-lib/tldr --reward_model_paths $OUT/rm --max_length 565 \
    --max_new_tokens 53 --missing_eos_penalty 1.0 --beta 0.1 \
    --learning_rate 5e-7 --warmup_ratio 0.1 --max_steps 2733 \
    --per_device_train_batch_size 4 --gradient_accumulation_steps $((4 * ACC)) \
    --output_dir $OUT/online_dpo

# 6. RLOO (TRL): k 2, sequence-level KL 0.03, 53 tokens at temperature 0.7, EOS trick 1.0, lr 3e-6;
#    4,096 completions per rollout in 2 epochs x 2 mini-batches; 1M completions = 245 rollouts
$LAUNCH algos/rloo.py --model_name_or_path $OUT/sft "${PRECISION[@]}" \
    --dataset_name trl-lib/tldr --reward_model_paths $OUT/rm \
    --rloo_k 2 --kl_coef 0.03 --max_completion_length 53 --temperature 0.7 --missing_eos_penalty 1.0 \
    --num_ppo_epochs 2 --num_mini_batches 2 --learning_rate 3e-6 --max_steps 245 \
    --per_device_train_batch_size 4 --gradient_accumulation_steps $((64 * ACC)) \
    --output_dir $OUT/rloo

# 7. GRPO: RLOO / PPO's sampling and budget (53 tokens at temperature 0.7, EOS trick 1.0, lr 3e-6,
#    1M completions), 4 per prompt, 512 per step = 1,953 steps; k3 KL beta 0.04 (Shao et al. 2024)
$LAUNCH algos/grpo.py --model_name_or_path $OUT/sft "${PRECISION[@]}" \
    --dataset_name trl-lib/tldr --reward_model_paths $OUT/rm \
    --num_generations 4 --max_completion_length 53 --temperature 0.7 --missing_eos_penalty 1.0 \
    --beta 0.04 --learning_rate 3e-6 --max_steps 1953 \
    --per_device_train_batch_size 4 --gradient_accumulation_steps $((16 * ACC)) \
    --output_dir $OUT/grpo

# 8. PPO (TRL, = N+ PPO but for the EOS trick): 512 responses of 53 tokens at temperature 0.7 per
#    rollout, 4 epochs x 1 mini-batch, KL 0.05, lr 3e-6 decayed linearly, EOS trick 1.0; 1M responses
#    = 1,953 rollouts. N+ itself replaces the score of EOS-less responses by -1 and whitens the
#    rewards: --penalty_reward_value -1 --whiten_rewards
$LAUNCH_ZERO3 algos/ppo.py --model_name_or_path $OUT/sft --reward_model_path $OUT/rm "${PRECISION[@]}" \
    --dataset_name trl-lib/tldr \
    --response_length 53 --temperature 0.7 --missing_eos_penalty 1.0 --kl_coef 0.05 \
    --num_ppo_epochs 4 --num_mini_batches 1 --learning_rate 3e-6 --max_steps 1953 \
    --per_device_train_batch_size 4 --gradient_accumulation_steps $((16 * ACC)) \
    --local_rollout_forward_batch_size 4 --output_dir $OUT/ppo

# 9. Judge: greedy summaries of the first 1,000 test prompts against the references, both orders
for run in sft dpo kto online_dpo rloo grpo ppo; do
    python benchmarks/judge_tldr.py --model_name_or_path $OUT/$run --num_examples 1000 \
        --judge_model $JUDGE_MODEL --base_url $JUDGE_URL --output_file $OUT/judge/$run.json
done
