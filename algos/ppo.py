"""Proximal Policy Optimization for RLHF, with the N+ implementation details.

RLHF with PPO (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences";
Stiennon et al. 2020, "Learning to summarize from human feedback") as reproduced on TL;DR by Huang
et al. 2024, "The N+ Implementation Details of RLHF with PPO". Each rollout samples responses,
scores them with a frozen reward model, turns the score into per-token rewards with a KL penalty
to the frozen SFT reference, estimates advantages with GAE from a learned value model, and takes
clipped PPO steps:

    r_t = -kl_coef * (log pi_old(o_t) - log pi_ref(o_t))  (+ score at the last token)
    A_t = GAE(gamma, lambda) over r_t and V,   returns_t = A_t + V_t
    loss = max(-A ratio, -A clip(ratio, 1 +- eps)) + vf_coef * 0.5 max((V - R)^2, (V_clip - R)^2)

N+ details are marked `N+ detail` where they are implemented.

    python algos/ppo.py      # tiny TL;DR prompts, policy output/sft, reward and value model from output/reward
    accelerate launch algos/ppo.py --model_name_or_path output/pythia-1b-sft --reward_model_path output/pythia-1b-rm \
        --dataset_name trl-lib/tldr --output_dir output/pythia-1b-ppo --learning_rate 3e-6 ...
"""

import contextlib
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # copies import their own common/
from common.checkpoint import CheckpointArgs, Checkpointer, save_model
from common.data import as_completions, load_prompts, prompt_batches
from common.generation import (generate, real_positions, shifted_logits, token_entropy_no_grad, token_logprobs,
                               unwrapped_for_generation)
from common.models import (ModelArgs, adapt, hint_learning_rate, load_policy, load_reward_model, load_tokenizer,
                           prepare_frozen)
from common.packing import (PackingArgs, packed_completion_logps, packed_logits_and_values,  # --padding_free
                            packed_scores)
from common.resume import resume  # --resume_from_checkpoint
from common.reward_extras import RewardExtras  # a reward function asking for TRL's extras, or async
from common.rewards import asks_for_extras, compute_rewards, last_token_scores, load_reward_sources
from common.runtime import (UserError, check_flags, exit_on_user_error, flags, lr_scheduler,
                            setup, stop_on_signal)
from common.sampler_correction import SamplerCorrectionArgs, check_correction, importance_weights
from common.tracking import Tracker, TrackingArgs, reduce_stats
from common.vllm import VLLMArgs, VLLMSampler, sampler_options


