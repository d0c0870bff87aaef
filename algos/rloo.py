"""REINFORCE Leave-One-Out (RLOO): online RL whose baseline is the other samples of the same prompt.

RLOO (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning
from Human Feedback in LLMs") samples k completions per prompt. A completion's reward is its score
minus a KL penalty to the reference (Ziegler et al. 2019); its baseline, the mean reward of the
other k - 1 completions, is unbiased and needs no value network:

    R_i = score_i - kl_coef * sum_t (log pi_old(o_t) - log pi_ref(o_t))      (sequence-level KL)
    A_i = R_i - (sum_j R_j - R_i) / (k - 1)

The update is the PPO clipped surrogate on per-token ratios against the sampling-time logprobs,
num_ppo_epochs passes of num_mini_batches optimizer steps each. --token_level_kl: the KL penalty is
a per-token reward, a token's advantage the return from it on (REINFORCE++'s reward-to-go, Hu 2025).
The EOS trick and reward normalisation follow the N+ implementation details (Huang et al. 2024).
--loss_type cispo / sapo: grpo.py's token losses (CISPO, MiniMax-M1 2025; SAPO, Gao et al. 2025), same token mean:

    cispo: -sg(min(ratio_t, 1 + cliprange)) * A_t * log pi(o_t)        (clipped tokens keep a gradient)
    sapo:  -4 / tau * sigmoid(tau * (ratio_t - 1)) * A_t, tau = tau_pos if A_t > 0 else tau_neg

Asynchronous (--max_staleness K, common/rollouts.py): rollouts drawn by pi_b, up to K rollouts older than pi_old.
Decoupled PPO (Hilton et al. 2022; AReaL, Fu et al. 2025) clips to pi_old and weights each token by
min(pi_old / pi_b, C): the trust region stays at the current policy.

    python algos/rloo.py     # tiny TL;DR prompts, policy output/sft, reward model output/reward
    accelerate launch algos/rloo.py --model_name_or_path output/pythia-1b-sft \
        --dataset_name trl-lib/tldr --reward_model_paths output/pythia-1b-rm --output_dir output/pythia-1b-rloo ...
"""

import functools
import math
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
from common.generation import (SamplingArgs, completion_logps, generate, rollout_logps,
                               unwrapped_for_generation)
from common.models import ModelArgs, adapt, hint_learning_rate, load_policy, load_tokenizer, prepare_frozen, reference
from common.rewards import asks_for_extras, compute_rewards, last_token_scores, load_reward_sources
from common.runtime import (UserError, check_flags, exit_on_user_error, flags, lr_scheduler,
                            setup, stop_on_signal)
from common.tracking import Tracker, TrackingArgs, reduce_stats
# features, each entered only where its flags are given
from common.episodes import EpisodeArgs, episode_metrics, load_tools  # --tools, --environment_factory
from common.packing import PackingArgs, packed_completion_logps, packed_scores  # --padding_free
from common.resume import resume  # --resume_from_checkpoint
from common.reward_extras import RewardExtras  # a reward function asking for TRL's extras, or async
from common.rollouts import RolloutArgs, RolloutStream, check_features  # --use_vllm, multi-turn, --max_staleness
from common.sampler_correction import SamplerCorrectionArgs, importance_weights  # --vllm_importance_*
from common.vllm import VLLMArgs, VLLMSampler  # --use_vllm


