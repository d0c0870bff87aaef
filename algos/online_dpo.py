"""Online DPO: DPO on pairs the current policy samples and a reward model (or judge) ranks.

Online AI Feedback (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback"):
offline DPO learns from pairs sampled by another model, which drift off-policy as training moves
on. Here every step samples two completions per prompt from the current policy, a reward model,
reward functions or a pairwise judge picks the better one, and the DPO loss (Rafailov et al. 2023)
against the frozen reference follows:

    h = [log pi(y_w) - log pi_ref(y_w)] - [log pi(y_l) - log pi_ref(y_l)]
    sigmoid: -log sigmoid(beta * h)          ipo: (h - 1 / (2 beta))^2   (Azar et al. 2023)

The EOS trick of the N+ implementation details (Huang et al. 2024) applies: completions that did
not stop lose `missing_eos_penalty` before the ranking.

    python algos/online_dpo.py    # tiny TL;DR prompts, policy output/sft, reward model output/reward
    accelerate launch algos/online_dpo.py --model_name_or_path output/pythia-1b-sft \
        --dataset_name trl-lib/tldr --reward_model_paths output/pythia-1b-rm --learning_rate 5e-7 \
        --beta 0.1 --max_new_tokens 53 --missing_eos_penalty 1.0 --output_dir output/pythia-1b-online-dpo ...
"""

import math
import os
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # copies import their own common/
from common.checkpoint import CheckpointArgs, Checkpointer, save_model
from common.data import as_completions, load_prompts
from common.generation import generate, shifted_logits, token_logprobs, unwrapped_for_generation
from common.models import ModelArgs, adapt, hint_learning_rate, load_policy, load_tokenizer, prepare_frozen, reference
from common.packing import PackingArgs, packed_completion_logps, packed_scores  # --padding_free
from common.resume import resume  # --resume_from_checkpoint
from common.reward_extras import RewardExtras  # a reward function asking for TRL's extras, or async
from common.rewards import (asks_for_extras, called, compute_rewards, import_function, last_token_scores,
                            load_reward_sources)
from common.runtime import (UserError, check_flags, exit_on_user_error, flags, lr_scheduler,
                            setup, stop_on_signal)
from common.tracking import Tracker, TrackingArgs, reduce_stats
from common.vllm import VLLMArgs, VLLMSampler, sampler_options


