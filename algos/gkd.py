"""GKD: on-policy distillation. The student samples; the teacher grades every token of the student's own sample.

Generalized Knowledge Distillation (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning
from Self-Generated Mistakes"): supervised KD trains the student on sequences it would not produce itself, and at
inference it meets its own mistakes, which it never learnt to recover from. Here a share `lmbda` of the prompts
get completions the student samples (on-policy); the rest use the dataset's completions (supervised KD). On every
completion token the student's next-token distribution Q is pulled towards the teacher's P by

    D_beta = [beta KL(P || M) + (1 - beta) KL(Q || M)] / (beta (1 - beta)),    M = beta P + (1 - beta) Q
    D_0 = KL(P || Q)  (forward KL: what supervised KD minimises)     D_1 = KL(Q || P)  (reverse KL: mode-seeking)

summed over the vocabulary and averaged over the step's completion tokens. lmbda 1 with beta 1 is the recipe
popularised as "on-policy distillation" (Thinking Machines, 2025; MiniLLM, Gu et al. 2024, also minimises the
reverse KL). `--loss_type token_reward` is that write-up's form: each sampled token is rewarded with
log P(y_t) - log Q(y_t) (minus the per-token reverse KL) and the student follows the policy gradient, which in
expectation is the gradient of D_1 from one token instead of the whole vocabulary.

Decided against TRL's GKD (its GKDTrainer, read in 2026), on purpose:
- D_beta is the generalised JSD divided by beta (1 - beta). Undivided it tends to 0 as beta -> 0 or 1, so an
  implementation that computes the ends as plain KLs (TRL does) jumps from ~0 to a KL there; divided, beta
  0.01 and 0 give nearly the same loss. Inside (0, 1) it is TRL's value times 1 / (beta (1 - beta)) (4x at 0.5).
- The on/off-policy draw is per prompt, from its place in the run and the seed, not `random() <= lmbda` per
  batch and process: the same prompts are sampled on 1 or N processes, and a run resumes exactly.
- The divergence is taken at temperature 1, as TRL does: distillation matches the models' distributions at the
  states visited; `--temperature` only explores (it decides which states). Supervised KD's softening temperature
  (Hinton et al. 2015) is another knob, left out.
- No sampling from the teacher (TRL's seq_kd): off-policy rows use the dataset, which needs no teacher generate.
- Agents (`--tools`, `--environment_factory`, as grpo.py's: common/episodes.py): the student's episodes, turn after
  turn with the tools' results between them; the teacher grades the student's own tokens of each episode, the
  results are context for both (TRL's distillation trainer takes environment_factory too). Fully on-policy only
  (--lmbda 1): a dataset completion is one turn, with no calls to put results after.
- Memory: the divergence and its gradient (written out in `_Divergence`) are taken a chunk of positions at a time
  in fp32 (float64 within 0.05 of beta 0 or 1: `_chunk_dtype`), so no fp32 copy of either [B, T, V] logit tensor
  exists (at a 150k vocabulary x 2 x 1024 positions a pair is 2.5 GB) and the student's gradient is one tensor of
  its logits' dtype (benchmarks/results/memory.md: 0.67x both logits above them; TRL's whole-tensor loss 7.5x).

    python algos/gkd.py    # tiny TL;DR: the SFT student distilled from output/ppo
    accelerate launch algos/gkd.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
        --teacher_model_name_or_path Qwen/Qwen2.5-7B-Instruct --dataset_name trl-lib/tldr --lmbda 1 --beta 1 ...
"""

import contextlib
import functools
import math
import os
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # copies import their own common/
from common.checkpoint import CheckpointArgs, Checkpointer, save_model
from common.data import check_columns, check_prompts_fill_a_batch, encode_completion, encode_prompt, load_split
from common.episodes import EpisodeArgs, episode_metrics, load_tools, run_episodes  # --tools, --environment_factory
from common.generation import generate, pad, shifted_logits, token_logprobs, unwrapped_for_generation
from common.models import ModelArgs, adapt, hint_learning_rate, load_policy, load_tokenizer, prepare_frozen
from common.packing import PackingArgs, packed_completion_logits  # --padding_free
from common.resume import resume  # --resume_from_checkpoint
from common.runtime import (UserError, check_flags, exit_on_user_error, flags, lr_scheduler,
                            setup, stop_on_signal)
