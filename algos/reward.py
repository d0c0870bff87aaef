"""Reward modeling: a scalar score trained so that preferred completions score higher.

The second stage of the RLHF pipeline (Ziegler et al. 2019; Stiennon et al. 2020, "Learning to
summarize from human feedback"; Ouyang et al. 2022, InstructGPT). A sequence classifier with one
output reads prompt + completion and returns r(x, y) at the last token. Under the Bradley-Terry
model P(y_c > y_r | x) = sigmoid(r(x, y_c) - r(x, y_r)), so the loss is

    -log sigmoid(r_chosen - r_rejected - margin)      (margin: optional per-pair column, Llama 2)
    + center_rewards_coefficient * mean((r_chosen + r_rejected)^2)   (keeps rewards near 0; Eisenstein et al. 2023)

    python algos/reward.py   # tiny TL;DR preferences from output/sft; saves output/reward
    accelerate launch algos/reward.py --model_name_or_path output/pythia-1b-sft \
        --dataset_name trl-lib/tldr-preference --output_dir output/pythia-1b-rm --learning_rate 3e-6 ...
"""

import contextlib
import math
import os
import random
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # copies import their own common/
from common.checkpoint import CheckpointArgs, Checkpointer, save_model
from common.data import (NO_SHARED_START, check_columns, encode_completion, encode_prompt, load_split,
                         split_implicit_prompt)
from common.generation import decodes_here, pad, unwrapped_for_generation
from common.models import ModelArgs, adapt, deepspeed_stage, hint_learning_rate, load_reward_model, load_tokenizer
from common.packing import PackingArgs, packed_scores  # --padding_free
from common.resume import resume  # --resume_from_checkpoint
from common.rewards import last_token_scores
from common.runtime import (UserError, check_flags, exit_on_user_error, flags, lr_scheduler,
                            setup, stop_on_signal)
from common.tracking import Tracker, TrackingArgs, reduce_stats


@dataclass
class Args:
    # algorithm: the Bradley-Terry loss (module docstring)
    center_rewards_coefficient: float = 0.0
    """weight of the mean squared reward, which keeps rewards centered on 0 (0 disables)"""

    # model and data
    model_name_or_path: str = "output/sft"
    """model to start from, usually the SFT model (a causal LM gets a new scalar head)"""
    dataset_name: str = "tiny_tldr/tldr-preference"
    """prompt/chosen/rejected data, or chosen/rejected without a prompt column (strings or conversations: their shared
    start is the prompt); optional margin column: hub name, local directory or file"""
    dataset_train_split: str = "train"
    """split to train on"""
    dataset_test_split: str = "validation"
    """split for eval accuracy ("" to skip evaluation)"""
    max_length: int = 512
    """prompt + completion tokens; longer pairs are skipped (a cut completion would be scored wrongly)"""

    # optimization
    learning_rate: float = 1e-3
    """peak learning rate of AdamW"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    lr_scheduler_type: str = "cosine"
    """transformers scheduler name (linear, cosine, constant, ...)"""
    warmup_ratio: float = 0.05
    """share of the steps spent warming the learning rate up"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    num_train_epochs: float = 2.0
    """passes over the training split"""
    max_steps: int = -1
    """optimizer steps to run; overrides num_train_epochs when > 0"""
    per_device_train_batch_size: int = 16
    """preference pairs per micro-batch per process"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step"""
    seed: int = 1
    """seed of the run (models load alike on every process; each completion is sampled with its own seed)"""

    # output, evaluation and samples
    output_dir: str = "output/reward"
    """where the reward model, tokenizer and logs/<run_name>.jsonl are written"""
    eval_steps: int = 150
    """evaluate every this many optimizer steps (and at the end)"""
    per_device_eval_batch_size: int = 64
    """pairs per eval batch per process"""
    num_sample_pairs: int = 4
    """eval pairs printed with their rewards at each evaluation"""

    # filled in at runtime
    world_size: int = 0
    """number of processes (set at runtime)"""
    total_batch_size: int = 0
    """pairs per optimizer step = per_device_train_batch_size x gradient_accumulation_steps x world_size"""
    num_steps: int = 0
    """optimizer steps of the run (set at runtime)"""

    # shared groups, each defined where it is read: common/models.py, common/checkpoint.py, common/tracking.py

    model: ModelArgs = field(default_factory=ModelArgs)
    packing: PackingArgs = field(default_factory=PackingArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    tracking: TrackingArgs = field(default_factory=TrackingArgs)


# ---------------------------------------------------------------------------------------------
# ALGO LOGIC: the Bradley-Terry loss
# ---------------------------------------------------------------------------------------------
def reward_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, margin: torch.Tensor | None = None,
                center_rewards_coefficient: float = 0.0) -> torch.Tensor:
    """Mean over pairs of -log sigmoid(r_c - r_r - margin), plus the optional centering term."""
    diff = chosen_rewards - rejected_rewards - (margin if margin is not None else 0.0)
    loss = -F.logsigmoid(diff).mean()
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * ((chosen_rewards + rejected_rewards) ** 2).mean()
    return loss


