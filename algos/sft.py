"""Supervised fine-tuning (SFT): maximise the likelihood of reference completions given prompts.

The first stage of the RLHF pipeline (Ziegler et al. 2019, "Fine-Tuning Language Models from Human
Preferences"; Stiennon et al. 2020, "Learning to summarize from human feedback"; Huang et al. 2024,
"The N+ Implementation Details of RLHF with PPO: A Case Study on TL;DR Summarization"). The loss is
the mean negative log-likelihood over completion tokens only: prompt tokens are context, not
targets, and each completion ends in EOS so that the model learns to stop.

    python algos/sft.py      # tiny TL;DR task on a CPU, a few minutes; saves output/sft
    accelerate launch algos/sft.py --model_name_or_path EleutherAI/pythia-1b-deduped \
        --dataset_name trl-lib/tldr --output_dir output/pythia-1b-sft --learning_rate 3e-6 ...
"""

import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # copies import their own common/
from common.checkpoint import CheckpointArgs, Checkpointer, save_model
from common.data import (check_columns, encode_completion, encode_prompt, is_conversational, load_split,
                         without_nulls)
from common.generation import decodes_here, generate, pad, token_logprobs, unwrapped_for_generation
from common.models import ModelArgs, adapt, hint_learning_rate, load_policy, load_tokenizer
from common.packing import PackingArgs, packed_forward  # --padding_free
from common.resume import resume  # --resume_from_checkpoint
from common.runtime import (UserError, check_flags, exit_on_user_error, flags, lr_scheduler,
                            setup, stop_on_signal)
from common.tracking import Tracker, TrackingArgs


@dataclass
class Args:
    # model and data
    model_name_or_path: str = "tiny_tldr/tiny-pythia"
    """base model: hub name or local directory (the default is the tiny task's: `python benchmarks/tiny_tldr.py`)"""
    dataset_name: str = "tiny_tldr/tldr"
    """prompt/completion, messages (every assistant turn learnt, tool calls included; a `tools` column of JSON
    schemas is rendered by the chat template) or text (every token learnt) data: hub name, local directory or file
    (the default is the tiny task's, built with the model)"""
    dataset_train_split: str = "train"
    """split to train on"""
    dataset_test_split: str = "validation"
    """split for eval loss and samples ("" to skip evaluation)"""
    max_length: int = 512
    """prompt + completion tokens; longer examples lose the end of their completion"""
    chat_template_path: str | None = None
    """a Jinja file or a tokenizer whose chat template replaces the model's (saved with it), e.g.
    configs/chatml_tools.jinja for tool-use `messages` on a model whose template renders no tools"""

    # optimization
    learning_rate: float = 3e-3
    """peak learning rate of AdamW"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    lr_scheduler_type: str = "cosine"
    """transformers scheduler name (linear, cosine, constant, ...)"""
    warmup_ratio: float = 0.05
    """share of the steps spent warming the learning rate up"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    num_train_epochs: float = 6.0
    """passes over the training split (the tiny model starts from random weights: with 4, whether it
    learns to copy the post's feeling into a summary depended on the seed, and so did every method after it)"""
    max_steps: int = -1
    """optimizer steps to run; overrides num_train_epochs when > 0"""
    per_device_train_batch_size: int = 16
    """examples per micro-batch per process"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step"""
    seed: int = 1
    """seed of the run (models load alike on every process; each completion is sampled with its own seed)"""

    # output, evaluation and samples
    output_dir: str = "output/sft"
    """where the model, tokenizer and logs/<run_name>.jsonl are written"""
    eval_steps: int = 250
    """evaluate every this many optimizer steps (and at the end)"""
    per_device_eval_batch_size: int = 64
    """examples per eval batch per process"""
    num_sample_generations: int = 4
    """sample completions printed at each evaluation"""
    max_new_tokens: int = 48
    """token budget of generated samples"""

    # filled in at runtime
    world_size: int = 0
    """number of processes (set at runtime)"""
    total_batch_size: int = 0
    """examples per optimizer step = per_device_train_batch_size x gradient_accumulation_steps x world_size"""
    num_steps: int = 0
    """optimizer steps of the run (set at runtime)"""

    # shared groups, each defined where it is read: common/models.py, common/checkpoint.py, common/tracking.py

    model: ModelArgs = field(default_factory=ModelArgs)
    packing: PackingArgs = field(default_factory=PackingArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    tracking: TrackingArgs = field(default_factory=TrackingArgs)


# ---------------------------------------------------------------------------------------------
# ALGO LOGIC: the SFT loss
# ---------------------------------------------------------------------------------------------
def sft_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
             num_tokens: float) -> torch.Tensor:
    """Summed NLL of the tokens where `loss_mask` is 1, divided by `num_tokens`.

    Logits at position t predict token t+1 (hence the shift). `num_tokens` is the number of loss
    tokens in the whole optimizer step (all micro-batches, all processes) scaled to one micro-batch
    on one process, so that gradient accumulation and DDP averaging give the true per-token mean
    instead of a mean of per-micro-batch means (which over-weights short completions)."""
    logprobs = token_logprobs(logits[:, :-1], input_ids[:, 1:])
    return -(logprobs * loss_mask[:, 1:]).sum() / num_tokens