from common.tracking import Tracker, TrackingArgs, reduce_stats
from common.vllm import VLLMArgs, VLLMSampler, sampler_options


@dataclass
class Args:
    # algorithm: the divergence on the student's samples (module docstring)
    lmbda: float = 1.0
    """share of prompts whose completion the student samples (1: fully on-policy; 0: the dataset's: supervised KD)"""
    beta: float = 1.0
    """0: forward KL(teacher || student); 1: reverse KL(student || teacher); between: the generalised JSD"""
    loss_type: Literal["jsd", "token_reward"] = "jsd"
    """jsd: D_beta over the whole vocabulary; token_reward: log P - log Q of each sampled token as its reward
    (the reverse KL's policy gradient from one token; needs lmbda 1 and temperature 1)"""

    # models and data
    model_name_or_path: str = "output/sft"
    """the student, usually an SFT model"""
    disable_dropout: bool = True
    """no dropout in the student: its distributions are then exact, not noisy (as TRL)"""
    teacher_model_name_or_path: str = "output/ppo"
    """the teacher: any causal LM with the student's tokenizer (vocabulary)"""
    dataset_name: str = "tiny_tldr/tldr"
    """prompt-only (lmbda 1) or prompt-completion data, standard or conversational"""
    dataset_train_split: str = "train"
    """split whose prompts are used"""
    max_length: int = 512
    """prompt + completion tokens: prompts lose their start to leave max_new_tokens for the completion"""
    chat_template_path: str | None = None
    """a Jinja file or tokenizer whose chat template replaces the student's (e.g. configs/chatml_tools.jinja)"""

    # sampling
    max_new_tokens: int = 48
    """tokens sampled per completion (and the most a dataset completion keeps)"""
    temperature: float = 1.0
    """sampling temperature (the divergence itself is taken at temperature 1: module docstring)"""

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
    max_steps: int = 100
    """optimizer steps to run"""
    per_device_train_batch_size: int = 16
    """prompts per micro-batch per process"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step"""
    seed: int = 1
    """seed of the run (which prompts are on-policy; each completion is sampled with its own seed)"""

    # output and samples
    output_dir: str = "output/gkd"
    """where the model, tokenizer and logs/<run_name>.jsonl are written"""
    eval_steps: int = 50
    """print a table of the student's completions with their divergence every this many steps"""
    num_sample_generations: int = 4
    """completions shown in the samples table"""

    # filled in at runtime
    world_size: int = 0
    """number of processes (set at runtime)"""
    total_batch_size: int = 0
    """prompts per optimizer step = per_device_train_batch_size x gradient_accumulation_steps x world_size"""
    num_steps: int = 0
    """optimizer steps of the run (set at runtime)"""

    # shared groups, each defined where it is read: common/{models,episodes,packing,vllm,checkpoint,tracking}.py

    model: ModelArgs = field(default_factory=ModelArgs)
    episodes: EpisodeArgs = field(default_factory=EpisodeArgs)
    packing: PackingArgs = field(default_factory=PackingArgs)
    vllm: VLLMArgs = field(default_factory=VLLMArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    tracking: TrackingArgs = field(default_factory=TrackingArgs)


# ---------------------------------------------------------------------------------------------
# ALGO LOGIC: the divergence per token, the token-reward loss, the on/off-policy draw
# ---------------------------------------------------------------------------------------------
def _chunk_dtype(dtype: torch.dtype, beta: float) -> torch.dtype:
    """fp32 at least; float64 within 0.05 of either end, not at it: there D_beta divides by beta (1 - beta) sums
    that cancel to O(beta) or O(1 - beta) (log Q - log M: 1e-6 off in fp32), and fp32's error grows as 1 / min(beta,
    1 - beta): 5e-3 at 1e-4, 0.5 at 1e-6 (tests/test_gkd.py); 2-3x beta 0.5's at 0.1 and 0.9, which stay fp32."""
    return torch.float64 if 0 < min(beta, 1 - beta) < 0.05 else torch.promote_types(dtype, torch.float32)


def _divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float) -> torch.Tensor:
    """D_beta at each position of one chunk, in fp32 at least ([N, V] -> [N]; `_chunk_dtype`)."""
    dtype = _chunk_dtype(student_logits.dtype, beta)
    q = torch.log_softmax(student_logits.to(dtype), dim=-1)
    p = torch.log_softmax(teacher_logits.to(dtype), dim=-1)
    if beta == 0:
        return (p.exp() * (p - q)).sum(-1)  # KL(P || Q)
    if beta == 1:
        return (q.exp() * (q - p)).sum(-1)  # KL(Q || P)
    m = torch.logsumexp(torch.stack([p + math.log(beta), q + math.log(1 - beta)]), dim=0)  # log M
    return (beta * (p.exp() * (p - m)).sum(-1) + (1 - beta) * (q.exp() * (q - m)).sum(-1)) / (beta * (1 - beta))


