"""Kahneman-Tversky Optimization (KTO): learn from completions labelled only good or bad.

KTO (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization") needs no
pairs. With the implicit reward r(x, y) = log(pi(y|x) / pi_ref(y|x)) and a reference point
z0 = KL(pi || pi_ref), the value of a completion follows prospect theory:

    v(x, y) = lambda_D * sigmoid(beta * (r - z0))   if y is desirable
              lambda_U * sigmoid(beta * (z0 - r))   if y is undesirable
    loss    = E[lambda_y - v(x, y)]

z0 is estimated per optimizer step from mismatched pairs (prompt i with the completion of row i - 1
of its micro-batch: text the policy was not trained to produce for that prompt) of every micro-batch
on every process, as the mean of r over them, clamped at 0
and detached (section 4.1: it only sets the reference point, no gradient flows through it).
`--loss_type apo_zero_unpaired` drops z0 and uses Anchored Preference Optimization's zero anchor
(D'Oosterlinck et al. 2024): loss = 1 - sigmoid(beta r) for desirable, sigmoid(beta r) for undesirable.

    python algos/kto.py      # tiny TL;DR preference pairs, split into good/bad
    accelerate launch algos/kto.py --model_name_or_path output/pythia-1b-sft \
        --dataset_name trl-lib/kto-mix-14k --output_dir output/pythia-1b-kto --learning_rate 5e-7 ...
"""

import math
import os
import random
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Literal

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # copies import their own common/
from common.checkpoint import CheckpointArgs, Checkpointer, save_model
from common.data import (NO_SHARED_START, check_columns, completion_text, encode_completion, encode_prompt, load_split,
                         split_implicit_prompt)
from common.generation import decodes_here, generate, pad, shifted_logits, token_logprobs, unwrapped_for_generation
from common.models import (ModelArgs, adapt, hint_learning_rate, load_policy, load_tokenizer, prepare_frozen,
                           reference)
from common.packing import PackingArgs, packed_sequence_logps  # --padding_free
from common.resume import resume  # --resume_from_checkpoint
from common.runtime import (UserError, check_flags, exit_on_user_error, flags, lr_scheduler,
                            setup, stop_on_signal)
from common.tracking import Tracker, TrackingArgs, reduce_stats