def conversation_ids(tokenizer, messages, tools: list | None = None) -> tuple[list[int], list[int]]:
    """A conversation's ids through the chat template (with the tools' schemas), and a mask that is 1 on
    every assistant turn (its content and tool calls, and the end-of-turn token the template writes after
    it; not the "assistant" header, not tool results, and not what follows the end of turn). Turns are
    found without `{% generation %}` tags: assistant turn k is what the template adds between rendering
    messages[:k] ready for the assistant's reply and rendering messages[:k + 1]."""
    ids, mask, done = [], [], ""
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:k], tools=tools, add_generation_prompt=True, tokenize=False)
        through = tokenizer.apply_chat_template(messages[:k + 1], tools=tools, tokenize=False)
        if not (before.startswith(done) and through.startswith(before)):
            raise UserError("the chat template renders a conversation's start differently once more turns follow; "
                            "its assistant turns cannot be told apart from the rest")
        turn = through[len(before):].rstrip()  # the template's newline after the end of turn is not learnt
        for text, learn in ((before[len(done):], 0), (turn, 1)):
            piece = tokenizer(text, add_special_tokens=False).input_ids
            ids, mask = ids + piece, mask + [learn] * len(piece)
        done = before + turn
    # the reply ends in EOS, as a completion
    if messages[-1]["role"] == "assistant" and ids[-1] != tokenizer.eos_token_id:
        ids, mask = ids + [tokenizer.eos_token_id], mask + [1]
    return ids, mask


def row_tools(row) -> list | None:
    """A row's `tools` column (TRL's): JSON schemas as dicts, or one JSON string (as some hub datasets store them)."""
    tools = row.get("tools")
    return json.loads(tools) if isinstance(tools, str) else without_nulls(tools)


def tokenize(dataset, tokenizer, max_length: int):
    """Rows -> (input_ids, loss mask), cut at `max_length`: prompt-completion rows learn the
    completion (its EOS included); `messages` rows every assistant turn (TRL's assistant_only_loss);
    `text` rows (language modelling) every token, with an EOS appended. Rows with nothing left to
    learn within max_length are dropped and counted."""
    examples, skipped = [], 0
    for i, row in enumerate(dataset):
        if "messages" in row and row["messages"] is not None:
            if not any(m["role"] == "assistant" for m in row["messages"]):
                raise UserError(f"row {i}: its messages hold no assistant turn, so SFT has nothing to learn from it; "
                                "drop that row")
            ids, mask = conversation_ids(tokenizer, without_nulls(row["messages"]), row_tools(row))
        elif "text" in row and row["text"] is not None:
            if is_conversational(row["text"]):
                raise UserError(f"row {i}: its `text` is a list of messages; language modelling takes plain text, "
                                "and conversations go in a `messages` column")
            ids = tokenizer(row["text"]).input_ids
            ids = ids if ids and ids[-1] == tokenizer.eos_token_id else ids + [tokenizer.eos_token_id]
            mask = [1] * len(ids)
        else:
            prompt_ids = encode_prompt(tokenizer, row["prompt"])
            completion_ids = encode_completion(tokenizer, row["prompt"], row["completion"])
            ids, mask = prompt_ids + completion_ids, [0] * len(prompt_ids) + [1] * len(completion_ids)
        if not any(mask[1:max_length]):  # the first token is never predicted
            skipped += 1
            continue
        examples.append((ids[:max_length], mask[:max_length]))
    return examples, skipped