def token_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float,
                     elements: int = 2**21) -> torch.Tensor:
    """D_beta (module docstring) at every position ([B, T, V] x 2 -> [B, T]), a chunk of about `elements` logits
    at a time; the student's gradient is written chunk by chunk into one tensor of its logits' dtype, so fp32
    copies exist of one chunk of each only (the teacher's logits get no gradient: it is frozen)."""
    return _Divergence.apply(student_logits, teacher_logits.detach(), beta, elements)


class _Divergence(torch.autograd.Function):
    """The gradient: with g = dD/dQ = log(Q / M) / beta (the P / M and the 1 cancel; beta 1: M = P, g = log Q - log
    P), through the softmax dD/dz = Q (g - sum_v Q g); at beta 0 it is Q - P (the limit: g = 1 - P / Q)."""

    @staticmethod
    def forward(ctx, student_logits, teacher_logits, beta, elements):
        # a model's head may be padded past its tokens (Qwen2.5 0.5B and 7B: 151936 and 152064)
        vocab = min(student_logits.shape[-1], teacher_logits.shape[-1])
        s, t = student_logits.flatten(0, -2), teacher_logits.flatten(0, -2)  # views of contiguous logits
        out = torch.empty(len(s), dtype=torch.promote_types(s.dtype, torch.float32), device=s.device)
        size = max(1, elements // vocab)
        for i in range(0, len(s), size):
            out[i:i + size] = _divergence(s[i:i + size, :vocab], t[i:i + size, :vocab], beta)
        ctx.save_for_backward(student_logits, teacher_logits)
        ctx.beta, ctx.vocab, ctx.size = beta, vocab, size
        return out.view(student_logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad):
        student_logits, teacher_logits = ctx.saved_tensors
        s, t, grad = student_logits.flatten(0, -2), teacher_logits.flatten(0, -2), grad.flatten()
        beta, vocab, size = ctx.beta, ctx.vocab, ctx.size
        out = torch.zeros_like(s)  # 0 for a padded head's columns
        for i in range(0, len(s), size):
            dtype = _chunk_dtype(s.dtype, beta)  # as the forward
            q = torch.log_softmax(s[i:i + size, :vocab].to(dtype), dim=-1)
            p = torch.log_softmax(t[i:i + size, :vocab].to(dtype), dim=-1)
            if beta == 0:
                d = q.exp() - p.exp()
            else:
                log_m = p if beta == 1 else torch.logaddexp(p + math.log(beta), q + math.log(1 - beta))
                g, probs = (q - log_m) / beta, q.exp()
                d = probs * (g - (probs * g).sum(-1, keepdim=True))
            out[i:i + size, :vocab] = d * grad[i:i + size, None]
        return out.view(student_logits.shape), None, None, None


def gkd_loss(student_logits, teacher_logits, completion_ids, mask, *, beta: float, loss_type: str,
             num_tokens: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, per-token divergence detached) over the completion tokens where `mask` is 1; the loss is summed and
    divided by `num_tokens`, the step's completion tokens scaled to one micro-batch on one process (so
    accumulation and processes average over tokens, not over micro-batches). token_reward: the per-token reverse
    KL estimate k = log Q(y_t) - log P(y_t) as a negative reward, loss = sum_t k_t (detached) log Q(y_t): its
    gradient E_Q[(log Q - log P) grad log Q] is the reverse KL's."""
    if loss_type == "jsd":
        per_token = token_divergence(student_logits, teacher_logits, beta)
        return (per_token * mask).sum() / num_tokens, per_token.detach()
    logq = token_logprobs(student_logits, completion_ids)
    k = (logq - token_logprobs(teacher_logits, completion_ids)).detach()
    return (k * logq * mask).sum() / num_tokens, k