@dataclass
class Args:
    # algorithm: the KTO loss (module docstring)
    loss_type: Literal["kto", "apo_zero_unpaired"] = "kto"
    """KTO with the KL reference point, or APO-zero for unpaired data (no reference point)"""
    beta: float = 0.1
    """strength of the KL regularisation to the reference"""
    desirable_weight: float = 1.0
    """lambda_D, weight of the desirable completions' losses"""
    undesirable_weight: float = 1.0
    """lambda_U, weight of the undesirable completions' losses"""

    # model and data
    model_name_or_path: str = "output/sft"
    """policy to start from, usually the SFT model"""
    ref_model_name_or_path: str | None = None
    """reference model (default: a frozen copy of the starting policy)"""
    disable_dropout: bool = True
    """no dropout in the policy (LoRA's included): its logprobs and the reference's (LoRA: adapters off) are then
    exact, not noisy (as TRL)"""
    dataset_name: str = "tiny_tldr/tldr-preference"
    """prompt/completion/label data, or chosen/rejected pairs (chosen -> label True, rejected -> False) with a prompt
    column or without (their shared start is the prompt): hub name, local directory or file"""
    dataset_train_split: str = "train"
    """split to train on"""
    dataset_test_split: str = "validation"
    """split for eval metrics and samples ("" to skip evaluation)"""
    max_prompt_length: int = 384
    """prompt tokens kept (from the end: the instruction usually closes the prompt)"""
    max_completion_length: int = 128
    """completion tokens kept (from the start)"""
    max_length: int = 512
    """prompt + completion tokens; longer completions lose their end"""

    # optimization
    learning_rate: float = 1e-4
    """peak learning rate of AdamW"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    lr_scheduler_type: str = "cosine"
    """transformers scheduler name (linear, cosine, constant, ...)"""
    warmup_ratio: float = 0.1
    """share of the steps spent warming the learning rate up"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    num_train_epochs: float = 1.0
    """passes over the training split"""
    max_steps: int = -1
    """optimizer steps to run; overrides num_train_epochs when > 0"""
    per_device_train_batch_size: int = 16
    """labelled completions per micro-batch per process (>= 2: the KL pairs mismatch rows of a batch)"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step"""
    seed: int = 1
    """seed of the run (models load alike on every process; each completion is sampled with its own seed)"""

    # output, evaluation and samples
    output_dir: str = "output/kto"
    """where the model, tokenizer and logs/<run_name>.jsonl are written"""
    eval_steps: int = 100
    """evaluate every this many optimizer steps (and at the end)"""
    per_device_eval_batch_size: int = 32
    """completions per eval batch per process"""
    num_sample_generations: int = 4
    """greedy completions of eval prompts printed at each evaluation"""
    max_new_tokens: int = 48
    """token budget of generated samples"""

    # filled in at runtime
    world_size: int = 0
    """number of processes (set at runtime)"""
    total_batch_size: int = 0
    """completions per optimizer step = per_device_train_batch_size x gradient_accumulation_steps x
    world_size"""
    num_steps: int = 0
    """optimizer steps of the run (set at runtime)"""

    # shared groups, each defined where it is read: common/models.py, common/checkpoint.py, common/tracking.py

    model: ModelArgs = field(default_factory=ModelArgs)
    packing: PackingArgs = field(default_factory=PackingArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    tracking: TrackingArgs = field(default_factory=TrackingArgs)


# ---------------------------------------------------------------------------------------------
# ALGO LOGIC: the KTO loss
# ---------------------------------------------------------------------------------------------
def kto_loss(logps: torch.Tensor, ref_logps: torch.Tensor, labels: torch.Tensor, kl: torch.Tensor | float, *,
             beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0, loss_type: str = "kto"):
    """Per-completion losses and implicit rewards beta * log(pi / pi_ref) (detached).

    logps/ref_logps: summed completion logprobs [B]; labels: True = desirable; kl: the reference
    point z0 (already detached and clamped at 0; unused by apo_zero_unpaired)."""
    ratio = logps - ref_logps
    if loss_type == "kto":  # lambda_y - v(x, y), eq. 8
        desirable = 1 - torch.sigmoid(beta * (ratio - kl))
        undesirable = 1 - torch.sigmoid(beta * (kl - ratio))
    elif loss_type == "apo_zero_unpaired":  # APO-zero: push desirable up and undesirable down from 0
        desirable = 1 - torch.sigmoid(beta * ratio)
        undesirable = torch.sigmoid(beta * ratio)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    losses = torch.where(labels, desirable_weight * desirable, undesirable_weight * undesirable)
    return losses, (beta * ratio).detach()


def kl_reference_point(kl_logps: torch.Tensor, kl_ref_logps: torch.Tensor) -> torch.Tensor:
    """z0: the mean log-ratio over the mismatched pairs, clamped at 0 (a KL is never negative) and
    detached. Callers average it over processes before use."""
    return (kl_logps - kl_ref_logps).mean().detach().clamp(min=0)


def sequence_logps(logits: torch.Tensor, input_ids: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """Summed completion logprobs [N] from `shifted_logits` output; prompt and padding never count."""
    return (token_logprobs(logits, input_ids[:, 1:]) * completion_mask[:, 1:]).sum(-1)


# ---------------------------------------------------------------------------------------------
# data: unpaired rows (pairs are split), the truncation order, skipped rows counted
# ---------------------------------------------------------------------------------------------
def unpaired_rows(dataset, fmt: str):
    """(prompt, completion, label) triples; a preference pair gives (chosen, True) and (rejected, False),
    its prompt being the shared start of the two when there is no prompt column (common.data)."""
    for row in dataset:
        if fmt == "unpaired":
            yield row["prompt"], row["completion"], row["label"]
        else:
            prompt, chosen, rejected = ((row["prompt"], row["chosen"], row["rejected"]) if fmt == "preference"
                                        else split_implicit_prompt(row["chosen"], row["rejected"]))
            prompt = prompt if fmt == "preference" or prompt else None  # None: they share no start
            yield prompt, chosen, True
            yield prompt, rejected, False


def tokenize(rows, tokenizer, args):
    """-> [(prompt ids, completion ids, label)] and a Counter of skipped rows by reason. The prompt
    keeps its last max_prompt_length tokens, the completion its first max_completion_length, then
    the completion is cut so that prompt + completion <= max_length."""
    examples, skipped = [], Counter()
    for prompt, completion, label in rows:
        if label not in (True, False):  # also accepts 0 / 1
            skipped["label not true/false"] += 1
            continue
        if prompt is None:  # a pair without a prompt column whose chosen and rejected share no start
            skipped[NO_SHARED_START] += 1
            continue
        if not completion_text(tokenizer, prompt, completion).strip():
            skipped["empty completion"] += 1
            continue
        prompt_ids = encode_prompt(tokenizer, prompt)[-args.max_prompt_length:]
        room = min(args.max_completion_length, args.max_length - len(prompt_ids))
        if room <= 0:
            skipped[f"prompt leaves no room under max_length={args.max_length}"] += 1
            continue
        examples.append((prompt_ids, encode_completion(tokenizer, prompt, completion)[:room], bool(label)))
    return examples, skipped


def build(pairs, pad_id: int):
    """(prompt, completion) pairs -> right-padded (input_ids, attention_mask, completion_mask)."""
    input_ids, attention_mask = pad([p + c for p, c in pairs], pad_id)
    prompt_lens = torch.tensor([len(p) for p, _ in pairs])[:, None]
    completion_mask = (torch.arange(input_ids.shape[1])[None, :] >= prompt_lens).long() * attention_mask
    return input_ids, attention_mask, completion_mask


def kl_pairs(examples, max_length: int):
    """The mismatched pairs of a batch: prompt i with completion i - 1 (i = 0 takes the last one)."""
    shifted = [examples[i - 1][1] for i in range(len(examples))]
    return [(p, c[:max_length - len(p)]) for (p, _, _), c in zip(examples, shifted)]


def collate(examples, pad_id: int, max_length: int):
    """The batch and its KL batch, each right-padded: (input_ids, attention_mask, completion_mask)
    twice, and the labels."""
    return (build([(p, c) for p, c, _ in examples], pad_id), build(kl_pairs(examples, max_length), pad_id),
            torch.tensor([label for _, _, label in examples]))


def logps_from(model, batch, device, share_prompts: bool = False, padding_free: bool = False):
    """Summed completion logprobs of a `build` batch. share_prompts: logits only from the column
    before the earliest completion token, so that rows holding the same prompt run it once
    (shifted_logits); for a batch of distinct prompts the single plain forward is cheaper.
    padding_free: from packed rows, position ids restarting per row (common/packing.py)."""
    input_ids, attention_mask, completion_mask = (t.to(device) for t in batch)
    if padding_free:
        return packed_sequence_logps(model, input_ids, attention_mask, completion_mask)[0]
    start = max(int(completion_mask.argmax(1).min()) - 1, 0) if share_prompts else 0
    logits = shifted_logits(model, input_ids, attention_mask, start)
    return sequence_logps(logits, input_ids[:, start:], completion_mask[:, start:])


@torch.no_grad()
def kl_logratios(policy, reference_scope, examples, *, pad_id: int, max_length: int, device, padding_free=False):
    """log pi - log pi_ref of a micro-batch's mismatched pairs (prompt i with completion i - 1, from
    kl_pairs: the reference point must not see a row's own completion), and the reference's logps of
    the rows themselves. `reference_scope`: a context that yields the reference model (with LoRA, the
    policy with its adapters off); it scores both kinds of rows in one call, where row i and its KL
    row share prompt i."""
    rows, mismatched = [(p, c) for p, c, _ in examples], kl_pairs(examples, max_length)
    with reference_scope as ref:
        ref_logps = logps_from(ref, build(rows + mismatched, pad_id), device, True, padding_free)
    kl_logps = logps_from(policy, build(mismatched, pad_id), device, padding_free=padding_free)
    return kl_logps - ref_logps[len(rows):], ref_logps[:len(rows)]


def main(args: Args):
    if args.loss_type == "kto" and args.per_device_train_batch_size < 2:
        raise UserError("KTO estimates its KL reference point from mismatched rows of a batch: "
                        "--per_device_train_batch_size must be >= 2")
    check_flags(args)  # before anything loads: sizes and rates > 0, an output_dir free to use
    accelerator = setup(seed=args.seed, gradient_accumulation_steps=args.gradient_accumulation_steps,
                        per_device_train_batch_size=args.per_device_train_batch_size, max_grad_norm=args.max_grad_norm,
                        bf16=args.model.bf16, ddp_timeout=args.checkpoint.ddp_timeout)
    args.world_size = accelerator.num_processes
    args.tracking.run_name = args.tracking.run_name or f"kto__{args.seed}__{int(time.time())}"
    args.total_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size

    # ---- model and data ----
    tokenizer = load_tokenizer(args.model_name_or_path)
    formats = {"unpaired": ["prompt", "completion", "label"], "preference": ["prompt", "chosen", "rejected"],
               "implicit prompt": ["chosen", "rejected"]}

    def load(split):
        dataset = load_split(args.dataset_name, split)
        fmt = check_columns(dataset, formats, f"dataset '{args.dataset_name}' (split {split}), given to kto.py,")
        examples, skipped = tokenize(unpaired_rows(dataset, fmt), tokenizer, args)
        reasons = ", ".join(f"{n} {why}" for why, n in skipped.items())
        if skipped:
            accelerator.print(f"skipped {sum(skipped.values())} rows of split {split}: {reasons}")
        if not examples:
            raise UserError(f"no row of split '{split}' is left to train on: {reasons}")
        return examples

    train_examples = load(args.dataset_train_split)
    eval_examples = load(args.dataset_test_split) if args.dataset_test_split else []
    num_desirable = sum(label for _, _, label in train_examples)
    num_undesirable = len(train_examples) - num_desirable
    if num_desirable and num_undesirable:
        # the paper (section 4.2) recommends lambda_D n_D / (lambda_U n_U) in [1, 4/3]
        ratio = args.desirable_weight * num_desirable / (args.undesirable_weight * num_undesirable)
        if not 1 <= ratio <= 4 / 3:
            low = args.undesirable_weight * num_undesirable / num_desirable
            accelerator.print(f"hint: desirable_weight x {num_desirable} desirable / (undesirable_weight x "
                              f"{num_undesirable} undesirable) = {ratio:.2f}, outside the [1, 4/3] the KTO paper "
                              f"recommends; try --desirable_weight between {low:.2f} and {low * 4 / 3:.2f}")
    steps_per_epoch = len(train_examples) // args.total_batch_size
    args.num_steps = args.max_steps if args.max_steps > 0 else int(args.num_train_epochs * steps_per_epoch)
    # with --max_steps too: fewer examples than one batch would leave micro_batches() waiting forever
    if args.num_steps <= 0 or len(train_examples) < args.per_device_train_batch_size * args.world_size:
        raise UserError(
            f"{len(train_examples)} training rows make no full batch of {args.total_batch_size} "
            f"(per_device_train_batch_size {args.per_device_train_batch_size} x gradient_accumulation_steps "
            f"{args.gradient_accumulation_steps} x {args.world_size} processes); lower them or pass --max_steps")

    model = adapt(load_policy(args.model_name_or_path, tokenizer, args.model.torch_dtype), lora=args.model.lora(),
                  gradient_checkpointing=args.model.gradient_checkpointing, no_dropout=args.disable_dropout)
    hint_learning_rate(accelerator, model, args.learning_rate, Args.learning_rate)
    ref_model = None  # frozen, never wrapped for DDP; with LoRA, the policy with adapters off
    if not args.model.use_peft:
        ref_path = args.ref_model_name_or_path or args.model_name_or_path
        ref_model = prepare_frozen(accelerator, load_policy(ref_path, tokenizer, args.model.torch_dtype,
                                                            role="reference"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = lr_scheduler(args.lr_scheduler_type, optimizer, math.ceil(args.warmup_ratio * args.num_steps),
                             args.num_steps)
    # the scheduler is not prepared: accelerate would step it once per process per call
    model, optimizer = accelerator.prepare(model, optimizer)
    checkpointer = Checkpointer(accelerator, scheduler, args.checkpoint, output_dir=args.output_dir,
                                run_name=args.tracking.run_name)
    # --resume_from_checkpoint: weights, optimizer, RNGs, step and the loop's state (common/resume.py)
    resumed = resume(checkpointer) if args.checkpoint.resume_from_checkpoint else {}
    args.tracking.run_name = resumed.get("run_name", args.tracking.run_name)  # a resumed run logs on in its JSONL
    tracker = Tracker(accelerator, args.tracking, output_dir=args.output_dir, config=flags(args),
                      total_steps=args.num_steps, start_step=resumed.get("step", 0))
    accelerator.print(f"{len(train_examples)} training rows ({num_desirable} desirable), {args.num_steps} steps of "
                      f"{args.total_batch_size}, loss {args.loss_type}, beta {args.beta}")

    def batch_stats(examples, policy, kl=None, ref_logps=None):
        """Loss and metric sums of one micro-batch: the loss is its mean over rows; the metric sums
        (loss, rewards, logps per class, class counts, kl) are divided after reduction. kl: the
        reference point z0 (training: of the whole step); None: from this micro-batch's pairs.
        ref_logps: the reference's logps of the rows, when kl_logratios has them already."""
        batch, _, labels = collate(examples, tokenizer.pad_token_id, args.max_length)
        labels = labels.to(accelerator.device)
        logps = logps_from(policy, batch, accelerator.device, padding_free=args.packing.padding_free)
        if kl is None and args.loss_type == "kto":
            kl_ratios, ref_logps = kl_logratios(policy, reference(accelerator, model, ref_model), examples,
                                                pad_id=tokenizer.pad_token_id, max_length=args.max_length,
                                                device=accelerator.device, padding_free=args.packing.padding_free)
            kl = kl_reference_point(kl_ratios, 0.0)
        if ref_logps is None:
            with torch.no_grad(), reference(accelerator, model, ref_model) as ref:
                ref_logps = logps_from(ref, batch, accelerator.device, padding_free=args.packing.padding_free)
        if kl is None:
            kl = torch.zeros((), device=accelerator.device)
        losses, rewards = kto_loss(logps, ref_logps, labels, kl, beta=args.beta, desirable_weight=args.desirable_weight,
                                   undesirable_weight=args.undesirable_weight, loss_type=args.loss_type)
        good, bad = labels.float(), (~labels).float()
        sums = {"loss": losses.detach().sum(), "rewards/chosen": (rewards * good).sum(),
                "rewards/rejected": (rewards * bad).sum(), "logps/chosen": (logps.detach() * good).sum(),
                "logps/rejected": (logps.detach() * bad).sum(), "kl": kl * len(examples),
                "desirable": good.sum(), "undesirable": bad.sum(), "rows": len(examples)}
        return losses.mean(), sums

    def summarize(sums, prefix=""):
        """Sums over micro-batches and processes -> means per row (rewards and logps: per row of their class)."""
        s = reduce_stats(accelerator, sums, reduction="sum")
        desirable, undesirable, rows = max(s.pop("desirable"), 1), max(s.pop("undesirable"), 1), s.pop("rows")
        metrics = {k: v / (desirable if k.endswith("chosen") else undesirable if k.endswith("rejected") else rows)
                   for k, v in s.items()}
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        return {prefix + k: v for k, v in metrics.items()}

    @torch.no_grad()
    def evaluate():
        """Eval metrics over the eval rows (each process takes a strided share)."""
        model.eval()
        # equal shares (at most world - 1 rows left out): ZeRO-3 needs every rank in every forward
        world = accelerator.num_processes
        mine = eval_examples[:len(eval_examples) - len(eval_examples) % world][accelerator.process_index::world]
        sums = defaultdict(float)
        for i in range(0, len(mine), args.per_device_eval_batch_size):
            for name, value in batch_stats(mine[i:i + args.per_device_eval_batch_size], model)[1].items():
                sums[name] += value
        model.train()
        return summarize(sums, "eval_")

    def log_samples(step):
        """Greedy completions of the first eval prompts."""
        if args.num_sample_generations <= 0:
            return
        prompts = list(dict.fromkeys(tuple(p) for p, _, _ in eval_examples))[:args.num_sample_generations]
        gather = args.model.ds3_gather_for_generation
        with unwrapped_for_generation(accelerator, model, gather) as unwrapped:  # all ranks
            if not decodes_here(accelerator, gather):
                return
            ids = generate(unwrapped, tokenizer, [list(p) for p in prompts], args.max_new_tokens,
                           temperature=0.0).completion_ids
        samples = [{"prompt": tokenizer.decode(p, skip_special_tokens=True), "completion": c}
                   for p, c in zip(prompts, tokenizer.batch_decode(ids, skip_special_tokens=True))]
        tracker.log_samples(samples, step)

    def micro_batches():
        """Endless shuffled micro-batches: this process's contiguous share of each global micro-batch."""
        rng = random.Random(args.seed)  # same order on every rank; each rank takes its own slice
        per_device = args.per_device_train_batch_size
        per_step = per_device * args.world_size
        while True:
            order = list(range(len(train_examples)))
            rng.shuffle(order)
            for start in range(0, len(order) - per_step + 1, per_step):
                share = order[start + accelerator.process_index * per_device:][:per_device]
                yield [train_examples[i] for i in share]

    batches = micro_batches()
    for _ in range(resumed.get("step", 0) * args.gradient_accumulation_steps):  # the data position
        next(batches)
    start_time = time.time()
    for step in range(resumed.get("step", 0) + 1, args.num_steps + 1):
        # ---- UPDATE: one optimizer step; every micro-batch holds the same number of rows, so the
        # mean over micro-batches (accelerate divides by gradient_accumulation_steps) is exact ----
        micro = [next(batches) for _ in range(args.gradient_accumulation_steps)]
        z0, ref_logps = torch.zeros((), device=accelerator.device), [None] * len(micro)
        # the reference point of the whole global batch: mismatched pairs of every micro-batch, all ranks
        if args.loss_type == "kto":
            kl_ratios, ref_logps = zip(*[kl_logratios(model, reference(accelerator, model, ref_model), m,
                                                      pad_id=tokenizer.pad_token_id, max_length=args.max_length,
                                                      device=accelerator.device,
                                                      padding_free=args.packing.padding_free) for m in micro])
            z0 = kl_reference_point(accelerator.gather(torch.cat(kl_ratios)), 0.0)
        totals = defaultdict(float)  # name -> sum over micro-batches
        for examples, ref_m in zip(micro, ref_logps):
            with accelerator.accumulate(model):
                loss, sums = batch_stats(examples, model, z0, ref_m)
                if checkpointer.finite_loss(loss):  # under DeepSpeed backward steps the engine: check first
                    accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    if not checkpointer.finite(loss=loss, grad_norm=grad_norm):
                        optimizer.zero_grad()  # drop this update: the step below then changes nothing
                optimizer.step()
                optimizer.zero_grad()
            for name, value in sums.items():
                totals[name] += value
        scheduler.step()
        tracker.step()

        # ---- LOG ----
        metrics = summarize(totals)
        metrics.update({"grad_norm": float("nan" if grad_norm is None else grad_norm), "lr": scheduler.get_last_lr()[0],
                        "epoch": step / max(1, steps_per_epoch),
                        "steps_per_second": (step - resumed.get("step", 0)) / (time.time() - start_time)})
        if eval_examples and (step % args.eval_steps == 0 or step == args.num_steps):
            metrics.update(evaluate())
            log_samples(step)
        tracker.log(metrics, step)
        checkpointer.end_of_step(step, {})  # every --save_steps, and on SIGTERM / Ctrl-C / non-finite values

    # ---- SAVE ----
    os.makedirs(args.output_dir, exist_ok=True)
    save_model(accelerator, model, tokenizer, args.output_dir)
    accelerator.print(f"saved model and tokenizer to {args.output_dir}")
    tracker.close()


if __name__ == "__main__":
    with exit_on_user_error(), stop_on_signal():
        main(tyro.cli(Args))