@dataclass
class Args:
    # algorithm: the DPO loss on pairs the policy samples (module docstring)
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    """DPO loss on the sampled pair"""
    beta: list[float] = field(default_factory=lambda: [0.1])
    """KL strength; a list gives one value per epoch (the last one is kept afterwards)"""
    missing_eos_penalty: float | None = None
    """subtracted from the score of completions that did not stop (N+ detail: the EOS trick)"""

    # model, data and ranking
    model_name_or_path: str = "output/sft"
    """policy to start from, usually the SFT model; also the frozen reference"""
    disable_dropout: bool = True
    """no dropout in the policy (LoRA's included): its logprobs and the reference's (LoRA: adapters off) are then
    exact, not noisy (as TRL)"""
    dataset_name: str = "tiny_tldr/tldr"
    """data with a prompt column (standard or conversational); other columns go to reward functions"""
    dataset_train_split: str = "train"
    """split whose prompts are used"""
    max_length: int = 512
    """prompt + completion tokens: prompts lose their start to leave max_new_tokens for the completion"""
    reward_model_paths: list[str] | None = None
    """reward models (one-output classifiers; default output/reward when neither --reward_funcs nor --judge is given)"""
    reward_funcs: list[str] = field(default_factory=list)
    """reward functions `module:function`, called as TRL does (None or NaN: not scored by it; common/rewards.py)"""
    reward_weights: list[float] | None = None
    """weight of each reward, models first (default all 1; 0: logged as rewards/<name>/mean, not optimised)"""
    reward_timeout: float = 600
    """seconds a reward function (or the judge) may take on a batch, else the run ends, naming it (0: no limit)"""
    judge: str | None = None
    """pairwise judge `module:function(prompts, completion_pairs) -> list[int]` (index of the better
    completion); replaces the rewards"""

    # sampling
    max_new_tokens: int = 48
    """tokens sampled per completion"""
    temperature: float = 0.9
    """sampling temperature (the DPO loss itself uses the policy's logprobs at temperature 1)"""

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
    max_steps: int = 150
    """optimizer steps to run"""
    per_device_train_batch_size: int = 16
    """prompts per micro-batch per process (two completions each)"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step"""
    seed: int = 1
    """seed of the run (models load alike on every process; each completion is sampled with its own seed)"""

    # output and samples
    output_dir: str = "output/online_dpo"
    """where the model, tokenizer and logs/<run_name>.jsonl are written"""
    eval_steps: int = 50
    """print a table of sampled pairs with their scores every this many steps"""
    num_sample_generations: int = 4
    """pairs shown in the samples table every eval_steps"""

    # filled in at runtime
    world_size: int = 0
    """number of processes (set at runtime)"""
    total_batch_size: int = 0
    """prompts per optimizer step = per_device_train_batch_size x gradient_accumulation_steps x world_size"""
    num_steps: int = 0
    """optimizer steps of the run (set at runtime)"""

    # shared groups, each defined where it is read: common/{models,vllm,checkpoint,tracking}.py

    model: ModelArgs = field(default_factory=ModelArgs)
    packing: PackingArgs = field(default_factory=PackingArgs)
    vllm: VLLMArgs = field(default_factory=VLLMArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    tracking: TrackingArgs = field(default_factory=TrackingArgs)

    def __post_init__(self):
        if self.reward_model_paths is None:  # the default reward model only when nothing else scores
            self.reward_model_paths = [] if self.reward_funcs or self.judge else ["output/reward"]


# ---------------------------------------------------------------------------------------------
# ALGO LOGIC: pick the pair, then the DPO loss
# ---------------------------------------------------------------------------------------------
def select_chosen(scores: torch.Tensor) -> torch.Tensor:
    """Index (0 or 1) of the chosen completion of each pair from scores [B, 2]; a tie goes to 0."""
    return (scores[:, 1] > scores[:, 0]).long()


def import_judge(spec: str, timeout: float = 0):
    """The pairwise judge `module:function(prompts, completion_pairs) -> list[int]`, wrapped so that
    whatever it does wrong (raises, hangs past `timeout` seconds, returns the wrong length or other than 0 / 1) is
    one line."""
    judge = import_function(spec, "judge")

    def checked(prompts, completion_pairs):
        picks = called(spec, judge, {}, timeout, args=(prompts, completion_pairs), what="judge")
        if (not isinstance(picks, (list, tuple)) or len(picks) != len(completion_pairs)
                or any(p not in (0, 1) for p in picks)):
            raise UserError(f"judge '{spec}' returned {str(picks)[:60]!r}; it must return 0 or 1 (the index of the "
                            f"better completion) for each of the {len(completion_pairs)} pairs")
        return list(picks)
    return checked


def judge_scores(picks) -> torch.Tensor:
    """A pairwise judge ranks without scores: per pair [1 - pick, pick], so its pick scores 1."""
    return torch.tensor([[1.0 - p, float(p)] for p in picks]).flatten()


def pair_rows(scores: torch.Tensor):
    """Rows 2j and 2j + 1 hold prompt j's two completions, scored `scores` [2B] (NaN: unscored).
    Returns the chosen rows (the higher score; a tie: the first), the rejected rows, and which pairs
    are ranked: a pair with an unscored completion cannot be, and stays out of the loss."""
    pairs = scores.view(-1, 2)
    ranked = ~pairs.isnan().any(dim=1)
    chosen = select_chosen(pairs.nan_to_num())
    first = torch.arange(len(pairs), device=scores.device) * 2
    return first + chosen, first + 1 - chosen, ranked


def online_dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta: float,
                    loss_type: str = "sigmoid"):
    """Per-pair losses and implicit rewards beta * log(pi / pi_ref) (detached); logps are sums
    over completion tokens."""
    chosen_ratio, rejected_ratio = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
    h = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    return losses, (beta * chosen_ratio).detach(), (beta * rejected_ratio).detach()


def sequence_logps(policy, input_ids, attention_mask, completion_ids, completion_mask, *, prompt_width,
                   padding_free: bool = False):
    """Summed completion logprobs per row, at temperature 1 (the DPO objective is about pi itself); padding_free:
    from one packed row, position ids restarting per row (common/packing.py)."""
    if padding_free:
        return (packed_completion_logps(policy, input_ids, attention_mask, prompt_width, 1.0) * completion_mask).sum(-1)
    logits = shifted_logits(policy, input_ids, attention_mask, prompt_width - 1)
    return (token_logprobs(logits, completion_ids) * completion_mask).sum(-1)