def completion_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:
    """Logits before each completion token ([B, T, V]), prompts left-padded and completions right-padded as the
    rollout returns them; at temperature 1 (the divergence's: module docstring)."""
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    return shifted_logits(model, input_ids, attention_mask, prompt_ids.shape[1] - 1)


def on_policy(seed: int, place: int, lmbda: float) -> bool:
    """Whether the prompt at `place` in the run (its global index) gets a completion the student samples: a draw
    from its own seeded stream, so 1 and N processes, and a resumed run, decide alike."""
    return random.Random(seed * 10**9 + place).random() < lmbda


def prompt_batches(num_rows: int, per_step: int, *, seed: int, rank: int, world_size: int):
    """Endless shuffled global batches of per_step (row, place in the run) pairs, this process's share of each (every
    world_size-th from `rank`): the same order on every process."""
    rng, place = random.Random(seed), 0
    while True:
        order = list(range(num_rows))
        rng.shuffle(order)
        for start in range(0, num_rows - per_step + 1, per_step):
            batch = [(i, place + j) for j, i in enumerate(order[start:start + per_step])]
            place += per_step
            yield batch[rank::world_size]


def pad_micro_batch(tokenizer, batch, prompt_ids, student_ids: dict, rows, max_new_tokens: int):
    """(prompt ids, prompt mask, completion ids, completion mask) of a micro-batch of (row, place) pairs, prompts
    left-padded and completions right-padded, and whether each completion ends in EOS: the student's completion
    where `student_ids` has the place, else the dataset's, cut to max_new_tokens."""
    ids = [student_ids[place] if place in student_ids
           else encode_completion(tokenizer, rows[i]["prompt"], rows[i]["completion"])[:max_new_tokens]
           for i, place in batch]
    p_ids, p_mask = pad([prompt_ids[i] for i, _ in batch], tokenizer.pad_token_id, side="left")
    c_ids, c_mask = pad(ids, tokenizer.pad_token_id)
    return (p_ids, p_mask, c_ids, c_mask), torch.tensor([bool(c) and c[-1] == tokenizer.eos_token_id for c in ids])


def sample_turn(policy, sampler, tokenizer, prompts: list, seeds: list[int], max_new_tokens: int, *,
                temperature: float):
    """One turn of the student for these prompts (token ids), a seed each: vLLM's (sampler), or HF generate's."""
    if sampler is not None:
        return sampler.generate(tokenizer, prompts, max_new_tokens, temperature=temperature, seeds=seeds)
    return generate(policy, tokenizer, prompts, max_new_tokens, temperature=temperature, seeds=seeds)