@dataclass
class Args:
    # algorithm: KL-shaped per-token rewards, GAE, the clipped policy and value losses (module docstring)
    kl_coef: float = 0.05
    """weight of the per-token KL penalty in the reward"""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """per-token KL: k1 = log pi - log pi_ref, or k3 = exp(-k1) + k1 - 1 (always >= 0)"""
    whiten_rewards: bool = False
    """whiten the per-token rewards over the batch before GAE"""
    gamma: float = 1.0
    """discount"""
    lam: float = 0.95
    """GAE lambda"""
    cliprange: float = 0.2
    """policy ratio clip range"""
    cliprange_value: float = 0.2
    """value clip range"""
    vf_coef: float = 0.1
    """weight of the value loss"""
    num_ppo_epochs: int = 4
    """passes over each rollout batch"""
    num_mini_batches: int = 1
    """optimizer steps per pass"""
    missing_eos_penalty: float | None = None
    """subtracted from the score of responses without EOS (the EOS trick, N+ detail)"""
    penalty_reward_value: float | None = None
    """replaces the score of responses without EOS (the original EOS trick; overrides missing_eos_penalty)"""

    # models, data and rewards
    model_name_or_path: str = "output/sft"
    """policy to start from (the SFT model), also the frozen reference"""
    dataset_name: str = "tiny_tldr/tldr"
    """data with a prompt column (standard or conversational)"""
    dataset_train_split: str = "train"
    """split whose prompts are used"""
    max_prompt_length: int = 512
    """prompt tokens kept (from the end)"""
    reward_model_path: str = "output/reward"
    """frozen reward model; the value model starts as a copy of it (N+ detail)"""
    reward_funcs: list[str] = field(default_factory=list)
    """extra reward functions `module:function` called as TRL does (None or NaN: not scored; common/rewards.py)"""
    reward_weights: list[float] | None = None
    """weight of each reward, the reward model first (default all 1; 0: logged, not optimised)"""
    reward_timeout: float = 600
    """seconds a reward function may take on a batch, else the run ends, naming it (0: no limit)"""
    disable_dropout: bool = True
    """no dropout in the policy and value model (LoRA's included): old logprobs, reference logprobs and values are
    then exact, and the first pass's ratio is 1 (as TRL)"""

    # sampling
    response_length: int = 48
    """tokens sampled per response"""
    temperature: float = 0.7
    """sampling temperature; training logits are divided by it too (N+ detail)"""
    stop_token: Literal["eos", "none"] = "eos"
    """truncate responses after the first EOS and pad the rest (N+ detail), or keep all tokens"""

    # optimization
    learning_rate: float = 3e-5
    """peak learning rate of AdamW (policy and value model)"""
    lr_scheduler_type: str = "linear"
    """transformers scheduler name (linear, cosine, constant, ...)"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    max_steps: int = 50
    """rollouts to sample and train on"""
    per_device_train_batch_size: int = 32
    """responses per micro-batch per process"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step"""
    seed: int = 1
    """seed of the run (models load alike on every process; each completion is sampled with its own seed)"""

    # output, memory and samples
    output_dir: str = "output/ppo"
    """where the policy, tokenizer and logs/<run_name>.jsonl are written"""
    local_rollout_forward_batch_size: int = 64
    """rows per no-grad forward pass during the rollout"""
    eval_steps: int = 25
    """print a table of sampled responses with their scores every this many rollouts"""
    num_sample_generations: int = 4
    """responses shown in the samples table every eval_steps"""

    # filled in at runtime
    world_size: int = 0
    """number of processes (set at runtime)"""
    rollout_batch_size: int = 0
    """responses per rollout = per_device_train_batch_size x gradient_accumulation_steps x num_mini_batches x
    world_size"""
    num_steps: int = 0
    """optimizer steps = max_steps x num_ppo_epochs x num_mini_batches (set at runtime)"""

    # shared groups, each defined where it is read: common/{models,vllm,sampler_correction,checkpoint,tracking}.py

    model: ModelArgs = field(default_factory=ModelArgs)
    packing: PackingArgs = field(default_factory=PackingArgs)
    vllm: VLLMArgs = field(default_factory=VLLMArgs)
    correction: SamplerCorrectionArgs = field(default_factory=SamplerCorrectionArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    tracking: TrackingArgs = field(default_factory=TrackingArgs)


# ---------------------------------------------------------------------------------------------
# ALGO LOGIC: reward shaping, GAE, whitening and the clipped losses
# ---------------------------------------------------------------------------------------------
def shape_rewards(logps, ref_logps, scores, mask, *, kl_coef: float, kl_estimator: str = "k1"):
    """Per-token rewards [B, T]: -kl_coef * KL_t on every response token, plus the score at the
    last real token. Returns (rewards, per-token KL)."""
    k1 = (logps - ref_logps) * mask
    kl = k1 if kl_estimator == "k1" else (torch.exp(-k1) + k1 - 1) * mask
    rewards = -kl_coef * kl
    last = (mask.sum(dim=1) - 1).clamp(min=0).long()
    rewards[torch.arange(len(scores)), last] += scores
    return rewards, kl


def gae(rewards, values, gamma: float, lam: float):
    """Generalized Advantage Estimation (Schulman et al. 2016), backwards over time:
    delta_t = r_t + gamma V_{t+1} - V_t; A_t = delta_t + gamma lam A_{t+1}. Values and rewards must
    be 0 past each response's end. Returns (advantages, returns = advantages + values)."""
    advantages = torch.zeros_like(rewards)
    next_advantage = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else 0.0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = next_advantage
    return advantages, advantages + values


def whiten(values, mask, shift_mean: bool = True):
    """(x - mean) / std over the masked entries; shift_mean=False keeps the mean (for rewards)."""
    mean = (values * mask).sum() / mask.sum()
    var = (((values - mean) * mask) ** 2).sum() / (mask.sum() - 1).clamp(min=1)
    white = (values - mean) * torch.rsqrt(var + 1e-8)
    return (white if shift_mean else white + mean) * mask


def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum().clamp(min=1)


def policy_loss(logps, old_logps, advantages, mask, cliprange: float, token_weights=1.0):
    """Clipped surrogate (loss, clip fraction, approx KL 0.5 (log ratio)^2), masked token means;
    token_weights: importance weights (vLLM sampler correction)."""
    ratio = torch.exp(logps - old_logps)
    unclipped, clipped = -advantages * ratio, -advantages * torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
    loss = masked_mean(torch.max(unclipped, clipped) * token_weights, mask)
    clipfrac = masked_mean((clipped > unclipped).float(), mask)
    return loss, clipfrac, masked_mean(0.5 * (logps - old_logps) ** 2, mask), ratio


def value_loss(values, old_values, returns, mask, cliprange_value: float):
    """Clipped value loss 0.5 max((V - R)^2, (V_clip - R)^2) (masked mean) and its clip fraction."""
    clipped_values = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    losses, losses_clipped = (values - returns) ** 2, (clipped_values - returns) ** 2
    clipfrac = masked_mean((losses_clipped > losses).float(), mask)
    return 0.5 * masked_mean(torch.max(losses, losses_clipped), mask), clipfrac


class PolicyAndValue(torch.nn.Module):
    """Policy and value model in one module, so that one DDP wrapper syncs both gradients."""

    def __init__(self, policy, value_model, padding_free: bool = False):
        super().__init__()
        self.policy, self.value_model, self.padding_free = policy, value_model, padding_free
        # FSDP shards each of these layers alone (accelerate reads them from the model, as for a HF model)
        self._no_split_modules = sorted({*(policy._no_split_modules or ()), *(value_model._no_split_modules or ())})

    def forward(self, input_ids, attention_mask, prompt_width: int):
        """Response-token logits and values V(s_t) before each response token. The logits as the policy gives
        them (bf16 under mixed precision): they are divided by the temperature in fp32, by token_logprobs, as the
        reference's are (dividing in bf16 rounded the policy's alone, and the step-1 KL was not 0)."""
        if self.padding_free:  # each model on one packed row, position ids restarting per row (common/packing.py)
            return packed_logits_and_values(self.policy, self.value_model, input_ids, attention_mask, prompt_width)
        logits = shifted_logits(self.policy, input_ids, attention_mask, prompt_width - 1, share_prefix=False)
        position_ids = real_positions(attention_mask)  # as shifted_logits does for the policy
        backbone = getattr(self.value_model, self.value_model.base_model_prefix)
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids).last_hidden_state
        values = self.value_model.score(hidden[:, prompt_width - 1:-1]).squeeze(-1)
        return logits, values.float()


