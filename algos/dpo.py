"""Direct Preference Optimization (DPO) and its loss variants: learn from preference pairs without a
reward model or sampling.

DPO (Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a
Reward Model") shows that the KL-regularised RLHF objective has the closed-form optimum
pi(y|x) ∝ pi_ref(y|x) exp(r(x, y) / beta), so the policy defines an implicit reward
r(x, y) = beta * log(pi(y|x) / pi_ref(y|x)). Put into the Bradley-Terry model, with
h = log-ratio(chosen) - log-ratio(rejected), the loss is -log sigmoid(beta * h) (eq. 7).

Variants (--loss_type), each a few lines in `dpo_loss`:
  sigmoid    DPO; with --label_smoothing eps, conservative DPO (cDPO, Mitchell 2023)
  robust     unbiased under label noise eps (Chowdhury et al. 2024, "Provably Robust DPO")
  hinge      SLiC-HF hinge on the log-ratio margin (Zhao et al. 2023)
  ipo        squared loss to a margin of 1/(2 beta) (Azar et al. 2023, "A General Theoretical Paradigm ...")
  bco_pair   each implicit reward classified against a running mean (Jung et al. 2024, BCO)
  sppo_hard  SPPO with hard labels: chosen ratio to +1/(2 beta), rejected to -1/(2 beta) (Wu et al. 2024)
  nca_pair   Noise Contrastive Alignment, pairwise (Chen et al. 2024)
  apo_zero   Anchored Preference Optimization: raise chosen, lower rejected (D'Oosterlinck et al. 2024)
  apo_down   APO: lower both, rejected more (for when the chosen are worse than the model)
  simpo      SimPO: no reference, length-normalised logprobs, target margin gamma (Meng et al. 2024)
Extras: --rpo_alpha adds the NLL of the chosen completion (RPO, Pang et al. 2024, "Iterative
Reasoning Preference Optimization"); --sync_ref_model mixes the policy into the reference every
ref_model_sync_steps (TR-DPO, Gorbatovski et al. 2024, "Learn Your Reference Model for Real Good
Alignment"); --reference_free uses pi_ref = 1.

    python algos/dpo.py      # tiny TL;DR preferences from output/sft
    accelerate launch algos/dpo.py --model_name_or_path output/pythia-1b-sft \
        --dataset_name trl-lib/tldr-preference --output_dir output/pythia-1b-dpo --learning_rate 1e-6 ...
"""

import gc
import math
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
import tyro
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # copies import their own common/
from common.checkpoint import CheckpointArgs, Checkpointer, save_model
from common.data import (NO_SHARED_START, check_columns, completion_text, encode_completion, encode_prompt, load_split,
                         split_implicit_prompt)
from common.generation import decodes_here, generate, pad, shifted_logits, token_logprobs, unwrapped_for_generation
from common.models import (ModelArgs, adapt, deepspeed_stage, hint_learning_rate, load_policy, load_tokenizer,
                           prepare_frozen, reference)
from common.packing import PackingArgs, packed_sequence_logps  # --padding_free
from common.resume import resume  # --resume_from_checkpoint
from common.runtime import (UserError, check_flags, exit_on_user_error, flags, lr_scheduler,
                            setup, stop_on_signal)
from common.tracking import Tracker, TrackingArgs

LossType = Literal["sigmoid", "robust", "hinge", "ipo", "bco_pair", "sppo_hard", "nca_pair", "apo_zero",
                   "apo_down", "simpo"]