def main(args: Args):
    check_flags(args)  # before anything loads: sizes and rates > 0, an output_dir free to use
    if not 0 <= args.lmbda <= 1 or not 0 <= args.beta <= 1:
        raise UserError(f"--lmbda {args.lmbda} and --beta {args.beta} must lie in [0, 1]")
    if args.loss_type == "token_reward" and (args.lmbda != 1 or args.temperature != 1 or args.vllm.use_vllm):
        raise UserError("--loss_type token_reward is a policy gradient, exact only on the student's own samples: it "
                        "needs --lmbda 1 and --temperature 1 and HF generate (no --use_vllm); use --loss_type jsd")
    accelerator = setup(seed=args.seed, gradient_accumulation_steps=args.gradient_accumulation_steps,
                        per_device_train_batch_size=args.per_device_train_batch_size, max_grad_norm=args.max_grad_norm,
                        bf16=args.model.bf16, ddp_timeout=args.checkpoint.ddp_timeout)
    args.world_size = accelerator.num_processes
    args.tracking.run_name = args.tracking.run_name or f"gkd__{args.seed}__{int(time.time())}"
    args.total_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    args.num_steps = args.max_steps
    if args.max_new_tokens >= args.max_length:
        raise UserError(f"max_new_tokens {args.max_new_tokens} leaves no room for a prompt "
                        f"under max_length {args.max_length}")

    vllm_options = (sampler_options(args.vllm, accelerator, seed=args.seed, dtype=args.model.torch_dtype,
                                    use_peft=args.model.use_peft) if args.vllm.use_vllm else None)
    # no --vllm_importance_sampling_*: D_beta is a divergence at each visited state, not an estimate under the
    # sampler; which states vLLM visits does not bias it (token_reward is: use HF generate for it)
    # ---- models and data ----
    tokenizer = load_tokenizer(args.model_name_or_path, role="student", chat_template_path=args.chat_template_path)
    teacher_tokenizer = load_tokenizer(args.teacher_model_name_or_path, role="teacher")
    if teacher_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise UserError(f"the teacher '{args.teacher_model_name_or_path}' ({len(teacher_tokenizer)} tokens) and the "
                        f"student '{args.model_name_or_path}' ({len(tokenizer)} tokens) have different vocabularies; "
                        "distillation compares their distributions token by token and needs one tokenizer")
    if not args.dataset_name:  # TRL's environment-owned data is grpo's and rloo's (docs/multi_turn.md)
        raise UserError("gkd.py reads its prompts from a dataset: give --dataset_name (with an environment too)")
    dataset = load_split(args.dataset_name, args.dataset_train_split)
    layout = check_columns(dataset, {"prompt-completion": ["prompt", "completion"], "prompt-only": ["prompt"]},
                           f"dataset '{args.dataset_name}' (split {args.dataset_train_split}), given to gkd.py,")
    if layout == "prompt-only" and args.lmbda < 1:
        raise UserError(f"--lmbda {args.lmbda} trains {1 - args.lmbda:.0%} of prompts on the dataset's completions, "
                        f"but '{args.dataset_name}' has no completion column; use --lmbda 1 or prompt-completion data")
    rows = list(dataset)
    e, tools = args.episodes, None
    if e.tools or e.environment_factory:  # multi-turn episodes, the student's (common/episodes.py)
        if args.lmbda < 1:
            raise UserError(f"--tools and --environment_factory distil the student's own episodes: use --lmbda 1 "
                            f"(got {args.lmbda}; a dataset completion is one turn, with no tool calls to answer)")
        tools = load_tools(tokenizer, e.tools, e.environment_factory, args.per_device_train_batch_size, rows,
                           timeout=e.tool_timeout)
    check_prompts_fill_a_batch(len(rows), args.per_device_train_batch_size * args.world_size,
                               f"per_device_train_batch_size {args.per_device_train_batch_size} x "
                               f"{args.world_size} processes")
    prompt_ids = [encode_prompt(tokenizer, row["prompt"])[-(args.max_length - args.max_new_tokens):] for row in rows]
    steps_per_epoch = max(1, len(rows) // args.total_batch_size)
    model = adapt(load_policy(args.model_name_or_path, tokenizer, args.model.torch_dtype, role="student"),
                  gradient_checkpointing=args.model.gradient_checkpointing, lora=args.model.lora(),
                  no_dropout=args.disable_dropout)
    hint_learning_rate(accelerator, model, args.learning_rate, Args.learning_rate)
    teacher = prepare_frozen(accelerator, load_policy(args.teacher_model_name_or_path, tokenizer,
                                                      args.model.torch_dtype, role="teacher"))
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
    accelerator.print(f"{len(rows)} prompts; {args.num_steps} steps of {args.total_batch_size} prompts, "
                      f"{args.lmbda:.0%} sampled by the student; teacher {args.teacher_model_name_or_path}")

    batches = prompt_batches(len(rows), args.per_device_train_batch_size * args.world_size, seed=args.seed,
                             rank=accelerator.process_index, world_size=args.world_size)
    for _ in range(resumed.get("step", 0) * args.gradient_accumulation_steps):  # the data position
        next(batches)
    start_time = time.time()
    for step in range(resumed.get("step", 0) + 1, args.num_steps + 1):
        # ---- ROLLOUT: the step's completions, the student's samples for the on-policy prompts, the dataset's ----
        if sampler is not None and step > 1:  # the student changed since the engine last got its weights
            sampler.push_weights(model)
        micro = []  # per micro-batch: (batch, (prompt ids, mask, completion ids, mask, graded, finished, sampled))
        counts = []  # episodes: each micro-batch's (turns, calls, failures)
        for _ in range(args.gradient_accumulation_steps):
            batch = next(batches)
            sampled = [on_policy(args.seed, place, args.lmbda) for _, place in batch]
            chosen = [(i, place) for (i, place), s in zip(batch, sampled) if s]
            student_ids = {}  # place -> the student's completion
            if args.lmbda > 0:  # every rank samples, a prompt at least (sharded, each forward is collective)
                seeds = [args.seed * 10**9 + place for _, place in chosen] or [0]
                chosen_prompts = [prompt_ids[i] for i, _ in chosen] or [prompt_ids[batch[0][0]]]
                if sampler is not None and sampler.needs_push:
                    sampler.push_weights(model)
                gathered = args.model.ds3_gather_for_generation
                with (contextlib.nullcontext() if sampler else
                      unwrapped_for_generation(accelerator, model, gathered)) as unwrapped:
                    sample = functools.partial(sample_turn, unwrapped, sampler, tokenizer, temperature=args.temperature)
                    if tools is None:
                        samples = sample(chosen_prompts, seeds, args.max_new_tokens)
                    else:  # the student's episodes: tool results between its turns (context, not graded)
                        episodes = run_episodes(sample, tokenizer, [rows[i] for i, _ in chosen], tools,
                                                prompt_ids=None, seeds=seeds, max_new_tokens=args.max_new_tokens,
                                                max_prompt_length=args.max_length - args.max_new_tokens,
                                                max_calls=e.max_tool_calling_iterations, accelerator=accelerator)
                        samples = episodes.samples
                        counts.append((episodes.turns, episodes.calls, episodes.failures))
                for (i, place), c, m in zip(chosen, samples.completion_ids, samples.completion_mask):
                    student_ids[place] = c[m.bool()].tolist()
            if tools is None:
                tensors, finished = pad_micro_batch(tokenizer, batch, prompt_ids, student_ids, rows,
                                                    args.max_new_tokens)
                tensors = (*tensors, tensors[3])  # every completion token graded
            else:  # lmbda 1: every row the student's episode, as run_episodes padded it
                tensors = (samples.prompt_ids, samples.prompt_mask, samples.completion_ids, samples.completion_mask,
                           samples.model_mask)
                finished = samples.finished.cpu()
            micro.append((batch, (*(t.to(accelerator.device) for t in tensors), finished, torch.tensor(sampled))))
        global_tokens = accelerator.reduce(sum(m.sum() for _, (_, _, _, _, m, _, _) in micro).float(), "sum")
        num_tokens = global_tokens / (args.gradient_accumulation_steps * args.world_size)

        # ---- UPDATE: the teacher grades every completion token; the student moves towards it ----
        stats = defaultdict(float)
        for batch, (p_ids, p_mask, c_ids, c_mask, graded, finished, sampled) in micro:
            with accelerator.accumulate(model):
                ids, mask = c_ids, graded.float()  # graded: the student's tokens (an episode's tool results: not)
                if args.packing.padding_free:  # the completion tokens of one packed row (common/packing.py)
                    student_logits, ids, _ = packed_completion_logits(model, p_ids, p_mask, c_ids, c_mask)
                    mask = graded[c_mask.bool()][None].float()
                    with torch.no_grad():
                        teacher_logits = packed_completion_logits(teacher, p_ids, p_mask, c_ids, c_mask)[0]
                else:
                    student_logits = completion_logits(model, p_ids, p_mask, c_ids, c_mask)
                    with torch.no_grad():
                        teacher_logits = completion_logits(teacher, p_ids, p_mask, c_ids, c_mask)
                loss, per_token = gkd_loss(student_logits, teacher_logits, ids, mask, beta=args.beta,
                                           loss_type=args.loss_type, num_tokens=num_tokens)
                if args.packing.padding_free:  # back in the rows, for the samples table
                    per_token = per_token.new_zeros(c_mask.shape).masked_scatter(c_mask.bool(), per_token[0])
                if checkpointer.finite_loss(loss):  # under DeepSpeed backward steps the engine: check first
                    accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    if not checkpointer.finite(loss=stats["loss"] + loss.detach(), grad_norm=grad_norm):
                        optimizer.zero_grad()  # drop this update: the step below then changes nothing
                optimizer.step()
                optimizer.zero_grad()
            with torch.no_grad():
                logq = token_logprobs(student_logits.detach(), ids)
                logp = token_logprobs(teacher_logits, ids)
            stats["loss"] += loss.detach()  # per-token means over the step's tokens, as the loss (any split)
            stats["objective/kl"] += ((logq - logp) * mask).sum() / num_tokens  # sampled-token reverse KL
            stats["logps/student"] += (logq * mask).sum() / num_tokens
            stats["logps/teacher"] += (logp * mask).sum() / num_tokens
            stats["on_policy_ratio"] += sampled.float().mean()
            stats["completions/mean_length"] += graded.sum(1).float().mean()
            stats["val/contain_eos_token"] += finished.float().mean()
        scheduler.step()
        tracker.step()

        # ---- LOG ----
        metrics = reduce_stats(accelerator, stats, args.gradient_accumulation_steps)
        if tools is not None:  # TRL's tools/call_frequency and tools/failure_frequency, the episodes' turns
            finished = torch.cat([f for _, (*_, f, _) in micro]).to(accelerator.device)
            metrics |= episode_metrics(accelerator, finished, *(torch.cat(x) for x in zip(*counts)))
        metrics |= {"grad_norm": float("nan" if grad_norm is None else grad_norm), "lr": scheduler.get_last_lr()[0],
                    "epoch": step / steps_per_epoch, "num_tokens": global_tokens.item(),
                    "steps_per_second": (step - resumed.get("step", 0)) / (time.time() - start_time)}
        if step % args.eval_steps == 0 or step == 1:
            batch, (p_ids, p_mask, c_ids, c_mask, graded, _, sampled) = micro[-1]
            texts = tokenizer.batch_decode(c_ids, skip_special_tokens=True)
            shown = range(min(args.num_sample_generations, len(batch)))
            tracker.log_samples([{"prompt": rows[batch[j][0]]["prompt"], "completion": texts[j],
                                  "by": "student" if sampled[j] else "dataset",
                                  "divergence": float((per_token[j] * graded[j]).sum() / graded[j].sum().clamp(min=1))}
                                 for j in shown], step)
        tracker.log(metrics, step)
        # every --save_steps, and on SIGTERM / Ctrl-C / non-finite values
        checkpointer.end_of_step(step, {})

    # ---- SAVE ----
    os.makedirs(args.output_dir, exist_ok=True)
    save_model(accelerator, model, tokenizer, args.output_dir)
    accelerator.print(f"saved model and tokenizer to {args.output_dir}")
    tracker.close()


if __name__ == "__main__":
    with exit_on_user_error(), stop_on_signal():
        main(tyro.cli(Args))