def tokenize(dataset, tokenizer, max_length: int):
    """Rows -> (prompt ids, chosen ids, rejected ids, margin); pairs longer than `max_length` are
    dropped and counted, and so are pairs whose chosen and rejected are the same (they carry no signal)
    and, without a prompt column, pairs that share no start to be the prompt."""
    examples, skipped = [], Counter()
    for row in dataset:
        if "prompt" in row:
            prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
        else:
            prompt, chosen, rejected = split_implicit_prompt(row["chosen"], row["rejected"])
            if not prompt:
                skipped[NO_SHARED_START] += 1
                continue
        prompt_ids = encode_prompt(tokenizer, prompt)
        chosen, rejected = encode_completion(tokenizer, prompt, chosen), encode_completion(tokenizer, prompt, rejected)
        if chosen == rejected:
            skipped["chosen == rejected"] += 1
            continue
        if len(prompt_ids) + max(len(chosen), len(rejected)) > max_length:
            skipped[f"longer than max_length={max_length}"] += 1
            continue
        examples.append((prompt_ids, chosen, rejected, float(row.get("margin") or 0.0)))
    return examples, skipped


def collate(examples, pad_id: int):
    """Chosen then rejected in one batch of 2B rows (one forward pass for both): the prompts
    left-padded to one width, then the completions left-padded to another, so that each row's last
    real token, its EOS, is the last position, where `last_token_scores` reads, and a pair's two rows
    hold the same prompt block, which `last_token_scores` runs once for both.
    Returns (input_ids, attention_mask, margins, prompt block width)."""
    p_ids, p_mask = pad([p for p, _, _, _ in examples] * 2, pad_id, side="left")
    c_ids, c_mask = pad([c for _, c, _, _ in examples] + [r for _, _, r, _ in examples], pad_id, side="left")
    return (torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1),
            torch.tensor([m for _, _, _, m in examples]), p_ids.shape[1])


def rewards_of(model, batch, device, padding_free: bool = False):
    """(chosen rewards, rejected rewards, margins) of a batch from `collate`; padding_free: all its rows' scores
    from packed rows, position ids restarting per row (common/packing.py)."""
    input_ids, attention_mask, margin, width = batch
    scores = packed_scores if padding_free else last_token_scores
    chosen, rejected = scores(model, input_ids.to(device), attention_mask.to(device), width).chunk(2)
    return chosen, rejected, margin.to(device)


def micro_batches(examples, args, rank: int, pad_id: int):
    """Endless shuffled micro-batches of process `rank`'s share of each global batch."""
    rng = random.Random(args.seed)  # same order on every rank; each rank takes its own slice
    per_step = args.per_device_train_batch_size * args.world_size
    while True:
        order = list(range(len(examples)))
        rng.shuffle(order)
        for start in range(0, len(order) - per_step + 1, per_step):
            chunk = order[start:start + per_step][rank::args.world_size]
            yield collate([examples[i] for i in chunk], pad_id)