def prompt_batches(num_rows: int, per_step: int, *, seed: int, rank: int, world_size: int):
    """Endless shuffled global batches of per_step row indices, this process's share of each (every world_size-th
    from `rank`): the same order on every process."""
    rng = random.Random(seed)
    while True:
        order = list(range(num_rows))
        rng.shuffle(order)
        for start in range(0, num_rows - per_step + 1, per_step):
            yield order[start:start + per_step][rank::world_size]


def main(args: Args):
    check_flags(args)  # before anything loads: sizes and rates > 0, an output_dir free to use
    accelerator = setup(seed=args.seed, gradient_accumulation_steps=args.gradient_accumulation_steps,
                        per_device_train_batch_size=args.per_device_train_batch_size, max_grad_norm=args.max_grad_norm,
                        bf16=args.model.bf16, ddp_timeout=args.checkpoint.ddp_timeout)
    args.world_size = accelerator.num_processes
    args.tracking.run_name = args.tracking.run_name or f"online_dpo__{args.seed}__{int(time.time())}"
    args.total_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    args.num_steps = args.max_steps
    if args.max_new_tokens >= args.max_length:
        raise UserError(f"max_new_tokens {args.max_new_tokens} leaves no room for a prompt "
                        f"under max_length {args.max_length}")

    vllm_options = (sampler_options(args.vllm, accelerator, seed=args.seed, dtype=args.model.torch_dtype,
                                    use_peft=args.model.use_peft) if args.vllm.use_vllm else None)
    # no --vllm_importance_sampling_* (grpo, rloo, ppo have them): the DPO loss is a preference loss on the sampled
    # pairs, not an importance-weighted estimate under pi, so no ratio pi_train / pi_vllm enters it (README)
    # ---- model, data and ranking ----
    tokenizer = load_tokenizer(args.model_name_or_path)
    rows, prompt_ids = load_prompts(tokenizer, args.dataset_name, args.dataset_train_split, "online_dpo.py",
                                    args.max_length - args.max_new_tokens,
                                    args.per_device_train_batch_size * args.world_size,
                                    f"per_device_train_batch_size {args.per_device_train_batch_size} x "
                                    f"{args.world_size} processes")
    steps_per_epoch = max(1, len(rows) // args.total_batch_size)
    model = adapt(load_policy(args.model_name_or_path, tokenizer, args.model.torch_dtype),
                  gradient_checkpointing=args.model.gradient_checkpointing, lora=args.model.lora(),
                  no_dropout=args.disable_dropout)
    hint_learning_rate(accelerator, model, args.learning_rate, Args.learning_rate)
    ref_model = None  # frozen, never wrapped for DDP; with LoRA, the policy with adapters off
    if not args.model.use_peft:
        ref_model = prepare_frozen(accelerator, load_policy(args.model_name_or_path, tokenizer, args.model.torch_dtype))
    judge = extras = None
    if args.judge:
        judge = import_judge(args.judge, args.reward_timeout)
    else:
        sources, weights = load_reward_sources(args.reward_model_paths, args.reward_funcs, args.reward_weights,
                                               accelerator)
        per_pass = 2 * (len(rows) - len(rows) % (args.per_device_train_batch_size * args.world_size))  # completions
        extras = (RewardExtras(accelerator, args, per_pass, table=False)  # TRL's trainer_state, log_metric
                  if asks_for_extras(args.reward_funcs) else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = lr_scheduler(args.lr_scheduler_type, optimizer, math.ceil(args.warmup_ratio * args.num_steps),
                             args.num_steps)
    # the scheduler is not prepared: accelerate would step it once per process per call
    model, optimizer = accelerator.prepare(model, optimizer)
    sampler = (VLLMSampler(accelerator, args.model_name_or_path, args.max_length, **vllm_options)
               if args.vllm.use_vllm else None)
    checkpointer = Checkpointer(accelerator, scheduler, args.checkpoint, output_dir=args.output_dir,
                                run_name=args.tracking.run_name)
    # --resume_from_checkpoint: weights, optimizer, RNGs, step and the loop's state (common/resume.py)
    resumed = resume(checkpointer) if args.checkpoint.resume_from_checkpoint else {}
    args.tracking.run_name = resumed.get("run_name", args.tracking.run_name)  # a resumed run logs on in its JSONL
    tracker = Tracker(accelerator, args.tracking, output_dir=args.output_dir, config=flags(args),
                      total_steps=args.num_steps, start_step=resumed.get("step", 0))
    ranked_by = "judge " + args.judge if judge else ", ".join(n for n, _, _ in sources)
    accelerator.print(f"{len(rows)} prompts; {args.num_steps} steps of {args.total_batch_size} prompts x 2 completions;"
                      f" ranked by {ranked_by}")

    batches = prompt_batches(len(rows), args.per_device_train_batch_size * args.world_size, seed=args.seed,
                             rank=accelerator.process_index, world_size=args.world_size)
    for _ in range(resumed.get("step", 0) * args.gradient_accumulation_steps):  # the data position
        next(batches)
    episode = resumed.get("episode", 0)  # also gives the sampling seeds
    start_time, start_episode, push_seconds = time.time(), episode, float("nan")  # eps counts this process's episodes
    for step in range(resumed.get("step", 0) + 1, args.num_steps + 1):
        beta = args.beta[min((step - 1) // steps_per_epoch, len(args.beta) - 1)]
        stats, source_scores = defaultdict(float), defaultdict(list)  # name -> sum over micro-batches; scores
        if sampler is not None and step > 1:  # the policy changed since the engine last got its weights
            push_seconds = sampler.push_weights(model)
        for _ in range(args.gradient_accumulation_steps):
            # ---- ROLLOUT: two completions per prompt from the current policy ----
            indices = next(batches)
            pair_indices = [i for i in indices for _ in range(2)]  # rows 2j and 2j + 1 share prompt j
            # one seed per completion, from the prompt's place in the global batch: the same samples on 1 or N processes
            seeds = [args.seed * 10**9 + episode + 2 * (j * args.world_size + accelerator.process_index) + k
                     for j in range(len(indices)) for k in range(2)]
            batch_prompt_ids = [prompt_ids[i] for i in pair_indices]
            if sampler is not None:
                if sampler.needs_push:  # sleep level 2 dropped the engine's weights after its last rollout
                    push_seconds = sampler.push_weights(model)
                samples = sampler.generate(tokenizer, batch_prompt_ids, args.max_new_tokens,
                                           temperature=args.temperature, seeds=seeds)
            else:
                with unwrapped_for_generation(accelerator, model, args.model.ds3_gather_for_generation) as unwrapped:
                    samples = generate(unwrapped, tokenizer, batch_prompt_ids, args.max_new_tokens,
                                       temperature=args.temperature, seeds=seeds)
            p_ids, p_mask = samples.prompt_ids, samples.prompt_mask
            c_ids, c_mask = samples.completion_ids, samples.completion_mask
            finished = samples.finished
            input_ids, attention_mask = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1)
            prompt_width = p_ids.shape[1]

            # ---- SCORE: reward models and functions, or the judge; the EOS trick ----
            texts = tokenizer.batch_decode(c_ids, skip_special_tokens=True)
            prompts = [rows[i]["prompt"] for i in pair_indices]
            completions = as_completions(prompts, texts)
            if judge is not None:
                picks = judge(prompts[::2], list(zip(completions[::2], completions[1::2])))
                scores = judge_scores(picks).to(accelerator.device)
            else:
                columns = {k: [rows[i][k] for i in pair_indices] for k in rows[0] if k != "prompt"}
                completion_ids = [ids[m.bool()].tolist() for ids, m in zip(c_ids, c_mask)]
                scores, per_source = compute_rewards(
                    sources, weights, prompts=prompts, completions=completions, columns=columns,
                    completion_ids=completion_ids, call=extras and extras.caller(step - 1, episode),
                    timeout=args.reward_timeout,
                    scores=packed_scores if args.packing.padding_free else last_token_scores)
                scores = scores.to(accelerator.device)
                for name, values in per_source.items():  # each source's scores of the step, logged as one mean
                    source_scores[name].append(values.to(accelerator.device))
            if args.missing_eos_penalty is not None:
                scores = scores - args.missing_eos_penalty * (~finished).float()
            # counted after scoring: trainer_state.epoch is the batches done before this one
            episode += len(pair_indices) * args.world_size

            # ---- ADVANTAGES (DPO's: the ranking): chosen = the higher score (ties: the first sample). A pair
            # with an unscorable completion (no reward source scored it: NaN) stays out of the loss (its share
            # of the mean is 0); score metrics count it as 0
            rows_c, rows_r, ranked = pair_rows(scores)
            unscored, pairs = scores.isnan().float().mean(), scores.nan_to_num().view(-1, 2)

            # ---- UPDATE: the DPO loss on (chosen, rejected) against the reference ----
            with accelerator.accumulate(model):
                logps = sequence_logps(model, input_ids, attention_mask, c_ids, c_mask, prompt_width=prompt_width,
                                       padding_free=args.packing.padding_free)
                with torch.no_grad(), reference(accelerator, model, ref_model) as ref:
                    ref_logps = sequence_logps(ref, input_ids, attention_mask, c_ids, c_mask, prompt_width=prompt_width,
                                               padding_free=args.packing.padding_free)
                losses, reward_c, reward_r = online_dpo_loss(logps[rows_c], logps[rows_r], ref_logps[rows_c],
                                                             ref_logps[rows_r], beta=beta, loss_type=args.loss_type)
                loss = (losses * ranked).sum() / len(losses)
                if checkpointer.finite_loss(loss):  # under DeepSpeed backward steps the engine: check first
                    accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    if not checkpointer.finite(loss=stats["loss"] + loss.detach(), grad_norm=grad_norm):
                        optimizer.zero_grad()  # drop this update: the step below then changes nothing
                optimizer.step()
                optimizer.zero_grad()
            kl = (logps.detach() - ref_logps).view(-1, 2).mean(1)  # per prompt, over its two samples
            margin = (pairs.flatten()[rows_c] - pairs.flatten()[rows_r]).mean()
            stats["loss"] += loss.detach()
            stats["objective/kl"] += kl.mean()
            stats["objective/entropy"] += -logps.detach().mean()
            stats["objective/scores"] += pairs.mean()
            stats["objective/scores_margin"] += margin
            stats["rewards/chosen"] += reward_c.mean()
            stats["rewards/rejected"] += reward_r.mean()
            stats["rewards/accuracies"] += (reward_c > reward_r).float().mean()
            stats["logps/chosen"] += logps.detach()[rows_c].mean()
            stats["logps/rejected"] += logps.detach()[rows_r].mean()
            stats["val/contain_eos_token"] += finished.float().mean()
            stats["objective/rlhf_reward"] += (pairs.mean(1) - beta * kl).mean()
            stats["completions/unscored_ratio"] += unscored
        scheduler.step()
        tracker.step()

        # ---- LOG (TRL's online DPO names) ----
        metrics = reduce_stats(accelerator, stats, args.gradient_accumulation_steps)
        metrics |= extras.flush() if extras else {}  # log_metric's
        for name, values in source_scores.items():
            metrics[f"rewards/{name}/mean"] = accelerator.gather(torch.cat(values)).nanmean().item()
        metrics |= {"objective/non_score_reward": -beta * metrics["objective/kl"],
                    "rewards/margins": metrics["rewards/chosen"] - metrics["rewards/rejected"], "beta": beta,
                    "grad_norm": float("nan" if grad_norm is None else grad_norm), "lr": scheduler.get_last_lr()[0],
                    "episode": episode, "eps": (episode - start_episode) / (time.time() - start_time)}
        if sampler is not None:
            metrics["vllm/push_seconds"] = push_seconds
        if step % args.eval_steps == 0 or step == 1:
            tracker.log_samples([{"prompt": prompts[2 * j], "chosen": texts[rows_c[j]], "rejected": texts[rows_r[j]],
                                  "margin": float(pairs.flatten()[rows_c[j]] - pairs.flatten()[rows_r[j]])}
                                 for j in range(min(args.num_sample_generations, len(indices)))], step)
        tracker.log(metrics, step)
        # every --save_steps, and on SIGTERM / Ctrl-C / non-finite values
        checkpointer.end_of_step(step, {"episode": episode})

    # ---- SAVE ----
    os.makedirs(args.output_dir, exist_ok=True)
    save_model(accelerator, model, tokenizer, args.output_dir)
    accelerator.print(f"saved model and tokenizer to {args.output_dir}")
    tracker.close()


if __name__ == "__main__":
    with exit_on_user_error(), stop_on_signal():
        main(tyro.cli(Args))
