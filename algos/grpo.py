"""Group Relative Policy Optimization (GRPO, Shao et al. 2024, "DeepSeekMath"): G completions per prompt, scored;
a completion's reward relative to its group's is the advantage of each of its tokens (no critic):

    A_i = (r_i - mean(r_group)) / std(r_group)                        (--scale_rewards group)
    loss = -min(ratio_t * A_i, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A_i) + beta * KL_t
    cispo: -sg(min(ratio_t, 1 + eps_high)) * A_i * log pi(o_t) replaces -min(...)           (MiniMax-M1, 2025)
    sapo:  -4 / tau * sigmoid(tau * (ratio_t - 1)) * A_i, tau = tau_pos if A_i > 0 else tau_neg   (Gao et al. 2025)

with ratio_t = pi(o_t) / pi_old(o_t), KL_t the k3 estimator exp(q) - q - 1, q = log pi_ref - log pi. A completion no
reward source scores (None / NaN: unknown, not 0) is left out of its group's mean and std and of the loss.
Variants: clip-higher, token-level normalisation, overlong punishment, dynamic sampling (DAPO, Yu et al. 2025); no
std scaling, a constant normaliser (Dr. GRPO, Liu et al. 2025); a sequence-level ratio (GSPO, Zheng et al. 2025);
batch-std scaling (REINFORCE++, Hu 2025); top_entropy_mask (Wang et al. 2025); the EOS trick (N+ implementation
details, Huang et al. 2024). --max_staleness K: decoupled PPO (Hilton et al. 2022; AReaL, Fu et al. 2025), clipped
to pi_old, tokens weighted by min(pi_old / pi_b, C) for batches drawn by pi_b (docs/async.md).

    python algos/grpo.py     # tiny TL;DR prompts, policy output/sft, reward model output/reward
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
from common.generation import SamplingArgs, completion_logps, generate, pad, rollout_logps, unwrapped_for_generation
from common.models import ModelArgs, adapt, hint_learning_rate, load_policy, load_tokenizer, prepare_frozen, reference
from common.rewards import asks_for_extras, compute_rewards, last_token_scores, load_reward_sources
from common.runtime import UserError, check_flags, exit_on_user_error, flags, lr_scheduler, setup, stop_on_signal
from common.tracking import Tracker, TrackingArgs, reduce_stats
# features, each entered only where its flags are given (docs/layout.md)
from common.episodes import EpisodeArgs, episode_metrics, load_tools
from common.packing import PackingArgs, packed_completion_logps, packed_scores
from common.resume import resume
from common.reward_extras import RewardExtras
from common.rollouts import RolloutArgs, RolloutStream, check_features
from common.sampler_correction import SamplerCorrectionArgs, importance_metrics, importance_weights
from common.vllm import VLLMArgs, VLLMSampler


@dataclass
class Args:
    # algorithm (module docstring)
    num_generations: int = 8
    """G, completions sampled per prompt"""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"] = "dapo"
    """token loss and normaliser: grpo (per sequence, then batch), bnpo (local batch tokens), dr_grpo (batch x
    max_completion_length), dapo (the global accumulated batch's tokens); cispo (as dapo), sapo (as grpo)"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """divide advantages by the group std, the batch std, or nothing (Dr. GRPO)"""
    beta: float = 0.04
    """weight of the k3 KL to the reference (0 loads no reference model)"""
    epsilon: float = 0.2
    """lower clip range of the ratio"""
    epsilon_high: float | None = None
    """upper clip range (DAPO clip-higher; default: epsilon); cispo: weight cap 1 + epsilon_high (TRL's 5.0 is 4.0)"""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """token ratios (GRPO) or one per sequence, the geometric mean of its token ratios (GSPO)"""
    num_iterations: int = 1
    """mu: optimizer passes over each generation batch (> 1 clips against the sampling-time logprobs)"""
    mask_truncated_completions: bool = False
    """leave completions that did not stop out of the loss (DAPO)"""
    top_entropy_quantile: float = 1.0
    """rho: the policy gradient only on each micro-batch's top-rho entropy tokens (1: all; Wang et al. 2025: 0.2)"""
    sapo_temperature_pos: float = 1.0
    """SAPO gate temperature tau_pos, for positive advantages"""
    sapo_temperature_neg: float = 1.05
    """tau_neg, for negative and zero advantages (larger: their off-policy tokens fade faster)"""
    missing_eos_penalty: float | None = None
    """subtracted from the reward of completions that did not stop (N+ detail: the EOS trick)"""
    overlong_buffer_length: int = 0
    """C: DAPO soft overlong punishment over the last C tokens before max_completion_length (0: off)"""
    overlong_penalty_factor: float = 1.0
    """the overlong punishment of a completion that reaches max_completion_length"""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards all agree, sample more prompts until the batch is full"""
    max_dynamic_sampling_rounds: int = 10
    """generation batches sampled at most per rollout; then constant groups fill what is missing"""

    # model, data and rewards
    model_name_or_path: str = "output/sft"
    """policy to start from, usually the SFT model"""
    disable_dropout: bool = True
    """no dropout (LoRA's too): the first pass's ratio is exactly 1 (as TRL)"""
    dataset_name: str = "tiny_tldr/tldr"
    """data with a prompt column (other columns go to reward functions); "": none, an environment's reset() prompts"""
    dataset_train_split: str = "train"
    """split whose prompts are used"""
    max_prompt_length: int = 512
    """prompt tokens kept (from the end)"""
    reward_model_paths: list[str] | None = None
    """reward models (one-output classifiers; default output/reward without --reward_funcs)"""
    reward_funcs: list[str] = field(default_factory=list)
    """reward functions `module:function`, called as TRL does (None or NaN: unscored)"""
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
    """share of the steps spent warming the learning rate up"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    max_steps: int = 200
    """optimizer steps (generation batches x num_iterations)"""
    per_device_train_batch_size: int = 32
    """completions per micro-batch per process"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step"""
    seed: int = 1
    """seed of the run (each completion gets a seed of its own)"""

    # output and samples
    output_dir: str = "output/grpo"
    """where the model, tokenizer and logs/<run_name>.jsonl are written"""
    eval_steps: int = 50
    """print sampled completions and their rewards every this many steps"""
    num_sample_generations: int = 4
    """completions shown in the samples table every eval_steps"""

    # flag groups, each in the module that reads it

    sampling: SamplingArgs = field(default_factory=SamplingArgs)
    model: ModelArgs = field(default_factory=ModelArgs)
    episodes: EpisodeArgs = field(default_factory=EpisodeArgs)
    rollouts: RolloutArgs = field(default_factory=RolloutArgs)
    packing: PackingArgs = field(default_factory=PackingArgs)
    vllm: VLLMArgs = field(default_factory=VLLMArgs)
    correction: SamplerCorrectionArgs = field(default_factory=SamplerCorrectionArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    tracking: TrackingArgs = field(default_factory=TrackingArgs)

    def __post_init__(self):
        if self.reward_model_paths is None:  # the default reward model only when nothing else scores
            scored = self.reward_funcs or self.episodes.environment_factory
            self.reward_model_paths = [] if scored else ["output/reward"]


# ---------------------------------------------------------------------------------------------
# ALGO LOGIC: group-relative advantages and the clipped loss
# ---------------------------------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """(r - mean of its group) / std; groups are consecutive runs of num_generations rewards.
    An unscorable completion (reward NaN) is left out of its group's mean and std and gets 0."""
    grouped = rewards.view(-1, num_generations)
    scored = ~grouped.isnan()
    n = scored.sum(dim=1, keepdim=True)
    centered = (grouped - grouped.nansum(dim=1, keepdim=True) / n.clamp(min=1)).masked_fill(~scored, 0.0)
    if scale_rewards == "group":  # the unbiased std of the scored rewards of the group
        centered = centered / ((centered.square().sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)).sqrt() + 1e-4)
    elif scale_rewards == "batch":
        centered = centered / (torch.nan_to_num(rewards[~rewards.isnan()].std()) + 1e-4)
    return centered.flatten()


def informative_groups(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """[groups] True where the scored rewards of the group do not all agree (else every advantage is 0)."""
    grouped = rewards.view(-1, num_generations)
    return (grouped - grouped.nanmean(dim=1, keepdim=True)).nan_to_num().abs().amax(dim=1) >= 1e-6


def informative_first(pool: list[dict], num_generations: int, size: int, max_rounds: int) -> dict | None:
    """DAPO dynamic sampling over the generation batches drawn (dicts of gathered tensors): None while fewer than
    `size` rows are of informative groups and fewer than max_rounds batches are drawn; then the first `size` rows,
    informative groups first."""
    keep = [informative_groups(b["rewards"], num_generations).repeat_interleave(num_generations) for b in pool]
    if sum(int(m.sum()) for m in keep) < size and len(pool) < max_rounds:
        return None
    return {k: torch.cat([b[k][m] for m, b in zip(keep, pool)] + [b[k][~m] for m, b in zip(keep, pool)])[:size]
            for k in pool[0]}


def overlong_penalty(lengths, max_completion_length: int, buffer_length: int, factor: float = 1.0):
    """DAPO's soft overlong punishment, L = max_completion_length, C = buffer_length: 0 to L - C, to -factor at L."""
    return ((max_completion_length - buffer_length - lengths) / buffer_length).clamp(min=-1, max=0) * factor


def top_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """mask, kept where the entropy reaches the (1 - quantile) quantile of the masked tokens' entropies."""
    if quantile >= 1 or not mask.any():
        return mask
    return mask * (entropy >= torch.quantile(entropy[mask.bool()].float(), 1 - quantile))


def grpo_loss(logps, old_logps, ref_logps, advantages, mask, *, loss_type: str = "dapo", epsilon: float = 0.2,
              epsilon_high: float = 0.2, beta: float = 0.0, importance_sampling_level: str = "token",
              max_completion_length: int = 0, num_items_in_batch: float = 0.0, token_weights=1.0,
              sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05):
    """The loss of a micro-batch and its statistics (means over mask: kl, the ratios clipped). logps/old_logps/
    ref_logps/mask: [B, T] over completion tokens; advantages: [B]; num_items_in_batch: dapo's normaliser;
    token_weights: of the policy-gradient term."""
    log_ratio = logps - old_logps
    if importance_sampling_level == "sequence":  # GSPO: one length-normalised ratio per sequence
        log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    ratio = torch.exp(log_ratio)
    a = advantages[:, None]
    if loss_type == "cispo":  # the weight is a constant: its gradient is the truncated REINFORCE one
        per_token = -torch.clamp(ratio, max=1 + epsilon_high).detach() * a * logps
    elif loss_type == "sapo":  # gradient -A * ratio * 4 s (1 - s), s = sigmoid(...): the on-policy -A at ratio 1
        tau = torch.where(a > 0, sapo_temperature_pos, sapo_temperature_neg)
        per_token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * a
    else:
        per_token = -torch.min(ratio * a, torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high) * a)
    per_token = per_token * token_weights
    tokens, stats = mask.sum().clamp(min=1), {}
    if beta:
        q = ref_logps - logps  # k3: an unbiased, always positive estimate of KL(pi || pi_ref)
        kl = torch.exp(q) - q - 1
        per_token = per_token + beta * kl
        stats["kl"] = (kl.detach() * mask).sum() / tokens
    if loss_type in ("grpo", "sapo"):
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    elif loss_type == "bnpo":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
    elif loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (mask.shape[0] * max_completion_length)
    elif loss_type in ("dapo", "cispo"):
        loss = (per_token * mask).sum() / num_items_in_batch
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    low, high = (ratio < 1 - epsilon) & (a < 0), (ratio > 1 + epsilon_high) & (a > 0)  # exclusive: a < 0, a > 0
    for name, clipped in (("low", low), ("high", high), ("region", low | high)):
        stats[f"clip_ratio/{name}_mean"] = (clipped.float() * mask).sum() / tokens
    return loss, stats


@dataclass
class Rollout:
    """One generation batch (this process's share), what its num_iterations updates need, and its metrics."""
    input_ids: torch.Tensor  # [B, P + T] left-padded prompts, then completions
    attention_mask: torch.Tensor
    prompt_width: int  # P
    completion_mask: torch.Tensor  # [B, T] up to and including the stop token
    loss_mask: torch.Tensor  # [B, T] the tokens in the loss
    advantages: torch.Tensor  # [B]
    old_logps: torch.Tensor | None  # [B, T] at sampling time (None when num_iterations == 1)
    ref_logps: torch.Tensor | None  # [B, T] (None when beta == 0)
    sampler_logps: torch.Tensor | None  # [B, T] vLLM's logprobs; K >= 1: the behaviour policy's
    metrics: dict  # logged with each of its updates
    samples: list  # the samples table's rows


def main(args: Args):
    check_flags(args)
    accelerator = setup(seed=args.seed, gradient_accumulation_steps=args.gradient_accumulation_steps,
                        per_device_train_batch_size=args.per_device_train_batch_size, max_grad_norm=args.max_grad_norm,
                        bf16=args.model.bf16, ddp_timeout=args.checkpoint.ddp_timeout)
    args.world_size, rank = accelerator.num_processes, accelerator.process_index
    args.tracking.run_name = args.tracking.run_name or f"grpo__{args.seed}__{int(time.time())}"
    # ---- batch sizes and features, checked before anything loads ----
    local_size = args.per_device_train_batch_size * args.gradient_accumulation_steps
    args.generation_batch_size = local_size * args.world_size
    n_prompts = args.generation_batch_size // args.num_generations
    sizes = (f"per_device_train_batch_size {args.per_device_train_batch_size} x gradient_accumulation_steps "
             f"{args.gradient_accumulation_steps} x {args.world_size} processes")
    if args.num_generations < 2 or args.generation_batch_size % args.num_generations:
        raise UserError(f"{sizes} = {args.generation_batch_size} completions per generation batch, which must be a "
                        f"multiple of num_generations {args.num_generations} (>= 2)")
    corrected = sampler = None
    if args.vllm.use_vllm or args.rollouts.max_staleness:
        corrected, vllm_options = check_features(args, accelerator)

    # ---- model, data and rewards ----
    tokenizer = load_tokenizer(args.model_name_or_path, chat_template_path=args.chat_template_path)
    rows, prompt_ids = load_prompts(tokenizer, args.dataset_name, args.dataset_train_split, "grpo.py",
                                    args.max_prompt_length, n_prompts,
                                    f"{sizes} / num_generations {args.num_generations}")
    e = args.episodes
    tools = load_tools(tokenizer, e.tools, e.environment_factory, local_size, rows, args.dynamic_sampling,
                       e.tool_timeout) if e.tools or e.environment_factory else None
    model = adapt(load_policy(args.model_name_or_path, tokenizer, args.model.torch_dtype),
                  gradient_checkpointing=args.model.gradient_checkpointing, lora=args.model.lora(),
                  no_dropout=args.disable_dropout)
    hint_learning_rate(accelerator, model, args.learning_rate, Args.learning_rate)
    ref_model = prepare_frozen(accelerator, load_policy(args.model_name_or_path, tokenizer, args.model.torch_dtype)) \
        if args.beta and not args.model.use_peft else None  # beta 0 needs none; LoRA turns adapters off instead
    logps_options = dict(temperature=args.temperature, **args.sampling.truncation())  # the distribution sampled
    sampling = dict(max_new_tokens=args.max_completion_length, repetition_penalty=args.sampling.repetition_penalty,
                    **logps_options)
    logps_of, scores_of = ((packed_completion_logps, packed_scores) if args.packing.padding_free
                           else (completion_logps, last_token_scores))
    batched = dict(batch_size=args.per_device_train_batch_size, logps=logps_of, **logps_options)
    loss_options = {k: getattr(args, k) for k in ("loss_type", "epsilon", "beta", "importance_sampling_level",
                    "max_completion_length", "sapo_temperature_pos", "sapo_temperature_neg")}
    loss_options["epsilon_high"] = args.epsilon if args.epsilon_high is None else args.epsilon_high
    sources, weights = load_reward_sources(args.reward_model_paths, args.reward_funcs, args.reward_weights, accelerator,
                                           functions=tools.reward_functions() if tools else [])
    extras = (RewardExtras(accelerator, args, len(rows) // n_prompts * args.generation_batch_size)
              if asks_for_extras(args.reward_funcs) else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = lr_scheduler(args.lr_scheduler_type, optimizer, math.ceil(args.warmup_ratio * args.max_steps),
                             args.max_steps)
    model, optimizer = accelerator.prepare(model, optimizer)  # not the scheduler (prepared, it steps per process)
    if args.vllm.use_vllm:
        sampler = VLLMSampler(accelerator, args.model_name_or_path,
                              args.max_prompt_length + args.max_completion_length, **vllm_options)
    checkpointer = Checkpointer(accelerator, scheduler, args.checkpoint, output_dir=args.output_dir,
                                run_name=args.tracking.run_name)
    resumed = resume(checkpointer) if args.checkpoint.resume_from_checkpoint else {}
    args.tracking.run_name = resumed.get("run_name", args.tracking.run_name)  # logs on in its JSONL
    tracker = Tracker(accelerator, args.tracking, output_dir=args.output_dir, config=flags(args),
                      total_steps=args.max_steps, start_step=resumed.get("step", 0))
    accelerator.print(f"{len(rows)} prompts; {args.max_steps} steps; {local_size} completions per process and "
                      f"batch ({args.num_generations} a prompt); rewards: "
                      + ", ".join(f"{name} (x{w})" for (name, _, _), w in zip(sources, weights)))

    step, episode = resumed.get("step", 0), resumed.get("episode", 0)  # episode: completions taken
    start_time, start_episode = time.time(), episode
    # endless, resumable: this rank's share of each global batch (each prompt G times)
    prompts_iter = prompt_batches(len(rows), n_prompts, args.num_generations, seed=args.seed, rank=rank,
                                  local_size=local_size,
                                  skip=resumed.get("requested", episode) // args.generation_batch_size)
    micro = [slice(i, i + args.per_device_train_batch_size)
             for i in range(0, local_size, args.per_device_train_batch_size)]
    stream = None
    if sampler or tools or args.rollouts.max_staleness:
        stream = RolloutStream(accelerator, args, rows, prompt_ids, tools, prompts_iter, resumed, model=model,
                               tokenizer=tokenizer, sampler=sampler, generate=generate, **sampling,
                               batch_size=args.generation_batch_size, logps=functools.partial(rollout_logps, **batched))

    # a rollout resumed mid-way
    rollout = Rollout(**resumed["rollout"]) if resumed.get("rollout") else None
    while step < args.max_steps:
        if stream and rollout is None:
            stream.publish(model, step // args.num_iterations)
        pool = []  # dynamic sampling's generation batches, gathered
        while rollout is None:
            # ---- ROLLOUT: num_generations completions per prompt from the current policy ----
            if stream is None:  # one turn, HF generate, a seed per completion from its place in the run
                indices = next(prompts_iter)
                seeds = [args.seed * 10**9 + episode + rank * local_size + j for j in range(local_size)]
                with unwrapped_for_generation(accelerator, model, args.model.ds3_gather_for_generation) as policy:
                    samples = generate(policy, tokenizer, [prompt_ids[i] for i in indices], seeds=seeds, **sampling)
                texts = tokenizer.batch_decode(samples.completion_ids, skip_special_tokens=True)
                prompts = [rows[i]["prompt"] for i in indices]
                completions, c_mask, columns, extra = as_completions(prompts, texts), samples.completion_mask, {}, {}
            else:  # episodes (tool results: context, not trained), vLLM's, or drawn ahead (K >= 1)
                indices, episodes = stream.next_batch(step // args.num_iterations)
                samples, completions, columns = episodes.samples, episodes.completions, episodes.columns
                c_mask, extra, prompts = samples.model_mask, episodes.batch() if tools else {}, episodes.prompts
            c_ids = samples.completion_ids

            # ---- SCORE: rewards (NaN: unscored) less the missing-EOS and overlong penalties ----
            columns = {k: [rows[i][k] for i in indices] for k in rows[0] if k != "prompt"} | columns
            rewards, per_source = compute_rewards(
                sources, weights, prompts=prompts, completions=completions,
                columns=columns, completion_ids=[c[m.bool()].tolist() for c, m in zip(c_ids, samples.completion_mask)],
                scores=scores_of, call=extras and extras.caller(step, episode), timeout=args.reward_timeout)
            episode += args.generation_batch_size
            rewards = rewards.to(accelerator.device)
            if args.missing_eos_penalty is not None:
                rewards = rewards - args.missing_eos_penalty * (~samples.finished).float()
            if args.overlong_buffer_length:
                rewards = rewards + overlong_penalty(c_mask.sum(1), args.max_completion_length,
                                                     args.overlong_buffer_length, args.overlong_penalty_factor)
            batch = dict(indices=torch.tensor(indices), completion_ids=c_ids, completion_mask=c_mask,
                         rewards=rewards, finished=samples.finished.long(), sampler_logps=samples.sampler_logps,
                         per_source=torch.stack(list(per_source.values()), 1), **extra)
            if args.dynamic_sampling:  # DAPO: more generation batches until the groups whose rewards differ fill one
                pool.append({k: accelerator.gather(v.to(accelerator.device)) for k, v in batch.items()
                             if v is not None})
                kept = informative_first(pool, args.num_generations, args.generation_batch_size,
                                         args.max_dynamic_sampling_rounds)
                if kept is None:
                    continue
                batch = {k: v.chunk(args.world_size)[rank] for k, v in kept.items()}
                prompts = [rows[i]["prompt"] for i in batch["indices"].tolist()]
            indices, c_ids, c_mask = batch["indices"].tolist(), batch["completion_ids"], batch["completion_mask"]
            rewards, finished = batch["rewards"], batch["finished"].bool()
            p_ids, p_mask = (batch["prompt_ids"], batch["prompt_mask"]) if tools else (
                t.to(c_ids.device) for t in pad([prompt_ids[i] for i in indices], tokenizer.pad_token_id, "left"))
            input_ids = torch.cat([p_ids, c_ids], 1)  # tool results: attended to, not trained
            attention_mask = torch.cat([p_mask, batch.get("episode_mask", c_mask)], 1)

            # ---- ADVANTAGES: relative to the group, over the global batch (unscorable: 0, out of the loss) ----
            all_rewards = accelerator.gather(rewards)
            advantages = group_advantages(all_rewards, args.num_generations, args.scale_rewards)
            advantages = advantages[rank * local_size:(rank + 1) * local_size]
            loss_mask = c_mask.float() * ~rewards.isnan()[:, None]
            if args.mask_truncated_completions:
                loss_mask = loss_mask * finished[:, None]
            old_logps = ref_logps = None
            if args.num_iterations > 1:  # sampling-time logprobs for all mu passes
                old_logps = rollout_logps(model, input_ids, attention_mask, p_ids.shape[1], **batched)
            if args.beta:
                with reference(accelerator, model, ref_model) as ref:
                    ref_logps = rollout_logps(ref, input_ids, attention_mask, p_ids.shape[1], **batched)
            scored = all_rewards[~all_rewards.isnan()]  # metrics (TRL's names)
            metrics = {
                "reward": scored.mean().item(), "reward_std": scored.std().item(),
                "completions/mean_length": accelerator.gather(c_mask.sum(1).float()).mean().item(),
                "completions/clipped_ratio": 1 - accelerator.gather(finished.float()).mean().item(),
                "completions/unscored_ratio": 1 - len(scored) / len(all_rewards),
                "frac_reward_zero_std": (~informative_groups(all_rewards, args.num_generations)).float().mean().item()}
            for (name, _, _), values in zip(sources, batch["per_source"].T):
                metrics[f"rewards/{name}/mean"] = accelerator.gather(values.to(accelerator.device)).nanmean().item()
            if tools:
                metrics |= episode_metrics(accelerator, finished, batch["turns"], batch["calls"], batch["failures"])
            if args.dynamic_sampling:
                metrics["dynamic_sampling/rounds"] = len(pool)
            metrics |= extras.flush() if extras else {}
            texts = tokenizer.batch_decode(c_ids[:args.num_sample_generations], skip_special_tokens=True)
            shown = extras.rows(len(texts)) if extras else [{}] * len(texts)
            rollout = Rollout(input_ids=input_ids, attention_mask=attention_mask, prompt_width=p_ids.shape[1],
                              completion_mask=c_mask, loss_mask=loss_mask, advantages=advantages,
                              old_logps=old_logps, ref_logps=ref_logps, sampler_logps=batch.get("sampler_logps"),
                              metrics=metrics, samples=[{"prompt": p, "completion": t, "reward": x} | e
                                                        for p, t, x, e in zip(prompts, texts, rewards.tolist(), shown)])

        # ---- UPDATE: one optimizer step on the rollout (num_iterations per rollout) ----
        r, stats, corrections = rollout, defaultdict(float), []  # stats: sums
        # dapo: the global batch's tokens, per micro-batch (backward() and DDP average over them)
        tokens = accelerator.reduce(r.loss_mask.sum(), "sum").clamp(min=1)
        num_items = tokens / (args.gradient_accumulation_steps * args.world_size)
        for s in micro:
            with accelerator.accumulate(model):
                logps, entropy = logps_of(model, r.input_ids[s], r.attention_mask[s], r.prompt_width, entropy=True,
                                          **logps_options)
                old = logps.detach() if r.old_logps is None else r.old_logps[s]  # mu == 1: ratio 1
                ref_logps = None if r.ref_logps is None else r.ref_logps[s]
                mask = r.loss_mask[s]
                is_weights = 1.0  # sampler correction: vLLM's pi is not quite the trainer's
                if r.sampler_logps is not None and corrected:
                    is_weights, is_stats = importance_weights(old, r.sampler_logps[s], r.completion_mask[s],
                                                              **corrected)
                    corrections.append(is_stats)
                if args.rollouts.max_staleness:  # decoupled PPO: clipped to pi_old (mu == 1: the policy now), each
                    stale = torch.exp(old - r.sampler_logps[s]) * mask  # token weighted by pi_old / pi_behaviour
                    stats["async/importance_ratio"] += stale.sum() / mask.sum().clamp(min=1)
                    is_weights = is_weights * stale.clamp(max=args.rollouts.async_importance_sampling_cap)
                pg_mask = top_entropy_mask(entropy, mask, args.top_entropy_quantile)  # the 80/20 rule
                loss, loss_stats = grpo_loss(logps, old, ref_logps, r.advantages[s], mask, num_items_in_batch=num_items,
                                             token_weights=is_weights * pg_mask, **loss_options)
                if checkpointer.finite_loss(loss):  # DeepSpeed: backward steps the engine, check first
                    accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    if not checkpointer.finite(loss=stats["loss"] + loss.detach(), grad_norm=grad_norm):
                        optimizer.zero_grad()  # drop this update: the step then changes nothing
                optimizer.step()
                optimizer.zero_grad()
            stats["loss"] += loss.detach()
            stats["entropy"] += (entropy * mask).sum() / mask.sum().clamp(min=1)
            for name, value in loss_stats.items():
                stats[name] += value
        scheduler.step()
        tracker.step()
        step += 1

        # ---- LOG ----
        metrics = reduce_stats(accelerator, stats, args.gradient_accumulation_steps) | r.metrics | {
            "grad_norm": float("nan" if grad_norm is None else grad_norm), "lr": scheduler.get_last_lr()[0],
            "episode": episode, "eps": (episode - start_episode) / (time.time() - start_time)}
        if stream:  # vllm/*, async/*
            metrics.update(stream.metrics())
        if corrections:
            metrics.update(importance_metrics(accelerator, corrections))
        if step % args.eval_steps == 0 or step == 1:
            tracker.log_samples(r.samples, step)
        tracker.log(metrics, step)
        if step % args.num_iterations == 0:  # the next step samples a new rollout
            rollout = None
        # every --save_steps; on SIGTERM / Ctrl-C / non-finite values
        checkpointer.end_of_step(step, lambda: {"episode": episode, "rollout": rollout and vars(rollout),
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