@dataclass
class Args:
    # algorithm: the preference loss and its variants (module docstring)
    loss_type: LossType = "sigmoid"
    """preference loss (see the module docstring)"""
    beta: float = 0.1
    """strength of the KL regularisation to the reference (SimPO: reward scale, try 2.0)"""
    label_smoothing: float = 0.0
    """assumed probability that a label is flipped (cDPO for sigmoid/simpo, robust DPO for robust)"""
    simpo_gamma: float = 0.5
    """SimPO target reward margin gamma"""
    rpo_alpha: float = 0.0
    """weight of the chosen completions' NLL added to the loss (RPO; 0 disables)"""
    reference_free: bool = False
    """treat the reference as uniform (log pi_ref = 0); simpo always is"""
    sync_ref_model: bool = False
    """TR-DPO: every ref_model_sync_steps, ref <- alpha * policy + (1 - alpha) * ref"""
    ref_model_mixup_alpha: float = 0.6
    """TR-DPO mixing weight alpha (1.0 copies the policy)"""
    ref_model_sync_steps: int = 64
    """TR-DPO: optimizer steps between reference updates"""

    # model and data
    model_name_or_path: str = "output/sft"
    """policy to start from, usually the SFT model"""
    ref_model_name_or_path: str | None = None
    """reference model (default: a frozen copy of the starting policy)"""
    precompute_ref_logps: bool = False
    """compute the reference logprobs once before training and free the reference model"""
    disable_dropout: bool = True
    """no dropout in the policy (LoRA's included): its logprobs and the reference's (LoRA: adapters off) are then
    exact, not noisy (as TRL)"""
    dataset_name: str = "tiny_tldr/tldr-preference"
    """prompt/chosen/rejected data, or chosen/rejected without a prompt column (strings or conversations: their
    shared start is the prompt): hub name, local directory or file"""
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
    learning_rate: float = 3e-5
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
    """preference pairs per micro-batch per process"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step"""
    seed: int = 1
    """seed of the run (models load alike on every process; each completion is sampled with its own seed)"""

    # output, evaluation and samples
    output_dir: str = "output/dpo"
    """where the model, tokenizer and logs/<run_name>.jsonl are written"""
    eval_steps: int = 100
    """evaluate every this many optimizer steps (and at the end)"""
    per_device_eval_batch_size: int = 32
    """pairs per eval batch per process"""
    num_sample_generations: int = 4
    """greedy completions of eval prompts printed at each evaluation"""
    max_new_tokens: int = 48
    """token budget of generated samples"""

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
# ALGO LOGIC: the preference losses
# ---------------------------------------------------------------------------------------------
def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, *, beta: float, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0, simpo_gamma: float = 0.5, bco_delta: float = 0.0):
    """Per-pair losses and implicit rewards beta * log(pi / pi_ref) of chosen and rejected (detached).

    Inputs are sequence logprobs of shape [B]: sums over completion tokens, except for ipo and simpo,
    which use the mean over completion tokens (`uses_mean_logps`); simpo takes ref logps = 0."""
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    h = chosen_ratio - rejected_ratio
    eps = label_smoothing
    if loss_type == "sigmoid":  # Bradley-Terry on implicit rewards; cDPO: a label is wrong w.p. eps
        losses = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    elif loss_type == "robust":  # de-biased for noise rate eps: its expectation is the clean loss
        losses = (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)
    elif loss_type == "hinge":  # SLiC: margin 1 on the beta-scaled log-ratio difference
        losses = F.relu(1 - beta * h)
    elif loss_type == "ipo":  # IPO eq. 17 (tau = beta): regress h onto 1 / (2 tau), never to infinity
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "bco_pair":  # BCO: chosen reward above, rejected below the running mean delta
        losses = -F.logsigmoid(beta * chosen_ratio - bco_delta) - F.logsigmoid(-(beta * rejected_ratio - bco_delta))
    elif loss_type == "sppo_hard":  # SPPO with P(chosen wins) = 1: log-ratios to +-1/(2 beta)
        losses = (chosen_ratio - 1 / (2 * beta)) ** 2 + (rejected_ratio + 1 / (2 * beta)) ** 2
    elif loss_type == "nca_pair":  # NCA: absolute likelihoods, so the chosen log-ratio cannot fall
        losses = (-F.logsigmoid(beta * chosen_ratio) - 0.5 * F.logsigmoid(-beta * chosen_ratio)
                  - 0.5 * F.logsigmoid(-beta * rejected_ratio))
    elif loss_type == "apo_zero":  # APO-zero: chosen likelihood up, rejected down
        losses = (1 - torch.sigmoid(beta * chosen_ratio)) + torch.sigmoid(beta * rejected_ratio)
    elif loss_type == "apo_down":  # APO-down: chosen down, and rejected further down
        losses = torch.sigmoid(beta * chosen_ratio) + (1 - torch.sigmoid(beta * h))
    elif loss_type == "simpo":  # SimPO eq. 6: beta * (mean logp_c - mean logp_r) must exceed gamma
        z = beta * h - simpo_gamma
        losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    return losses, (beta * chosen_ratio).detach(), (beta * rejected_ratio).detach()