@torch.no_grad()
def rollout_pass(model, ref_model, input_ids, attention_mask, *, prompt_width: int, temperature: float,
                 chunk_size: int):
    """The rollout's fixed quantities at each response position t (tokens input_ids[:, prompt_width:],
    prompts left-padded to prompt_width), in chunks of rows, without gradients: log pi_old(y_t) and
    log pi_ref(y_t), both from the logits before y_t divided by the sampling temperature, and V(s_t),
    the value of the state before y_t. `model`: a PolicyAndValue (possibly wrapped for DDP);
    `ref_model` None: the policy with its LoRA adapters off."""
    inner = getattr(model, "module", model)
    policy, outs = inner.policy, []
    response_ids = input_ids[:, prompt_width:]
    for i in range(0, len(input_ids), chunk_size):
        s = slice(i, i + chunk_size)
        logits, values = model(input_ids[s], attention_mask[s], prompt_width)
        with contextlib.nullcontext() if ref_model is not None else policy.disable_adapter():  # LoRA: adapters off
            ref = policy if ref_model is None else ref_model
            if inner.padding_free:
                ref_logps = packed_completion_logps(ref, input_ids[s], attention_mask[s], prompt_width, temperature)
            else:
                ref_logps = token_logprobs(shifted_logits(ref, input_ids[s], attention_mask[s], prompt_width - 1,
                                                          share_prefix=False), response_ids[s], temperature)
        outs.append((token_logprobs(logits, response_ids[s], temperature), ref_logps, values))
    return tuple(torch.cat(x) for x in zip(*outs))


