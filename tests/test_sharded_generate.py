"""Sharded decoding (issue 55): with the model left sharded (--no-ds3-gather-for-generation under ZeRO-3 or FSDP2)
every forward is a collective, and `generate` decodes `batch_size` prompts at a time. Ranks that hold different
numbers of prompts (multi-turn episodes after their first turn, GKD's on-policy prompts) used to make different
numbers of chunks' model calls and fell out of step: a collective mismatch or a hang until the timeout (65 prompts
against 1 at the default 64). Each rank now makes as many as the rank with the most, throwaway chunks on the others,
and its completions are those of one unsharded process decoding the same prompts with the same seeds.
tests/sharded_generate_probe.py is the program launched on 2 gloo processes."""

import math

import pytest
import torch

from tests.conftest import run_script
from tests.sharded_generate_probe import CASES, MAX_NEW_TOKENS, SAMPLING, prompts_of


def assert_as_one_process(folder, model_path, cases):
    """Each rank's completions equal those of generate in this process, on the unsharded model, for that rank's
    prompts and seeds; each rank ran HF generate as often as the rank with the most chunks."""
    from common.generation import generate
    from common.models import load_policy, load_tokenizer

    tokenizer = load_tokenizer(model_path)
    model = load_policy(model_path, tokenizer, "float32")
    ranks = [torch.load(folder / f"rank{rank}.pt") for rank in (0, 1)]
    for case in cases:
        batch_size, *counts = CASES[case]
        for rank, got in enumerate(ranks):
            prompts, seeds = prompts_of(case, rank)
            one = generate(model, tokenizer, prompts, MAX_NEW_TOKENS, batch_size=batch_size, seeds=seeds, **SAMPLING)
            assert got[case][:3] == (one.completion_ids.tolist(), one.completion_mask.tolist(),
                                     one.finished.tolist()), (case, rank)
            assert got[case][3] == max(math.ceil(n / batch_size) for n in counts), (case, rank)
            assert one.completion_mask.sum() > 2 * len(prompts)  # completions of several tokens: sampling shows


@pytest.mark.fsdp
def test_fsdp2_ranks_with_more_chunks_than_others_decode_in_step(tmp_path, tiny_model):
    """FSDP2 (configs/fsdp2.yaml, 2 gloo processes): batch_size 2 with 3 prompts against 1 and 1 against 5, and the
    default 64 with 65 against 1. Before the fix the first case ended in gloo's 'Received data size doesn't match
    expected size' (the probe's end-of-case check meeting the other rank's leftover forwards)."""
    from tests.test_fsdp import LAUNCHER, ON_CPU

    run_script("tests/sharded_generate_probe.py", tiny_model, str(tmp_path), launcher=LAUNCHER, env=ON_CPU,
               timeout=300)
    assert_as_one_process(tmp_path, tiny_model, list(CASES))


@pytest.mark.deepspeed
def test_zero3_ranks_with_more_chunks_than_others_decode_in_step(tmp_path, tmp_path_factory, tiny_model):
    """ZeRO-3 with every weight sharded for real (tests/test_deepspeed.py's sharded_launcher): the batch_size 2 cases
    only (65 prompts decoded under DeepSpeed's per-module gathers took ~3 minutes on 2 cores)."""
    pytest.importorskip("deepspeed")
    from tests.test_deepspeed import sharded_launcher

    cases = [case for case in CASES if CASES[case][0] == 2]
    run_script("tests/sharded_generate_probe.py", tiny_model, str(tmp_path), *cases,
               launcher=sharded_launcher(tmp_path_factory), timeout=300)
    assert_as_one_process(tmp_path, tiny_model, cases)