def uses_mean_logps(loss_type: str) -> bool:
    """IPO and SimPO compare length-normalised logprobs; the others compare sums."""
    return loss_type in ("ipo", "simpo")


def sequence_logps(logits: torch.Tensor, input_ids: torch.Tensor, completion_mask: torch.Tensor):
    """(summed completion logprobs [N], completion token counts [N]) from `shifted_logits` output.
    Prompt and padding tokens never count; token t is scored by the logits at t - 1."""
    mask = completion_mask[:, 1:]
    return (token_logprobs(logits, input_ids[:, 1:]) * mask).sum(-1), mask.sum(-1)


# ---------------------------------------------------------------------------------------------
# data: tokenize with the truncation order, skip and count unusable pairs
# ---------------------------------------------------------------------------------------------
def tokenize(dataset, tokenizer, args):
    """Rows -> (prompt ids, chosen ids, rejected ids) and a Counter of skipped rows by reason.
    Truncation order: the prompt keeps its last max_prompt_length tokens, each completion its first
    max_completion_length, then completions are cut so that prompt + completion <= max_length."""
    examples, skipped = [], Counter()
    for row in dataset:
        if "prompt" in row:
            prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
        else:
            prompt, chosen, rejected = split_implicit_prompt(row["chosen"], row["rejected"])
            if not prompt:
                skipped[NO_SHARED_START] += 1
                continue
        if chosen == rejected:
            skipped["chosen == rejected"] += 1
            continue
        if not all(completion_text(tokenizer, prompt, c).strip() for c in (chosen, rejected)):
            skipped["empty completion"] += 1
            continue
        prompt_ids = encode_prompt(tokenizer, prompt)[-args.max_prompt_length:]
        room = min(args.max_completion_length, args.max_length - len(prompt_ids))
        if room <= 0:
            skipped[f"prompt leaves no room under max_length={args.max_length}"] += 1
            continue
        examples.append((prompt_ids, encode_completion(tokenizer, prompt, chosen)[:room],
                         encode_completion(tokenizer, prompt, rejected)[:room]))
    return examples, skipped


def collate(examples, pad_id: int):
    """Chosen rows then rejected rows, right-padded into one batch of 2B (one forward pass for
    both); completion_mask is 1 on completion tokens (EOS included), 0 on prompt and padding."""
    input_ids, attention_mask = pad([p + c for p, c, _ in examples] + [p + r for p, _, r in examples], pad_id)
    prompt_lens = torch.tensor([len(p) for p, _, _ in examples] * 2)[:, None]
    completion_mask = (torch.arange(input_ids.shape[1])[None, :] >= prompt_lens).long() * attention_mask
    return input_ids, attention_mask, completion_mask


def forward_pairs(model, batch, mean_logps: bool, padding_free: bool = False):
    """(chosen logps, rejected logps, (chosen, rejected) token counts, mean logits of chosen / rejected completions)."""
    input_ids, attention_mask, completion_mask = batch
    if padding_free:  # packed rows, position ids restarting per row (common/packing.py)
        logps, counts, mean_logits = packed_sequence_logps(model, input_ids, attention_mask, completion_mask)
    else:
        # logits from the column before the earliest completion token on; a pair's chosen and rejected
        # rows share the prompt before it, so shifted_logits runs that part once per pair
        start = max(int(completion_mask.argmax(1).min()) - 1, 0)
        logits = shifted_logits(model, input_ids, attention_mask, start)  # aligned with input_ids[:, start + 1:]
        input_ids, completion_mask = input_ids[:, start:], completion_mask[:, start:]
        logps, counts = sequence_logps(logits, input_ids, completion_mask)
        mean_logits = (logits.detach().float().mean(-1) * completion_mask[:, 1:]).sum(-1) / counts
    if mean_logps:
        logps = logps / counts
    chosen, rejected = logps.chunk(2)
    return chosen, rejected, counts.chunk(2), mean_logits.chunk(2)