@dataclass
class Rollout:
    """One rollout: first this rank's share, then (gathered) every rank's, from which the update draws its
    micro-batches in one global shuffle, so that it does not depend on how many processes share it."""
    input_ids: torch.Tensor  # [B, P + T] left-padded prompts, then responses
    attention_mask: torch.Tensor
    response_ids: torch.Tensor  # [B, T] cut after the first EOS (N+ detail), padded after it
    mask: torch.Tensor  # [B, T] response tokens
    old_logps: torch.Tensor  # [B, T] the sampling-time policy's
    ref_logps: torch.Tensor  # [B, T]
    old_values: torch.Tensor  # [B, T] the value model's, before each response token
    sampler_logps: torch.Tensor  # [B, T] vLLM's (0 with HF generate)
    sampled: torch.Tensor  # [B, T] the tokens the sampler drew (and gave logprobs for)
    scores: torch.Tensor  # [B] the reward


def main(args: Args):
    check_flags(args)  # before anything loads: sizes and rates > 0, an output_dir free to use
    accelerator = setup(seed=args.seed, gradient_accumulation_steps=args.gradient_accumulation_steps,
                        per_device_train_batch_size=args.per_device_train_batch_size, max_grad_norm=args.max_grad_norm,
                        bf16=args.model.bf16, ddp_timeout=args.checkpoint.ddp_timeout)
    args.world_size = accelerator.num_processes
    args.tracking.run_name = args.tracking.run_name or f"ppo__{args.seed}__{int(time.time())}"
    local_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches
    args.rollout_batch_size = local_size * args.world_size
    args.num_steps = args.max_steps * args.num_ppo_epochs * args.num_mini_batches
    per_device = args.per_device_train_batch_size
    mini_size = per_device * args.gradient_accumulation_steps

    check_correction(args.correction, use_vllm=args.vllm.use_vllm)
    vllm_options = sampler_options(args.vllm, accelerator, seed=args.seed, dtype=args.model.torch_dtype,
                                   use_peft=args.model.use_peft) if args.vllm.use_vllm else None  # vLLM, server up
    # ---- models and data ----
    tokenizer = load_tokenizer(args.model_name_or_path)
    rows, prompt_ids = load_prompts(tokenizer, args.dataset_name, args.dataset_train_split, "ppo.py",
                                    args.max_prompt_length, args.rollout_batch_size,
                                    f"per_device_train_batch_size {args.per_device_train_batch_size} x "
                                    f"gradient_accumulation_steps {args.gradient_accumulation_steps} x "
                                    f"num_mini_batches {args.num_mini_batches} x {args.world_size} processes")
    lora = args.model.lora()  # None without --use_peft
    policy = adapt(load_policy(args.model_name_or_path, tokenizer, args.model.torch_dtype), lora=lora,
                   gradient_checkpointing=args.model.gradient_checkpointing, no_dropout=args.disable_dropout)
    hint_learning_rate(accelerator, policy, args.learning_rate, Args.learning_rate)
    # N+ detail: the value model is initialised from the reward model (a separate network)
    reward_tokenizer = load_tokenizer(args.reward_model_path, role="reward model")
    if reward_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise UserError("the value model starts from the reward model, so the reward model's tokenizer must be "
                        "the policy's")
    value_model = adapt(load_reward_model(args.reward_model_path, reward_tokenizer, args.model.torch_dtype),
                        gradient_checkpointing=args.model.gradient_checkpointing, lora=lora,
                        no_dropout=args.disable_dropout, task_type="SEQ_CLS")
    ref_model = None  # frozen, never wrapped for DDP; with LoRA, the policy with adapters off
    if not args.model.use_peft:
        ref_model = prepare_frozen(accelerator, load_policy(args.model_name_or_path, tokenizer, args.model.torch_dtype))
    sources, weights = load_reward_sources([args.reward_model_path], args.reward_funcs, args.reward_weights,
                                           accelerator)
    extras = (RewardExtras(accelerator, args, len(rows) // args.rollout_batch_size * args.rollout_batch_size)
              if asks_for_extras(args.reward_funcs) else None)  # TRL's reward-function extras; a pass's responses
    model = PolicyAndValue(policy, value_model, args.packing.padding_free)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, eps=1e-5)  # N+ detail: Adam eps 1e-5
    scheduler = lr_scheduler(args.lr_scheduler_type, optimizer, 0, args.num_steps)
    # the scheduler is not prepared: accelerate would step it once per process per call
    model, optimizer = accelerator.prepare(model, optimizer)
    checkpointer = Checkpointer(accelerator, scheduler, args.checkpoint, output_dir=args.output_dir,
                                run_name=args.tracking.run_name)
    # --resume_from_checkpoint: weights, optimizer, RNGs, step and the loop's state (common/resume.py)
    resumed = resume(checkpointer) if args.checkpoint.resume_from_checkpoint else {}
    sampler = None
    if args.vllm.use_vllm:
        sampler = VLLMSampler(accelerator, args.model_name_or_path, args.max_prompt_length + args.response_length,
                              **vllm_options)
    args.tracking.run_name = resumed.get("run_name", args.tracking.run_name)  # a resumed run logs on in its JSONL
    tracker = Tracker(accelerator, args.tracking, output_dir=args.output_dir, config=flags(args),
                      total_steps=args.max_steps, start_step=resumed.get("step", 0))
    accelerator.print(f"{len(rows)} prompts; {args.max_steps} rollouts of {args.rollout_batch_size} responses, "
                      f"{args.num_ppo_epochs} epochs x {args.num_mini_batches} mini-batches each")

    # this process's share of each rollout's prompts, one shuffle per pass (the same on every rank); a resumed run
    # passes over the batches it trained on
    batches = prompt_batches(len(rows), args.rollout_batch_size, 1, seed=args.seed, rank=accelerator.process_index,
                             local_size=local_size, skip=resumed.get("step", 0))
    shuffler = torch.Generator().manual_seed(args.seed)  # the same on every rank: one global order
    start_time, episode, push_seconds = time.time(), 0, float("nan")
    if resumed:  # what the loop carries across rollouts (the episode counter also gives the sampling seeds)
        shuffler.set_state(resumed["shuffler"])  # the mini-batch order
        episode = resumed["episode"]
    start_episode = episode  # eps counts this process's episodes
    for step in range(resumed.get("step", 0) + 1, args.max_steps + 1):
        # ---- ROLLOUT: sample responses; N+ detail: truncate after the first EOS, pad the rest ----
        indices = next(batches)
        # one seed per response, from its place in the run: the same samples on 1 or N processes
        seeds = [args.seed * 10**9 + episode + accelerator.process_index * local_size + j for j in range(local_size)]
        batch_prompt_ids = [prompt_ids[i] for i in indices]
        if sampler is not None:
            if step > 1 or sampler.needs_push:  # a new policy, or sleep level 2 dropped the weights
                push_seconds = sampler.push_weights(accelerator.unwrap_model(model).policy)
            samples = sampler.generate(tokenizer, batch_prompt_ids, args.response_length, temperature=args.temperature,
                                       seeds=seeds)
        else:
            # the policy alone gathered (not the value model): ZeRO-3 / FSDP2 peak memory is one full model
            gather = args.model.ds3_gather_for_generation
            with unwrapped_for_generation(accelerator, model, gather, part="policy") as policy:
                samples = generate(policy, tokenizer, batch_prompt_ids, args.response_length,
                                   temperature=args.temperature, seeds=seeds)
        p_ids, p_mask = samples.prompt_ids, samples.prompt_mask
        r_ids, r_mask = samples.completion_ids, samples.completion_mask
        finished = samples.finished
        sampler_logps = torch.zeros(r_ids.shape, device=r_ids.device) if sampler is None else samples.sampler_logps
        sampled = r_mask.float()  # the tokens the sampler drew (and gave logprobs for)
        if args.stop_token == "none":
            r_ids, r_mask = r_ids.masked_fill(r_mask == 0, tokenizer.eos_token_id), torch.ones_like(r_mask)
        # the same prompt width on every rank, so that the rollout can be gathered
        p_ids = accelerator.pad_across_processes(p_ids, dim=1, pad_index=tokenizer.pad_token_id, pad_first=True)
        p_mask = accelerator.pad_across_processes(p_mask, dim=1, pad_index=0, pad_first=True)
        input_ids, attention_mask = torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1)
        prompt_width, mask = p_ids.shape[1], r_mask.float()
        episode += args.rollout_batch_size
        old_logps, ref_logps, old_values = rollout_pass(model, ref_model, input_ids, attention_mask,
                                                        prompt_width=prompt_width, temperature=args.temperature,
                                                        chunk_size=args.local_rollout_forward_batch_size)
        old_logps, ref_logps, old_values = old_logps * mask, ref_logps * mask, old_values * mask

        # ---- SCORE: the reward model on the truncated response; the EOS trick (N+ detail). The reward
        # model scores every response, so none is unscorable (unless it is given weight 0): an extra
        # reward function's None only leaves that function's term out of the sum ----
        texts = tokenizer.batch_decode(r_ids, skip_special_tokens=True)
        batch_prompts = [rows[i]["prompt"] for i in indices]
        completions = as_completions(batch_prompts, texts)
        columns = {k: [rows[i][k] for i in indices] for k in rows[0] if k != "prompt"}
        completion_ids = [ids[m.bool()].tolist() for ids, m in zip(r_ids, r_mask)]
        scores, per_source = compute_rewards(sources, weights, prompts=batch_prompts, completions=completions,
                                             columns=columns, completion_ids=completion_ids,
                                             call=extras and extras.caller(step - 1, episode - args.rollout_batch_size),
                                             timeout=args.reward_timeout,
                                             scores=packed_scores if args.packing.padding_free else last_token_scores)
        scores = scores.to(accelerator.device)
        if args.penalty_reward_value is not None:
            scores = torch.where(finished, scores, torch.full_like(scores, args.penalty_reward_value))
        elif args.missing_eos_penalty is not None:
            scores = scores - args.missing_eos_penalty * (~finished).float()

        # ---- ADVANTAGES: KL-shaped rewards, GAE, whitened advantages, over the whole rollout gathered (Rollout) ----
        mine = Rollout(input_ids=input_ids, attention_mask=attention_mask, response_ids=r_ids, mask=mask,
                       old_logps=old_logps, ref_logps=ref_logps, old_values=old_values, sampler_logps=sampler_logps,
                       sampled=sampled, scores=scores)
        r = Rollout(**{name: accelerator.gather(t) for name, t in vars(mine).items()})
        if r.scores.isnan().any():  # every rank sees the gathered scores: all stop alike
            raise UserError("a response has no reward: the reward model has weight 0 and no reward function scored it "
                            "(None); PPO needs a score for every response (give the reward model a weight)")
        rewards, kl = shape_rewards(r.old_logps, r.ref_logps, r.scores, r.mask, kl_coef=args.kl_coef,
                                    kl_estimator=args.kl_estimator)
        if args.whiten_rewards:
            rewards = whiten(rewards, r.mask, shift_mean=False)
        advantages, returns = gae(rewards, r.old_values, args.gamma, args.lam)
        advantages = whiten(advantages, r.mask)  # N+ detail: advantage whitening over the batch
        # sampler-mismatch correction, once per rollout (old_logps stay fixed): vLLM's pi differs slightly
        # from the trainer's
        is_weights, is_stats = torch.ones_like(r.old_logps), {}
        if sampler is not None and args.correction.vllm_importance_sampling_cap:
            is_weights, is_stats = importance_weights(r.old_logps, r.sampler_logps, r.sampled,
                                                      mode=args.correction.vllm_importance_sampling_mode,
                                                      low=args.correction.vllm_importance_sampling_clip_min,
                                                      high=args.correction.vllm_importance_sampling_cap)

        # ---- UPDATE: num_ppo_epochs x num_mini_batches steps of the clipped policy and value losses ----
        stats = defaultdict(float)  # name -> sum over micro-batches
        for _ in range(args.num_ppo_epochs):
            order = torch.randperm(args.rollout_batch_size, generator=shuffler).to(accelerator.device)
            for start in range(0, args.rollout_batch_size, mini_size * args.world_size):
                for micro in range(args.gradient_accumulation_steps):  # this rank's share of each micro-batch
                    first = start + (micro * args.world_size + accelerator.process_index) * per_device
                    idx = order[first:first + per_device]
                    m = r.mask[idx]
                    with accelerator.accumulate(model):
                        logits, values = model(r.input_ids[idx], r.attention_mask[idx], prompt_width)
                        logps = token_logprobs(logits, r.response_ids[idx], args.temperature)
                        pg_loss, pg_clipfrac, approxkl, ratio = policy_loss(logps, r.old_logps[idx], advantages[idx], m,
                                                                            cliprange=args.cliprange,
                                                                            token_weights=is_weights[idx])
                        vf_loss, vf_clipfrac = value_loss(values, r.old_values[idx], returns[idx], m,
                                                          cliprange_value=args.cliprange_value)
                        loss = pg_loss + args.vf_coef * vf_loss
                        if checkpointer.finite_loss(loss):  # under DeepSpeed backward steps the engine: check first
                            accelerator.backward(loss)
                        if accelerator.sync_gradients:
                            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                            if not checkpointer.finite(loss=loss.detach(), grad_norm=grad_norm):
                                optimizer.zero_grad()  # drop this update: the step below then changes nothing
                        optimizer.step()
                        optimizer.zero_grad()
                    with torch.no_grad():
                        stats["loss/policy_avg"] += pg_loss.detach()
                        stats["loss/value_avg"] += vf_loss.detach()
                        stats["policy/clipfrac_avg"] += pg_clipfrac
                        stats["val/clipfrac_avg"] += vf_clipfrac
                        stats["policy/approxkl_avg"] += approxkl.detach()
                        stats["policy/entropy_avg"] += masked_mean(token_entropy_no_grad(logits, args.temperature), m)
                        stats["val/ratio"] += masked_mean(ratio, m)
                        stats["val/ratio_squared"] += masked_mean(ratio.detach() ** 2, m)
                scheduler.step()
        tracker.step()

        # ---- LOG (TRL's PPO names) ----
        n = args.num_ppo_epochs * args.num_mini_batches * args.gradient_accumulation_steps
        metrics = reduce_stats(accelerator, stats, n)
        metrics["val/ratio_var"] = metrics.pop("val/ratio_squared") - metrics["val/ratio"] ** 2
        seq_kl, all_scores = kl.sum(1), r.scores
        metrics |= {"objective/kl": seq_kl.mean().item(),
                    "objective/entropy": (-r.old_logps.sum(1)).mean().item(),
                    "objective/non_score_reward": -args.kl_coef * seq_kl.mean().item(),
                    "objective/rlhf_reward": (all_scores - args.kl_coef * seq_kl).mean().item(),
                    "objective/scores": all_scores.mean().item(),
                    "val/num_eos_tokens": accelerator.gather(finished.float()).sum().item(),
                    "lr": scheduler.get_last_lr()[0], "episode": episode,
                    "eps": (episode - start_episode) / (time.time() - start_time)}
        for name, values in per_source.items():
            metrics[f"rewards/{name}/mean"] = accelerator.gather(values.to(accelerator.device)).nanmean().item()
        metrics |= extras.flush() if extras else {}  # log_metric's
        if sampler is not None:
            metrics["vllm/push_seconds"] = push_seconds
        metrics |= {f"sampling/importance_sampling_ratio/{k}": v.item() for k, v in is_stats.items()}  # TRL's names
        if step % args.eval_steps == 0 or step == 1:
            shown = extras.rows(len(texts)) if extras else [{}] * len(texts)  # log_extra's columns
            tracker.log_samples([{"prompt": p, "response": t, "score": s} | e for p, t, s, e in
                                 zip(batch_prompts, texts, mine.scores.tolist(), shown)][:args.num_sample_generations],
                                step)
        tracker.log(metrics, step)
        # every --save_steps rollouts, and on SIGTERM / Ctrl-C / non-finite values
        checkpointer.end_of_step(step, {"episode": episode, "shuffler": shuffler.get_state()})

    # ---- SAVE the policy ----
    os.makedirs(args.output_dir, exist_ok=True)
    save_model(accelerator, model, tokenizer, args.output_dir, part="policy")
    accelerator.print(f"saved policy and tokenizer to {args.output_dir}")
    tracker.close()


if __name__ == "__main__":
    with exit_on_user_error(), stop_on_signal():
        main(tyro.cli(Args))