def collate(examples, pad_id: int):
    """Right-padded batch; loss_mask is each row's mask (0 on prompt and pad)."""
    input_ids, attention_mask = pad([ids for ids, _ in examples], pad_id)
    loss_mask, _ = pad([mask for _, mask in examples], 0)
    return input_ids, attention_mask, loss_mask


def micro_batches(examples, args, rank: int, pad_id: int):
    """Endless shuffled micro-batches of process `rank`'s share of each global batch."""
    rng = random.Random(args.seed)  # same order on every rank; each rank takes its own slice
    per_step = args.per_device_train_batch_size * args.world_size  # one micro-batch, all ranks
    while True:
        order = list(range(len(examples)))
        rng.shuffle(order)
        for start in range(0, len(order) - args.total_batch_size + 1, args.total_batch_size):
            batch = order[start:start + args.total_batch_size]
            for m in range(args.gradient_accumulation_steps):
                chunk = batch[m * per_step:(m + 1) * per_step]
                yield collate([examples[i] for i in chunk[rank::args.world_size]], pad_id)


@torch.no_grad()
def evaluate(model, eval_examples, args, tokenizer, accelerator):
    """Mean completion-token NLL over the eval examples (all processes)."""
    model.eval()
    nll, count = torch.zeros((), device=accelerator.device), torch.zeros((), device=accelerator.device)
    # equal shares (at most world - 1 left out): ZeRO-3 needs every rank in every forward
    world = accelerator.num_processes
    shard = eval_examples[:len(eval_examples) - len(eval_examples) % world][accelerator.process_index::world]
    for i in range(0, len(shard), args.per_device_eval_batch_size):
        input_ids, attention_mask, loss_mask = (t.to(accelerator.device) for t in collate(
            shard[i:i + args.per_device_eval_batch_size], tokenizer.pad_token_id))
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        nll += sft_loss(logits, input_ids, loss_mask, num_tokens=1.0)
        count += loss_mask[:, 1:].sum()
    model.train()
    return (accelerator.reduce(nll, "sum") / accelerator.reduce(count, "sum")).item()