def reference_state(ref_model, accelerator) -> dict:
    """TR-DPO's moved reference for a checkpoint, held once over the ranks' files: under FSDP2 each rank's own
    shards; otherwise (the same full copy on every rank) rank r keeps tensors r, r + world, ..."""
    rank, world = accelerator.process_index, accelerator.num_processes
    return {name: t.to_local() if isinstance(t, DTensor) else t for i, (name, t) in
            enumerate(ref_model.state_dict().items()) if isinstance(t, DTensor) or i % world == rank}


def load_reference_state(ref_model, state: dict, accelerator):
    """The inverse of `reference_state`: shards into place, or each tensor sent by the rank that kept it."""
    rank, world = accelerator.process_index, accelerator.num_processes
    for i, (name, t) in enumerate(ref_model.state_dict().items()):
        if isinstance(t, DTensor):
            t.to_local().copy_(state[name])
            continue
        if i % world == rank:
            t.copy_(state[name])
        if world > 1:
            torch.distributed.broadcast(t, src=i % world)


def main(args: Args):
    if args.loss_type == "simpo":
        args.reference_free = True
    if args.precompute_ref_logps and args.sync_ref_model:
        raise UserError("--precompute_ref_logps and --sync_ref_model exclude each other: TR-DPO changes "
                        "the reference during training")
    if args.sync_ref_model and args.reference_free:
        raise UserError("--sync_ref_model needs a reference model; it cannot be used with --reference_free or simpo")
    if args.loss_type == "robust" and not 0 <= args.label_smoothing < 0.5:
        raise UserError(f"loss_type robust needs 0 <= label_smoothing < 0.5, got {args.label_smoothing}")
    if args.sync_ref_model and args.model.use_peft:
        raise UserError("--sync_ref_model mixes the policy into a separate reference; with --use_peft the reference "
                        "is the base model itself (adapters off), so drop one of the two")
    check_flags(args)  # before anything loads: sizes and rates > 0, an output_dir free to use
    accelerator = setup(seed=args.seed, gradient_accumulation_steps=args.gradient_accumulation_steps,
                        per_device_train_batch_size=args.per_device_train_batch_size, max_grad_norm=args.max_grad_norm,
                        bf16=args.model.bf16, ddp_timeout=args.checkpoint.ddp_timeout)
    args.world_size = accelerator.num_processes
    args.tracking.run_name = args.tracking.run_name or f"dpo__{args.seed}__{int(time.time())}"
    if args.sync_ref_model and deepspeed_stage(accelerator) == 3:
        raise UserError("--sync_ref_model (TR-DPO) mixes the reference with the policy weight by weight, which a "
                        "ZeRO-3-sharded reference cannot do; use ZeRO-2 (configs/deepspeed_zero2.yaml) or FSDP2 "
                        "(configs/fsdp2.yaml: the reference is sharded as the policy, and they mix shard by shard)")
    args.total_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    mean_logps = uses_mean_logps(args.loss_type)

    # ---- model and data ----
    tokenizer = load_tokenizer(args.model_name_or_path)
    formats = {"preference": ["prompt", "chosen", "rejected"], "implicit prompt": ["chosen", "rejected"]}

    def load(split):
        dataset = load_split(args.dataset_name, split)
        check_columns(dataset, formats, f"dataset '{args.dataset_name}' (split {split}), given to dpo.py,")
        examples, skipped = tokenize(dataset, tokenizer, args)
        reasons = ", ".join(f"{n} {why}" for why, n in skipped.items())
        if skipped:
            accelerator.print(f"skipped {sum(skipped.values())} of {len(dataset)} pairs of split {split}: {reasons}")
        if not examples:
            raise UserError(f"no pair of split '{split}' is left to train on: {reasons}")
        return examples

    train_examples = load(args.dataset_train_split)
    eval_examples = load(args.dataset_test_split) if args.dataset_test_split else []
    steps_per_epoch = len(train_examples) // args.total_batch_size
    args.num_steps = args.max_steps if args.max_steps > 0 else int(args.num_train_epochs * steps_per_epoch)
    # with --max_steps too: fewer examples than one batch would leave micro_batches() waiting forever
    if args.num_steps <= 0 or len(train_examples) < args.per_device_train_batch_size * args.world_size:
        raise UserError(
            f"{len(train_examples)} training pairs make no full batch of {args.total_batch_size} "
            f"(per_device_train_batch_size {args.per_device_train_batch_size} x gradient_accumulation_steps "
            f"{args.gradient_accumulation_steps} x {args.world_size} processes); lower them or pass --max_steps")

    model = adapt(load_policy(args.model_name_or_path, tokenizer, args.model.torch_dtype), lora=args.model.lora(),
                  gradient_checkpointing=args.model.gradient_checkpointing, no_dropout=args.disable_dropout)
    hint_learning_rate(accelerator, model, args.learning_rate, Args.learning_rate)
    ref_model = None  # frozen, never wrapped for DDP; with LoRA, the policy with adapters off
    if not args.reference_free and not args.model.use_peft:
        ref_path = args.ref_model_name_or_path or args.model_name_or_path
        ref_model = prepare_frozen(accelerator, load_policy(ref_path, tokenizer, args.model.torch_dtype,
                                                            role="reference"))

    @torch.no_grad()
    def reference_logps(examples):
        """Reference (chosen, rejected) logps of examples; zeros when reference-free."""
        if args.reference_free:
            return (torch.zeros(len(examples), device=accelerator.device),) * 2
        batch = tuple(t.to(accelerator.device) for t in collate(examples, tokenizer.pad_token_id))
        with reference(accelerator, model, ref_model) as ref:
            chosen, rejected, _, _ = forward_pairs(ref, batch, mean_logps, args.packing.padding_free)
        return chosen, rejected

    def precompute(examples):
        """Reference logps of every example [N, 2]: each process scores a strided share, then all gather."""
        rank, world = accelerator.process_index, accelerator.num_processes
        per_rank = math.ceil(len(examples) / world)
        local = torch.zeros(per_rank, 2, device=accelerator.device)
        mine = examples[rank::world]
        mine = mine + mine[-1:] * (per_rank - len(mine))  # equal shares: under ZeRO-3 all ranks run every forward
        for i in range(0, len(mine), args.per_device_eval_batch_size):
            local[i:i + args.per_device_eval_batch_size] = torch.stack(
                reference_logps(mine[i:i + args.per_device_eval_batch_size]), dim=1)
        # example j was scored by rank j % world at row j // world
        gathered = accelerator.gather(local).view(world, per_rank, 2)
        return torch.stack([gathered[j % world, j // world] for j in range(len(examples))])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = lr_scheduler(args.lr_scheduler_type, optimizer, math.ceil(args.warmup_ratio * args.num_steps),
                             args.num_steps)
    # the scheduler is not prepared: accelerate would step it once per process per call
    model, optimizer = accelerator.prepare(model, optimizer)
    train_ref = eval_ref = None  # after prepare: with LoRA the reference is the prepared policy, adapters off
    if args.precompute_ref_logps and not args.reference_free:
        train_ref, eval_ref = precompute(train_examples), precompute(eval_examples) if eval_examples else None
        ref_model = None  # frees its memory: only the cached logprobs are needed from now on
        gc.collect()
        accelerator.print(f"precomputed reference logprobs of {len(train_examples)} training pairs; "
                          "reference model freed")
    checkpointer = Checkpointer(accelerator, scheduler, args.checkpoint, output_dir=args.output_dir,
                                run_name=args.tracking.run_name)
    # --resume_from_checkpoint: weights, optimizer, RNGs, step and the loop's state (common/resume.py)
    resumed = resume(checkpointer) if args.checkpoint.resume_from_checkpoint else {}
    args.tracking.run_name = resumed.get("run_name", args.tracking.run_name)  # a resumed run logs on in its JSONL
    tracker = Tracker(accelerator, args.tracking, output_dir=args.output_dir, config=flags(args),
                      total_steps=args.num_steps, start_step=resumed.get("step", 0))
    accelerator.print(f"{len(train_examples)} training pairs, {args.num_steps} steps of {args.total_batch_size} pairs, "
                      f"loss {args.loss_type}, beta {args.beta}")

    loss_options = dict(beta=args.beta, loss_type=args.loss_type, label_smoothing=args.label_smoothing,
                        simpo_gamma=args.simpo_gamma)

    def pair_stats(indices, examples, cached_ref, policy, bco_delta: float):
        """Loss, the TRL metrics and the summed implicit rewards (for bco_pair's running mean delta) of one
        micro-batch of pairs (indices into `examples`)."""
        pairs = [examples[i] for i in indices]
        batch = tuple(t.to(accelerator.device) for t in collate(pairs, tokenizer.pad_token_id))
        chosen, rejected, (chosen_counts, rejected_counts), (logits_c, logits_r) = forward_pairs(
            policy, batch, mean_logps, args.packing.padding_free)
        ref_c, ref_r = cached_ref[indices].unbind(1) if cached_ref is not None else reference_logps(pairs)
        losses, reward_c, reward_r = dpo_loss(chosen, rejected, ref_c, ref_r, **loss_options, bco_delta=bco_delta)
        loss, reward_sum = losses.mean(), reward_c.sum() + reward_r.sum()
        # ipo's loss compares per-token means; the logged rewards stay beta x summed log-ratios
        if args.loss_type == "ipo":
            reward_c, reward_r = reward_c * chosen_counts, reward_r * rejected_counts
        summed_chosen = chosen * chosen_counts if mean_logps else chosen
        nll = -summed_chosen.sum() / chosen_counts.sum()  # RPO: mean NLL per chosen token
        if args.rpo_alpha:
            loss = loss + args.rpo_alpha * nll
        stats = {"loss": loss.detach(), "rewards/chosen": reward_c.mean(), "rewards/rejected": reward_r.mean(),
                 "rewards/accuracies": (reward_c > reward_r).float().mean(),
                 "rewards/margins": (reward_c - reward_r).mean(), "logps/chosen": chosen.detach().mean(),
                 "logps/rejected": rejected.detach().mean(), "logits/chosen": logits_c.mean(),
                 "logits/rejected": logits_r.mean()}
        if args.rpo_alpha:
            stats["nll_loss"] = nll.detach()
        return loss, stats, reward_sum

    @torch.no_grad()
    def evaluate(bco_delta: float):
        """Eval metrics over the eval pairs (each process takes a strided share; means over pairs)."""
        model.eval()
        sums, count = None, torch.zeros((), device=accelerator.device)
        # equal shares (at most world - 1 pairs left out): ZeRO-3 needs every rank in every forward
        world = accelerator.num_processes
        mine = list(range(len(eval_examples) - len(eval_examples) % world))[accelerator.process_index::world]
        for i in range(0, len(mine), args.per_device_eval_batch_size):
            indices = mine[i:i + args.per_device_eval_batch_size]
            _, stats, _ = pair_stats(indices, eval_examples, eval_ref, model, bco_delta)
            values = torch.stack(list(stats.values())) * len(indices)
            sums = values if sums is None else sums + values
            count += len(indices)
        model.train()
        totals = accelerator.reduce(sums, "sum") / accelerator.reduce(count, "sum")
        return {f"eval_{k}": v for k, v in zip(stats, totals.tolist())}

    def log_samples(step):
        """Greedy completions of the first eval prompts beside the chosen completion."""
        if args.num_sample_generations <= 0:
            return
        rows = eval_examples[:args.num_sample_generations]
        gather = args.model.ds3_gather_for_generation
        with unwrapped_for_generation(accelerator, model, gather) as unwrapped:  # all ranks
            if not decodes_here(accelerator, gather):
                return
            ids = generate(unwrapped, tokenizer, [p for p, _, _ in rows], args.max_new_tokens,
                           temperature=0.0).completion_ids
        samples = [{"prompt": tokenizer.decode(p, skip_special_tokens=True), "completion": c,
                    "chosen": tokenizer.decode(ch, skip_special_tokens=True)}
                   for (p, ch, _), c in zip(rows, tokenizer.batch_decode(ids, skip_special_tokens=True))]
        tracker.log_samples(samples, step)

    def micro_batches():
        """Endless shuffled micro-batches (indices) of this process's share of each global batch."""
        rng = random.Random(args.seed)  # same order on every rank; each rank takes its own slice
        per_step = args.per_device_train_batch_size * args.world_size
        while True:
            order = list(range(len(train_examples)))
            rng.shuffle(order)
            for start in range(0, len(order) - per_step + 1, per_step):
                yield order[start:start + per_step][accelerator.process_index::args.world_size]

    batches = micro_batches()
    for _ in range(resumed.get("step", 0) * args.gradient_accumulation_steps):  # the data position
        next(batches)
    bco_sum, bco_count = resumed.get("bco", (0.0, 0))  # running mean of the training rewards (bco_pair's delta)
    if "ref_model" in resumed:  # TR-DPO: the reference has moved since it was loaded
        load_reference_state(ref_model, resumed["ref_model"], accelerator)
    start_time = time.time()
    for step in range(resumed.get("step", 0) + 1, args.num_steps + 1):
        # ---- UPDATE: one optimizer step; every micro-batch holds the same number of pairs, so the
        # mean over micro-batches (accelerate divides by gradient_accumulation_steps) is exact ----
        totals = None
        for _ in range(args.gradient_accumulation_steps):
            with accelerator.accumulate(model):
                indices = next(batches)
                loss, stats, reward_sum = pair_stats(indices, train_examples, train_ref, model,
                                                     bco_sum / max(bco_count, 1))
                if args.loss_type == "bco_pair":  # BCO's delta: every training pair's rewards so far, all ranks
                    total = accelerator.reduce(torch.stack([reward_sum, torch.tensor(
                        2.0 * len(indices), device=accelerator.device)]), "sum")
                    bco_sum, bco_count = bco_sum + total[0].item(), bco_count + int(total[1].item())
                if checkpointer.finite_loss(loss):  # under DeepSpeed backward steps the engine: check first
                    accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    if not checkpointer.finite(loss=loss, grad_norm=grad_norm):
                        optimizer.zero_grad()  # drop this update: the step below then changes nothing
                optimizer.step()
                optimizer.zero_grad()
            values = torch.stack(list(stats.values()))
            totals = values if totals is None else totals + values
        scheduler.step()
        tracker.step()

        # TR-DPO: pull the reference towards the policy (Gorbatovski et al. 2024, soft update)
        if args.sync_ref_model and step % args.ref_model_sync_steps == 0:
            alpha = args.ref_model_mixup_alpha
            with torch.no_grad():
                # under FSDP2 both are sharded alike (common.models.prepare_frozen): each rank mixes its own shards
                for ref_param, param in zip(ref_model.parameters(), accelerator.unwrap_model(model).parameters()):
                    ref_param.mul_(1 - alpha).add_(param.detach(), alpha=alpha)

        # ---- LOG ----
        means = (accelerator.reduce(totals, "mean") / args.gradient_accumulation_steps).tolist()
        metrics = dict(zip(stats, means))
        metrics.update({"grad_norm": float("nan" if grad_norm is None else grad_norm), "lr": scheduler.get_last_lr()[0],
                        "epoch": step / max(1, steps_per_epoch),
                        "steps_per_second": (step - resumed.get("step", 0)) / (time.time() - start_time)})
        if eval_examples and (step % args.eval_steps == 0 or step == args.num_steps):
            metrics.update(evaluate(bco_sum / max(bco_count, 1)))
            log_samples(step)
        tracker.log(metrics, step)
        # every --save_steps, and on SIGTERM / Ctrl-C / non-finite values: what the next steps depend on
        checkpointer.end_of_step(step, lambda: {"bco": (bco_sum, bco_count), **(  # built only when saved
            {"ref_model": reference_state(ref_model, accelerator)} if args.sync_ref_model else {})})

    # ---- SAVE ----
    os.makedirs(args.output_dir, exist_ok=True)
    save_model(accelerator, model, tokenizer, args.output_dir)
    accelerator.print(f"saved model and tokenizer to {args.output_dir}")
    tracker.close()


if __name__ == "__main__":
    with exit_on_user_error(), stop_on_signal():
        main(tyro.cli(Args))