@torch.no_grad()
def evaluate(model, eval_examples, args, tokenizer, accelerator):
    """Preference accuracy, loss and mean rewards over the eval pairs (all processes)."""
    model.eval()
    sums = defaultdict(float)  # name -> sum over the pairs
    # equal shares (at most world - 1 left out): ZeRO-3 needs every rank in every forward
    world = accelerator.num_processes
    shard = eval_examples[:len(eval_examples) - len(eval_examples) % world][accelerator.process_index::world]
    for i in range(0, len(shard), args.per_device_eval_batch_size):
        batch = collate(shard[i:i + args.per_device_eval_batch_size], tokenizer.pad_token_id)
        chosen, rejected, margin = rewards_of(model, batch, accelerator.device, args.packing.padding_free)
        sums["eval_accuracy"] += (chosen > rejected).float().sum()
        sums["eval_loss"] += reward_loss(chosen, rejected, margin) * len(chosen)
        sums["eval_rewards/chosen"] += chosen.sum()
        sums["eval_rewards/rejected"] += rejected.sum()
        sums["pairs"] += len(chosen)
    model.train()
    sums = reduce_stats(accelerator, sums, reduction="sum")
    pairs = sums.pop("pairs")
    return {name: value / pairs for name, value in sums.items()}


def log_samples(model, tokenizer, eval_examples, args, *, tracker, step: int, accelerator):
    """A few eval pairs with the rewards the model gives them."""
    if args.num_sample_pairs <= 0:
        return
    examples, gather = eval_examples[:args.num_sample_pairs], args.model.ds3_gather_for_generation
    with torch.no_grad(), unwrapped_for_generation(accelerator, model, gather) as unwrapped:
        if not decodes_here(accelerator, gather):
            return
        chosen, rejected, _ = rewards_of(unwrapped, collate(examples, tokenizer.pad_token_id), accelerator.device)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    tracker.log_samples([{"chosen": decode(p + c), "rejected": decode(p + r)[-120:], "r_chosen": a, "r_rejected": b}
                         for (p, c, r, _), a, b in zip(examples, chosen.tolist(), rejected.tolist())], step)