def log_samples(model, tokenizer, eval_split, args, *, tracker, step: int, accelerator):
    """Greedy completions for the first few eval prompts, beside their references."""
    if args.num_sample_generations <= 0:
        return
    rows = [eval_split[i] for i in range(min(args.num_sample_generations, len(eval_split)))]
    # the prompt: as given; a conversation up to its last message; a text's first third
    prompts = [r["prompt"] if "prompt" in r else r["messages"][:-1] if "messages" in r
               else r["text"][:len(r["text"]) // 3] for r in rows]
    with unwrapped_for_generation(accelerator, model, args.model.ds3_gather_for_generation) as unwrapped:  # all ranks
        if not decodes_here(accelerator, args.model.ds3_gather_for_generation):
            return
        prompt_ids = [encode_prompt(tokenizer, p, row_tools(r)) for p, r in zip(prompts, rows)]
        completion_ids = generate(unwrapped, tokenizer, prompt_ids, args.max_new_tokens, temperature=0.0).completion_ids
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    samples = [{"prompt": p, "completion": c, "reference": r["completion"] if "completion" in r else
                r["messages"][-1:] if "messages" in r else r["text"][len(p):]} for p, c, r in zip(prompts, texts, rows)]
    tracker.log_samples(samples, step)


def main(args: Args):
    check_flags(args)  # before anything loads: sizes and rates > 0, an output_dir free to use
    accelerator = setup(seed=args.seed, gradient_accumulation_steps=args.gradient_accumulation_steps,
                        per_device_train_batch_size=args.per_device_train_batch_size, max_grad_norm=args.max_grad_norm,
                        bf16=args.model.bf16, ddp_timeout=args.checkpoint.ddp_timeout)
    args.world_size = accelerator.num_processes
    args.tracking.run_name = args.tracking.run_name or f"sft__{args.seed}__{int(time.time())}"
    args.total_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size

    # ---- model and data ----
    tokenizer = load_tokenizer(args.model_name_or_path, chat_template_path=args.chat_template_path)
    train_split = load_split(args.dataset_name, args.dataset_train_split)
    formats = {"prompt-completion": ["prompt", "completion"], "messages": ["messages"], "language modelling": ["text"]}
    check_columns(train_split, formats,
                  f"dataset '{args.dataset_name}' (split {args.dataset_train_split}), given to sft.py,")
    train_examples, skipped = tokenize(train_split, tokenizer, args.max_length)
    if skipped:
        accelerator.print(f"skipped {skipped} of {len(train_split)} training rows with no token to learn within "
                          f"max_length={args.max_length} (a prompt that fills it)")
    if not train_examples:
        raise UserError(f"no training row has a token to learn within max_length={args.max_length} (every prompt "
                        "fills it); raise --max_length")
    eval_examples = []
    if args.dataset_test_split:
        eval_split = load_split(args.dataset_name, args.dataset_test_split)
        check_columns(eval_split, formats, f"dataset '{args.dataset_name}' (split {args.dataset_test_split})")
        eval_examples, _ = tokenize(eval_split, tokenizer, args.max_length)
    steps_per_epoch = len(train_examples) // args.total_batch_size
    args.num_steps = args.max_steps if args.max_steps > 0 else int(args.num_train_epochs * steps_per_epoch)
    # with --max_steps too: fewer examples than one batch would leave micro_batches() waiting forever
    if args.num_steps <= 0 or steps_per_epoch == 0:
        raise UserError(
            f"{len(train_examples)} training examples make no full batch of {args.total_batch_size} "
            f"(per_device_train_batch_size {args.per_device_train_batch_size} x gradient_accumulation_steps "
            f"{args.gradient_accumulation_steps} x {args.world_size} processes); lower them or pass --max_steps")

    model = adapt(load_policy(args.model_name_or_path, tokenizer, args.model.torch_dtype),
                  gradient_checkpointing=args.model.gradient_checkpointing, lora=args.model.lora())
    hint_learning_rate(accelerator, model, args.learning_rate, Args.learning_rate)
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
    accelerator.print(f"{len(train_examples)} training examples, {args.num_steps} steps of "
                      f"{args.total_batch_size} examples, {sum(p.numel() for p in model.parameters()):,} parameters")

    batches = micro_batches(train_examples, args, accelerator.process_index, tokenizer.pad_token_id)
    for _ in range(resumed.get("step", 0) * args.gradient_accumulation_steps):  # the data position
        next(batches)
    start_time = time.time()
    for step in range(resumed.get("step", 0) + 1, args.num_steps + 1):
        # ---- UPDATE: one optimizer step over gradient_accumulation_steps micro-batches ----
        micro = [tuple(t.to(accelerator.device) for t in next(batches))
                 for _ in range(args.gradient_accumulation_steps)]
        local_tokens = sum(loss_mask[:, 1:].sum() for _, _, loss_mask in micro)
        global_tokens = accelerator.reduce(local_tokens.float(), "sum")
        # backward() divides by gradient_accumulation_steps and DDP averages over processes: undo both
        num_tokens = global_tokens / (args.gradient_accumulation_steps * args.world_size)
        total_loss = torch.zeros((), device=accelerator.device)
        for input_ids, attention_mask, loss_mask in micro:
            with accelerator.accumulate(model):
                if args.packing.padding_free:  # packed rows, position ids restarting per row
                    logits, ids, mask, _ = packed_forward(model, input_ids, attention_mask, loss_mask)
                    loss = sft_loss(logits, ids, mask, num_tokens=num_tokens)
                else:
                    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
                    loss = sft_loss(logits, input_ids, loss_mask, num_tokens=num_tokens)
                if checkpointer.finite_loss(loss):  # under DeepSpeed backward steps the engine: check first
                    accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    if not checkpointer.finite(loss=total_loss + loss.detach(), grad_norm=grad_norm):
                        optimizer.zero_grad()  # drop this update: the step below then changes nothing
                optimizer.step()
                optimizer.zero_grad()
            total_loss += loss.detach()
        scheduler.step()
        tracker.step()

        # ---- LOG ----
        metrics = {"loss": accelerator.reduce(total_loss, "mean").item() / args.gradient_accumulation_steps,
                   "grad_norm": float("nan" if grad_norm is None else grad_norm), "lr": scheduler.get_last_lr()[0],
                   "num_tokens": global_tokens.item(), "epoch": step / max(1, steps_per_epoch),
                   "steps_per_second": (step - resumed.get("step", 0)) / (time.time() - start_time)}
        if eval_examples and (step % args.eval_steps == 0 or step == args.num_steps):
            metrics["eval_loss"] = evaluate(model, eval_examples, args, tokenizer, accelerator)
            log_samples(model, tokenizer, eval_split, args, tracker=tracker, step=step, accelerator=accelerator)
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