@dataclass
class Args:
    # algorithm: leave-one-out baseline, KL-penalised reward, clipped surrogate (module docstring)
    rloo_k: int = 4
    """k, completions sampled per prompt (each one's baseline is the mean of the other k - 1)"""
    kl_coef: float = 0.05
    """weight of the KL penalty subtracted from the reward"""
    token_level_kl: bool = False
    """KL penalty per token with reward-to-go advantages, instead of one sequence-level penalty"""
    normalize_rewards: bool = False
    """whiten the scores over the batch and clip them to +-reward_clip_range"""
    reward_clip_range: float = 10.0
    """clip range of normalised scores"""
    normalize_advantages: bool = False
    """whiten the advantages over the batch"""
    cliprange: float = 0.2
    """PPO clip range of the ratio (cispo: its weight is capped at 1 + cliprange, with no lower bound)"""
    loss_type: Literal["ppo", "cispo", "sapo"] = "ppo"
    """the clipped PPO surrogate, CISPO's truncated REINFORCE or SAPO's soft gate (module docstring)"""
    sapo_temperature_pos: float = 1.0
    """SAPO gate temperature tau_pos for positive advantages"""
    sapo_temperature_neg: float = 1.05
    """SAPO gate temperature tau_neg for advantages <= 0 (larger: their off-policy tokens fade faster)"""
    num_ppo_epochs: int = 2
    """passes over each rollout batch"""
    num_mini_batches: int = 1
    """optimizer steps per pass (each of gradient_accumulation_steps micro-batches)"""
    missing_eos_penalty: float | None = None
    """subtracted from the reward of completions that did not stop (N+ detail: the EOS trick)"""

    # model, data and rewards
    model_name_or_path: str = "output/sft"
    """policy to start from, usually the SFT model"""
    disable_dropout: bool = True
    """no dropout (LoRA's included): old and reference logprobs are exact, the first pass's ratio 1 (as TRL)"""
    dataset_name: str = "tiny_tldr/tldr"
    """data with a prompt column (other columns go to reward functions); "": none, an environment's reset() prompts"""
    dataset_train_split: str = "train"
    """split whose prompts are used"""
    max_prompt_length: int = 512
    """prompt tokens kept (from the end)"""
    reward_model_paths: list[str] | None = None
    """reward models (one-output classifiers, each with its tokenizer; default output/reward without --reward_funcs)"""
    reward_funcs: list[str] = field(default_factory=list)
    """reward functions `module:function`, called as TRL does (None or NaN: not scored by it; common/rewards.py)"""
    reward_weights: list[float] | None = None
    """weight of each reward, models first (default all 1; 0: logged as rewards/<name>/mean, not optimised)"""
    reward_timeout: float = 600
    """seconds a reward function may take on a batch, else the run ends, naming it (0: no limit)"""
    chat_template_path: str | None = None
    """a Jinja file or tokenizer whose chat template replaces the policy's (e.g. configs/chatml_tools.jinja)"""

    # sampling
    max_completion_length: int = 48
    """tokens sampled per completion"""
    temperature: float = 1.0
    """sampling temperature; training logprobs use the same one"""

    # optimization
    learning_rate: float = 3e-5
    """peak learning rate of AdamW"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    lr_scheduler_type: str = "linear"
    """transformers scheduler name (linear, cosine, constant, ...)"""
    warmup_ratio: float = 0.0
    """share of the optimizer steps spent warming the learning rate up"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    max_steps: int = 100
    """rollout batches to sample and train on"""
    per_device_train_batch_size: int = 32
    """completions per micro-batch per process"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step"""
    seed: int = 1
    """seed of the run (models load alike on every process; each completion is sampled with its own seed)"""

    # output and samples
    output_dir: str = "output/rloo"
    """where the model, tokenizer and logs/<run_name>.jsonl are written"""
    eval_steps: int = 25
    """print a table of sampled completions with their scores every this many rollouts"""
    num_sample_generations: int = 4
    """completions shown in the samples table every eval_steps"""

    # shared groups, their flags unprefixed; each defined where read: common/models.py, episodes.py, vllm.py, ...
    sampling: SamplingArgs = field(default_factory=SamplingArgs)
    model: ModelArgs = field(default_factory=ModelArgs)
    episodes: EpisodeArgs = field(default_factory=EpisodeArgs)
    packing: PackingArgs = field(default_factory=PackingArgs)
    rollouts: RolloutArgs = field(default_factory=RolloutArgs)
    vllm: VLLMArgs = field(default_factory=VLLMArgs)
    correction: SamplerCorrectionArgs = field(default_factory=SamplerCorrectionArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    tracking: TrackingArgs = field(default_factory=TrackingArgs)

    def __post_init__(self):
        if self.reward_model_paths is None:  # the default reward model only when nothing else scores
            scored = self.reward_funcs or self.episodes.environment_factory
            self.reward_model_paths = [] if scored else ["output/reward"]


# ---------------------------------------------------------------------------------------------
# ALGO LOGIC: leave-one-out advantages and the clipped surrogate
# ---------------------------------------------------------------------------------------------
def rloo_advantages(rewards: torch.Tensor, k: int) -> torch.Tensor:
    """r_i - mean of the other k - 1 rewards of its group (consecutive runs of k). Unscorable completions (NaN)
    are in no baseline and get 0, as does a completion whose group has no other scored one."""
    grouped = rewards.view(-1, k)
    scored = ~grouped.isnan()
    n = scored.sum(dim=1, keepdim=True)
    baseline = (grouped.nansum(dim=1, keepdim=True) - grouped) / (n - 1).clamp(min=1)
    return torch.where(scored & (n > 1), grouped - baseline, 0.0).flatten()


def token_level_advantages(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float, k: int):
    """Per-token advantages [N, T]: token rewards -kl_coef * kl_t, plus the score at the last trained token (the
    mask's last 1: multi-turn masks have gaps at tool results); a token's return sums the rewards from it on, its
    baseline is the leave-one-out mean of the other scored samples' whole returns. Unscorable (NaN) samples: 0."""
    scored = ~scores.isnan()
    rewards = -kl_coef * kl * mask
    last = (mask.bool() * torch.arange(1, mask.shape[1] + 1, device=mask.device)).argmax(dim=1)
    rewards[torch.arange(len(scores)), last] += scores.nan_to_num()
    returns = rewards.flip(1).cumsum(1).flip(1)  # reward-to-go
    grouped, in_group = returns[:, 0].view(-1, k), scored.view(-1, k)
    n = in_group.sum(dim=1, keepdim=True)
    baseline = ((grouped * in_group).sum(dim=1, keepdim=True) - grouped) / (n - 1).clamp(min=1)
    keep = (in_group & (n > 1)).flatten()[:, None]
    return (returns - baseline.flatten()[:, None]) * mask * keep


def rloo_loss(logps, old_logps, advantages, mask, *, cliprange: float, token_weights=1.0, loss_type: str = "ppo",
              sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05):
    """PPO clipped surrogate (or cispo / sapo), mean over the micro-batch's tokens; advantages [B] or [B, T];
    token_weights: importance weights. Returns (loss, ratio, clipped: cispo's weight truncated; never for sapo)."""
    ratio = torch.exp(logps - old_logps)
    a = advantages if advantages.dim() == 2 else advantages[:, None]
    if loss_type == "cispo":  # the weight is a constant: its gradient is the truncated REINFORCE one
        per_token, clipped = -torch.clamp(ratio, max=1 + cliprange).detach() * a * logps, ratio > 1 + cliprange
    elif loss_type == "sapo":
        tau = torch.where(a > 0, sapo_temperature_pos, sapo_temperature_neg)
        per_token, clipped = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * a, torch.zeros_like(ratio, dtype=torch.bool)
    else:
        unclipped, clipped = -a * ratio, -a * torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
        per_token, clipped = torch.max(unclipped, clipped), clipped > unclipped
    loss = (per_token * token_weights * mask).sum() / mask.sum().clamp(min=1)
    return loss, ratio, clipped


def whiten(values: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """(x - mean) / std over the (masked) entries."""
    if mask is None:
        return (values - values.mean()) / (values.std() + 1e-8)
    mean = (values * mask).sum() / mask.sum()
    var = (((values - mean) * mask) ** 2).sum() / (mask.sum() - 1).clamp(min=1)
    return (values - mean) / (var.sqrt() + 1e-8) * mask


def main(args: Args):
    check_flags(args)  # before anything loads: sizes and rates > 0, an output_dir free to use
    accelerator = setup(seed=args.seed, gradient_accumulation_steps=args.gradient_accumulation_steps,
                        per_device_train_batch_size=args.per_device_train_batch_size, max_grad_norm=args.max_grad_norm,
                        bf16=args.model.bf16, ddp_timeout=args.checkpoint.ddp_timeout)
    args.world_size, rank = accelerator.num_processes, accelerator.process_index
    args.tracking.run_name = args.tracking.run_name or f"rloo__{args.seed}__{int(time.time())}"
    # ---- batch sizes: checked before anything loads ----
    per_device = args.per_device_train_batch_size
    mini_size = per_device * args.gradient_accumulation_steps
    local_size = mini_size * args.num_mini_batches
    args.rollout_batch_size = local_size * args.world_size  # completions per rollout
    n_prompts = args.rollout_batch_size // args.rloo_k
    sizes = (f"per_device_train_batch_size {per_device} x gradient_accumulation_steps "
             f"{args.gradient_accumulation_steps} x num_mini_batches {args.num_mini_batches} x "
             f"{args.world_size} processes")
    if args.rloo_k < 2 or args.rollout_batch_size % args.rloo_k:
        raise UserError(f"{sizes} = {args.rollout_batch_size} completions per rollout, which must be a multiple of "
                        f"rloo_k {args.rloo_k} (>= 2)")
    args.num_steps = args.max_steps * args.num_ppo_epochs * args.num_mini_batches  # optimizer steps
    corrected = None  # the sampler-mismatch correction's options (common/sampler_correction.py)
    if args.vllm.use_vllm or args.rollouts.max_staleness:  # the features' checks, before anything loads
        corrected, vllm_options = check_features(args, accelerator)

    # ---- model, data and rewards ----
    tokenizer = load_tokenizer(args.model_name_or_path, chat_template_path=args.chat_template_path)
    rows, prompt_ids = load_prompts(tokenizer, args.dataset_name, args.dataset_train_split, "rloo.py",
                                    args.max_prompt_length, n_prompts, f"{sizes} / rloo_k {args.rloo_k}")
    e, tools = args.episodes, None
    if e.tools or e.environment_factory:  # multi-turn episodes
        tools = load_tools(tokenizer, e.tools, e.environment_factory, local_size, rows, timeout=e.tool_timeout)
    model = adapt(load_policy(args.model_name_or_path, tokenizer, args.model.torch_dtype),
                  gradient_checkpointing=args.model.gradient_checkpointing, lora=args.model.lora(),
                  no_dropout=args.disable_dropout)
    hint_learning_rate(accelerator, model, args.learning_rate, Args.learning_rate)
    ref_model = None if args.model.use_peft else prepare_frozen(  # frozen, never wrapped; LoRA turns adapters off
        accelerator, load_policy(args.model_name_or_path, tokenizer, args.model.torch_dtype))
    truncation = args.sampling.truncation()  # the sampling's, and the logprobs'
    sampling = dict(max_new_tokens=args.max_completion_length, temperature=args.temperature,
                    repetition_penalty=args.sampling.repetition_penalty, **truncation)
    logps_of, scores_of = ((packed_completion_logps, packed_scores) if args.packing.padding_free  # --padding_free
                           else (completion_logps, last_token_scores))
    logps_options = dict(batch_size=per_device, temperature=args.temperature, logps=logps_of, **truncation)
    loss_options = dict(cliprange=args.cliprange, loss_type=args.loss_type,
                        sapo_temperature_pos=args.sapo_temperature_pos, sapo_temperature_neg=args.sapo_temperature_neg)
    sources, weights = load_reward_sources(args.reward_model_paths, args.reward_funcs, args.reward_weights, accelerator,
                                           functions=tools.reward_functions() if tools else [])
    extras = (RewardExtras(accelerator, args, len(rows) // n_prompts * args.rollout_batch_size)  # completions a pass
              if asks_for_extras(args.reward_funcs) else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = lr_scheduler(args.lr_scheduler_type, optimizer, math.ceil(args.warmup_ratio * args.num_steps),
                             args.num_steps)
    model, optimizer = accelerator.prepare(model, optimizer)  # not the scheduler (prepared, it steps per process)
    sampler = None
    if args.vllm.use_vllm:
        sampler = VLLMSampler(accelerator, args.model_name_or_path,
                              args.max_prompt_length + args.max_completion_length, **vllm_options)
    checkpointer = Checkpointer(accelerator, scheduler, args.checkpoint, output_dir=args.output_dir,
                                run_name=args.tracking.run_name)
    # --resume_from_checkpoint: weights, optimizer, RNGs, step and the loop's state (common/resume.py)
    resumed = resume(checkpointer) if args.checkpoint.resume_from_checkpoint else {}
    args.tracking.run_name = resumed.get("run_name", args.tracking.run_name)  # a resumed run logs on in its JSONL
    tracker = Tracker(accelerator, args.tracking, output_dir=args.output_dir, config=flags(args),
                      total_steps=args.max_steps, start_step=resumed.get("step", 0))
    accelerator.print(f"{len(rows)} prompts; {args.max_steps} rollouts of {n_prompts} prompts x {args.rloo_k} "
                      f"completions, {args.num_ppo_epochs} epochs x {args.num_mini_batches} mini-batches each; "
                      "rewards: " + ", ".join(f"{name} (x{w})" for (name, _, _), w in zip(sources, weights)))

    episode = resumed.get("episode", 0)  # completions taken
    start_time, start_episode = time.time(), episode  # eps counts this process's episodes
    # endless: each rollout's prompts, rloo_k times each, this rank's share; resumed at the checkpoint's data position
    prompts_iter = prompt_batches(len(rows), n_prompts, args.rloo_k, seed=args.seed, rank=rank, local_size=local_size,
                                  skip=resumed.get("requested", episode) // args.rollout_batch_size)
    shuffler = torch.Generator().manual_seed(args.seed)  # the same on every rank: one global order
    if resumed:
        shuffler.set_state(resumed["shuffler"])  # the mini-batch order
    stream = None  # vLLM, multi-turn episodes, rollouts drawn ahead (K >= 1): common/rollouts.py
    if sampler or tools or args.rollouts.max_staleness:
        stream = RolloutStream(accelerator, args, rows, prompt_ids, tools, prompts_iter, resumed, model=model,
                               tokenizer=tokenizer, sampler=sampler, generate=generate,
                               batch_size=args.rollout_batch_size, **sampling,
                               logps=functools.partial(rollout_logps, **logps_options))  # the behaviour's (K >= 1)

    for step in range(resumed.get("step", 0) + 1, args.max_steps + 1):
        # ---- ROLLOUT: rloo_k completions per prompt from the current policy ----
        if stream is None:  # one turn with HF generate; a seed per completion from its place in the run
            indices = next(prompts_iter)
            seeds = [args.seed * 10**9 + episode + rank * local_size + j for j in range(local_size)]
            with unwrapped_for_generation(accelerator, model, args.model.ds3_gather_for_generation) as policy:
                samples = generate(policy, tokenizer, [prompt_ids[i] for i in indices], seeds=seeds, **sampling)
            c_mask, columns = samples.completion_mask, {}
        else:  # the episode of each (tool results: context, not trained), vLLM's, or drawn ahead by pi_b
            stream.publish(model, step - 1)  # the weights the next rollouts are drawn from
            indices, episodes = stream.next_batch(step - 1)
            samples, columns, c_mask = episodes.samples, episodes.columns, episodes.samples.model_mask
        c_ids, finished = samples.completion_ids, samples.finished
        prompts = episodes.prompts if tools else [rows[i]["prompt"] for i in indices]  # tools: with reset()'s string
        texts = tokenizer.batch_decode(c_ids, skip_special_tokens=True)

        # ---- SCORE: the scores (NaN: no source scored it), minus the penalty of a missing EOS (the EOS trick);
        # a completion as reward functions take it: a string or one assistant message (tools: the episode's) ----
        completions = episodes.completions if tools else as_completions(prompts, texts)
        columns = {k: [rows[i][k] for i in indices] for k in rows[0] if k != "prompt"} | columns
        # completion_ids: the whole episode's, tool results too (TRL's); extras: trainer_state, log_metric, log_extra
        scores, per_source = compute_rewards(
            sources, weights, prompts=prompts, completions=completions, columns=columns, scores=scores_of,
            completion_ids=[ids[m.bool()].tolist() for ids, m in zip(c_ids, samples.completion_mask)],
            call=extras and extras.caller(step - 1, episode), timeout=args.reward_timeout)
        # counted after scoring: trainer_state.epoch is the batches done before this one
        episode += args.rollout_batch_size
        scores = scores.to(accelerator.device)
        if args.missing_eos_penalty is not None:
            scores = scores - args.missing_eos_penalty * (~finished).float()

        # ---- ADVANTAGES: score minus the KL penalty to the reference, leave-one-out baseline, over the global
        # batch (a prompt's k samples may sit on different ranks); one prompt width on every rank, to gather ----
        p_ids = accelerator.pad_across_processes(samples.prompt_ids, dim=1, pad_index=tokenizer.pad_token_id,
                                                 pad_first=True)
        p_mask = accelerator.pad_across_processes(samples.prompt_mask, dim=1, pad_index=0, pad_first=True)
        input_ids, attention_mask = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, samples.completion_mask], 1)
        prompt_width, mask = p_ids.shape[1], c_mask.float()
        old_logps = rollout_logps(model, input_ids, attention_mask, prompt_width, **logps_options) * mask
        with reference(accelerator, model, ref_model) as ref:
            ref_logps = rollout_logps(ref, input_ids, attention_mask, prompt_width, **logps_options) * mask
        all_scores, kl = accelerator.gather(scores), accelerator.gather(old_logps - ref_logps)
        scored = ~all_scores.isnan()  # unscorable (NaN) ones stay out of the baselines, the whitening and the loss
        sampled = accelerator.gather(mask)  # the tokens the sampler drew (and gave logprobs for)
        all_mask = sampled * scored[:, None]
        if args.normalize_rewards:
            all_scores = whiten(all_scores.nan_to_num(), scored.float()).clamp(
                -args.reward_clip_range, args.reward_clip_range).masked_fill(~scored, math.nan)
        non_score_reward = -args.kl_coef * kl.sum(1)
        rlhf_reward = all_scores + non_score_reward
        if args.token_level_kl:
            advantages = token_level_advantages(all_scores, kl, all_mask, args.kl_coef, args.rloo_k)
            if args.normalize_advantages:
                advantages = whiten(advantages, all_mask)
        else:
            advantages = rloo_advantages(rlhf_reward, args.rloo_k)
            if args.normalize_advantages:
                advantages = whiten(advantages, scored.float())
        # the whole rollout on every rank ([B, P + T] and [B, T]): micro-batches are drawn from one global shuffle,
        # so the update does not depend on how many processes share it
        input_ids, attention_mask, old_logps = (accelerator.gather(x) for x in (input_ids, attention_mask, old_logps))
        is_weights, is_stats = torch.ones_like(old_logps), {}  # the loss's token weights (1: no correction)
        if samples.sampler_logps is not None:  # vLLM's; K >= 1: the behaviour policy's (pi_b)
            sampler_logps = accelerator.gather(samples.sampler_logps)
        if corrected:  # vLLM's pi differs slightly from the trainer's: once per rollout (old_logps stay fixed)
            is_weights, is_stats = importance_weights(old_logps, sampler_logps, sampled, **corrected)
        if args.rollouts.max_staleness:  # decoupled PPO: clipped to pi_old, tokens weighted by pi_old / pi_b, truncated
            stale = torch.exp(old_logps - sampler_logps) * sampled
            is_stats["async/importance_ratio"] = stale.sum() / sampled.sum().clamp(min=1)
            is_weights = stale.clamp(max=args.rollouts.async_importance_sampling_cap)

        # ---- UPDATE: num_ppo_epochs x num_mini_batches optimizer steps, clipped against old_logps ----
        stats = defaultdict(float)  # name -> sum over micro-batches
        entropy_sum = torch.zeros((), device=accelerator.device)
        for epoch in range(args.num_ppo_epochs):
            order = torch.randperm(args.rollout_batch_size, generator=shuffler).to(accelerator.device)
            for start in range(0, args.rollout_batch_size, mini_size * args.world_size):
                for micro in range(args.gradient_accumulation_steps):  # this rank's share of each micro-batch
                    first = start + (micro * args.world_size + rank) * per_device
                    idx = order[first:first + per_device]
                    m, old = all_mask[idx], old_logps[idx]
                    with accelerator.accumulate(model):
                        logps, entropy = logps_of(model, input_ids[idx], attention_mask[idx], prompt_width,
                                                  args.temperature, entropy=True, **truncation)
                        loss, ratio, clipped = rloo_loss(logps, old, advantages[idx], m, token_weights=is_weights[idx],
                                                         **loss_options)
                        if checkpointer.finite_loss(loss):  # under DeepSpeed backward steps the engine: check first
                            accelerator.backward(loss)
                        if accelerator.sync_gradients:
                            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                            if not checkpointer.finite(loss=loss.detach(), grad_norm=grad_norm):
                                optimizer.zero_grad()  # drop this update: the step below then changes nothing
                        optimizer.step()
                        optimizer.zero_grad()
                    with torch.no_grad():
                        tokens = m.sum().clamp(min=1)
                        log_ratio = (logps.detach() - old) * m
                        ratio = ratio.detach() * m
                        stats["loss/policy_avg"] += loss.detach()
                        stats["policy/approxkl_avg"] += 0.5 * (log_ratio ** 2).sum() / tokens
                        stats["policy/clipfrac_avg"] += (clipped.float() * m).sum() / tokens
                        stats["val/ratio"] += ratio.sum() / tokens
                        stats["val/ratio_squared"] += (ratio ** 2).sum() / tokens
                        if epoch == 0:
                            entropy_sum += (entropy * m).sum()
                scheduler.step()
        tracker.step()

        # ---- LOG (TRL's RLOO names) ----
        n_micro = args.num_ppo_epochs * args.num_mini_batches * args.gradient_accumulation_steps
        metrics = reduce_stats(accelerator, stats, n_micro)
        metrics["val/ratio_var"] = metrics.pop("val/ratio_squared") - metrics["val/ratio"] ** 2
        metrics |= {"objective/kl": kl.sum(1).mean().item(),
                    "objective/entropy": (accelerator.reduce(entropy_sum, "sum") / len(all_scores)).item(),
                    "objective/non_score_reward": non_score_reward.mean().item(),
                    "objective/rlhf_reward": rlhf_reward.nanmean().item(),
                    "objective/scores": all_scores.nanmean().item(),
                    "completions/unscored_ratio": 1 - scored.float().mean().item(),
                    "val/num_eos_tokens": accelerator.gather(finished.float()).sum().item(),
                    "completions/mean_length": all_mask.sum(1).mean().item(),
                    "grad_norm": float("nan" if grad_norm is None else grad_norm),
                    "lr": scheduler.get_last_lr()[0], "episode": episode,
                    "eps": (episode - start_episode) / (time.time() - start_time)}
        for name, values in per_source.items():
            metrics[f"rewards/{name}/mean"] = accelerator.gather(values.to(accelerator.device)).nanmean().item()
        metrics |= extras.flush() if extras else {}  # log_metric's
        if tools:  # TRL's tool metrics, and the episodes' turns
            metrics |= episode_metrics(accelerator, finished, episodes.turns, episodes.calls, episodes.failures)
        if stream:  # vllm/push_seconds; K >= 1: async/staleness and the seconds each side waited
            metrics |= stream.metrics()
        if is_stats:  # TRL's names; K >= 1: async/importance_ratio
            metrics |= {k if "/" in k else f"sampling/importance_sampling_ratio/{k}": v.item()
                        for k, v in is_stats.items()}
        if step % args.eval_steps == 0 or step == 1:
            shown = extras.rows(len(texts)) if extras else [{}] * len(texts)  # log_extra's columns
            table = [{"prompt": p, "completion": text, "score": score} | e
                     for p, text, score, e in zip(prompts, texts, scores.tolist(), shown)]
            tracker.log_samples(table[:args.num_sample_generations], step)
        tracker.log(metrics, step)
        # every --save_steps rollouts, and on SIGTERM / Ctrl-C / non-finite values
        checkpointer.end_of_step(step, lambda: {"episode": episode, "shuffler": shuffler.get_state(),
                                                **(stream.state() if stream else {})})

    # ---- SAVE ----
    if stream:
        stream.close()
    save_model(accelerator, model, tokenizer, args.output_dir)
    accelerator.print(f"saved model and tokenizer to {args.output_dir}")
    tracker.close()


if __name__ == "__main__":
    with exit_on_user_error(), stop_on_signal():
        main(tyro.cli(Args))