def main(args: Args):
    check_flags(args)  # before anything loads: sizes and rates > 0, an output_dir free to use
    accelerator = setup(seed=args.seed, gradient_accumulation_steps=args.gradient_accumulation_steps,
                        per_device_train_batch_size=args.per_device_train_batch_size, max_grad_norm=args.max_grad_norm,
                        bf16=args.model.bf16, ddp_timeout=args.checkpoint.ddp_timeout)
    args.world_size = accelerator.num_processes
    args.tracking.run_name = args.tracking.run_name or f"reward__{args.seed}__{int(time.time())}"
    args.total_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size

    # ---- model and data ----
    tokenizer = load_tokenizer(args.model_name_or_path, role="reward model")
    formats = {"preference": ["prompt", "chosen", "rejected"], "implicit prompt": ["chosen", "rejected"]}
    train_split = load_split(args.dataset_name, args.dataset_train_split)
    check_columns(train_split, formats,
                  f"dataset '{args.dataset_name}' (split {args.dataset_train_split}), given to reward.py,")
    train_examples, skipped = tokenize(train_split, tokenizer, args.max_length)
    why = ", ".join(f"{n} {reason}" for reason, n in skipped.items())
    if skipped:
        accelerator.print(f"skipped {sum(skipped.values())} of {len(train_split)} training pairs: {why}")
    if not train_examples:
        raise UserError(f"no training pair left: {why}; raise --max_length or check the data")
    eval_examples = []
    if args.dataset_test_split:
        eval_split = load_split(args.dataset_name, args.dataset_test_split)
        check_columns(eval_split, formats, f"dataset '{args.dataset_name}' (split {args.dataset_test_split})")
        eval_examples, _ = tokenize(eval_split, tokenizer, args.max_length)
    steps_per_epoch = len(train_examples) // args.total_batch_size
    args.num_steps = args.max_steps if args.max_steps > 0 else int(args.num_train_epochs * steps_per_epoch)
    # with --max_steps too: fewer examples than one batch would leave micro_batches() waiting forever
    if args.num_steps <= 0 or len(train_examples) < args.per_device_train_batch_size * args.world_size:
        raise UserError(
            f"{len(train_examples)} training pairs make no full batch of {args.total_batch_size} "
            f"(per_device_train_batch_size {args.per_device_train_batch_size} x gradient_accumulation_steps "
            f"{args.gradient_accumulation_steps} x {args.world_size} processes); lower them or pass --max_steps")

    model = adapt(load_reward_model(args.model_name_or_path, tokenizer, args.model.torch_dtype, new_head=True),
                  gradient_checkpointing=args.model.gradient_checkpointing, lora=args.model.lora(), task_type="SEQ_CLS")
    hint_learning_rate(accelerator, model, args.learning_rate, Args.learning_rate)
    if hasattr(model, "score") and not any("SequenceClassification" in a for a in model.config.architectures or []):
        # a fresh head, initialised as in Stiennon et al. 2020 (N+ detail: std 1/sqrt(d_model + 1)); under
        # ZeRO-3 it was sharded while loading: drawn whole on the main process, which hands out the shards
        whole = contextlib.nullcontext()
        if deepspeed_stage(accelerator) == 3:
            import deepspeed
            whole = deepspeed.zero.GatheredParameters([model.score.weight], modifier_rank=0)
        with whole:
            torch.nn.init.normal_(model.score.weight, std=1 / math.sqrt(model.config.hidden_size + 1))
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
    accelerator.print(f"{len(train_examples)} training pairs, {args.num_steps} steps of {args.total_batch_size} pairs")

    batches = micro_batches(train_examples, args, accelerator.process_index, tokenizer.pad_token_id)
    for _ in range(resumed.get("step", 0) * args.gradient_accumulation_steps):  # the data position
        next(batches)
    start_time = time.time()
    for step in range(resumed.get("step", 0) + 1, args.num_steps + 1):
        # ---- UPDATE: one optimizer step; every micro-batch holds the same number of pairs, so the
        # mean over micro-batches (accelerate divides by gradient_accumulation_steps) is exact ----
        stats = defaultdict(float)  # name -> sum over micro-batches
        for _ in range(args.gradient_accumulation_steps):
            batch = next(batches)
            with accelerator.accumulate(model):
                chosen, rejected, margin = rewards_of(model, batch, accelerator.device, args.packing.padding_free)
                loss = reward_loss(chosen, rejected, margin, center_rewards_coefficient=args.center_rewards_coefficient)
                if checkpointer.finite_loss(loss):  # under DeepSpeed backward steps the engine: check first
                    accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    if not checkpointer.finite(loss=loss, grad_norm=grad_norm):
                        optimizer.zero_grad()  # drop this update: the step below then changes nothing
                optimizer.step()
                optimizer.zero_grad()
            stats["loss"] += loss.detach()
            stats["accuracy"] += (chosen > rejected).float().mean()
            stats["rewards/chosen"] += chosen.detach().mean()
            stats["rewards/rejected"] += rejected.detach().mean()
        scheduler.step()
        tracker.step()

        # ---- LOG ----
        metrics = reduce_stats(accelerator, stats, args.gradient_accumulation_steps)
        metrics |= {"rewards/margins": metrics["rewards/chosen"] - metrics["rewards/rejected"],
                    "grad_norm": float("nan" if grad_norm is None else grad_norm), "lr": scheduler.get_last_lr()[0],
                    "epoch": step / max(1, steps_per_epoch),
                    "steps_per_second": (step - resumed.get("step", 0)) / (time.time() - start_time)}
        if eval_examples and (step % args.eval_steps == 0 or step == args.num_steps):
            metrics.update(evaluate(model, eval_examples, args, tokenizer, accelerator))
            log_samples(model, tokenizer, eval_examples, args, tracker=tracker, step=step, accelerator=accelerator)
        tracker.log(metrics, step)
        checkpointer.end_of_step(step, {})  # every --save_steps, and on SIGTERM / Ctrl-C / non-finite values

    # ---- SAVE ----
    if eval_examples:
        accelerator.print(f"held-out preference accuracy ({args.dataset_test_split}): {metrics['eval_accuracy']:.3f}")
    os.makedirs(args.output_dir, exist_ok=True)
    save_model(accelerator, model, tokenizer, args.output_dir)
    accelerator.print(f"saved reward model and tokenizer to {args.output_dir}")
    tracker.close()


if __name__ == "__main__":
    with exit_on_user_error(), stop_on_signal():
        main(tyro.cli(Args))
