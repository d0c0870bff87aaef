"""Launched by tests/test_sharded_generate.py on 2 processes under FSDP2 or ZeRO-3 (argv: a model folder, an output
folder, optionally the CASES to run): each rank decodes its own prompts with the model left sharded
(`unwrapped_for_generation` with gather=False: every forward a collective), in CASES where the ranks hold different
numbers of prompts and so of `batch_size` chunks, as multi-turn episodes and GKD's on-policy prompts leave them.
Collectives give up after 60 s (a rank left waiting fails rather than hangs), and after each case the ranks check
that they reached its end together. Writes rank<r>.pt: per case, the completions' ids, mask and finished flags, and
how many times HF `generate` ran."""

import os
import sys
from unittest import mock

import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project
from common.generation import generate, unwrapped_for_generation  # noqa: E402
from common.models import load_policy, load_tokenizer  # noqa: E402
from common.runtime import end_processes, setup  # noqa: E402

# case: (batch_size, prompts on rank 0, prompts on rank 1); the last is the default batch size's edge
CASES = {"bs2_3v1": (2, 3, 1), "bs2_1v5": (2, 1, 5), "bs64_65v1": (64, 65, 1)}
SAMPLING = dict(temperature=0.7, top_k=20)
MAX_NEW_TOKENS = 6


def prompts_of(case: str, rank: int) -> tuple[list[list[int]], list[int]]:
    """(prompts, seeds) of a rank in a case: token lists of 1 to 6 tokens (a one-token prompt has no prefix to
    share), different on each rank, a seed each."""
    first = sum(CASES[case][1:1 + rank])
    rows = range(first, first + CASES[case][1 + rank])
    return [[10 + (7 * k + j) % 190 for j in range(1 + k % 6)] for k in rows], [1000 + k for k in rows]


if __name__ == "__main__":
    model_path, out, cases = sys.argv[1], sys.argv[2], sys.argv[3:] or list(CASES)
    accelerator = setup(seed=1, gradient_accumulation_steps=1, per_device_train_batch_size=1, max_grad_norm=1.0,
                        ddp_timeout=60)
    tokenizer = load_tokenizer(model_path)
    model = load_policy(model_path, tokenizer, "float32")
    model, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))  # DeepSpeed wants an optimizer
    assert any(isinstance(p, DTensor) or hasattr(p, "ds_status") for p in model.parameters()), "not sharded"
    rank, results = accelerator.process_index, {}
    for case in cases:
        prompts, seeds = prompts_of(case, rank)
        batch_size = CASES[case][0]
        with unwrapped_for_generation(accelerator, model, gather=False) as unwrapped, \
                mock.patch.object(unwrapped, "generate", wraps=unwrapped.generate) as calls:  # HF generate counted
            samples = generate(unwrapped, tokenizer, prompts, MAX_NEW_TOKENS, batch_size=batch_size, seeds=seeds,
                               **SAMPLING)
        results[case] = (samples.completion_ids.tolist(), samples.completion_mask.tolist(), samples.finished.tolist(),
                         calls.call_count)
        # in step: every rank ends the case's model calls together, else this meets a rank's leftover forwards
        reached = [None, None]
        torch.distributed.all_gather_object(reached, case)
        assert reached == [case, case], (rank, reached)
        print(f"rank {rank}: {case} done", flush=True)
    torch.save(results, f"{out}/rank{rank}.pt")
    end_processes()
