"""dpo under ZeRO-2, ppo under ZeRO-3 (sharded for real: tests/test_deepspeed.py's `sharded_launcher`) and
grpo under FSDP2, on 2 processes with 2 micro-batches of gradient accumulation and bf16 mixed precision together,
against 1 process of the same backend at the same settings (4 micro-batches: the same global batch). The other
2-process tests run GA 1 in fp32, which hides dtype and accumulation faults (a loss summed where it should be
averaged over micro-batches, a bf16 tensor where fp32 was meant, a gradient reduced before accumulation ends).

bf16 keeps 8 significant bits: a value's neighbours lie 2^-8 (0.4%) of it away, and the two runs round sums taken in
different orders (2 x 2 micro-batches against 4, reduced across ranks in bf16), so they agree to a few such steps,
not to fp32's 1e-5: logged losses to 1e-2 (2.5 steps of a value near 1: the losses are 0.69 and below; ppo's KL,
a sum of per-token log-ratios, to 5e-2), weights to
2^-7 of their size plus 1e-3 (2 steps; Adam moves a weight whose gradient is float noise by up to the learning
rate either way). A 2x accumulation fault moves the losses of step 2 by far more; a fault in fp32 alone (GA 1)
is test_deepspeed.py's and test_fsdp.py's to catch, to 1e-5.

Not in the default run: `python -m pytest -m "deepspeed or fsdp"` (.ci/run runs them with the other 2-process tests)."""

import os

import pytest
import torch

from tests.conftest import run_script
from tests.test_deepspeed import assert_same_losses, launcher, saved_weights, sharded_launcher
from tests.test_fsdp import LAUNCHER, ON_CPU
from tests.test_multiprocess import CASES, QUIET, model_flags
from tests.test_sft import read_log

BACKENDS = {"zero2": pytest.mark.deepspeed, "zero3": pytest.mark.deepspeed, "fsdp2": pytest.mark.fsdp}


def backend_launcher(backend: str, processes: int, tmp_path_factory):
    if backend == "zero3":
        return sharded_launcher(tmp_path_factory, "bf16", processes)
    base = launcher(2, mixed_precision="bf16") if backend == "zero2" else [*LAUNCHER[:-4], "--mixed_precision", "bf16",
                                                                             "--dynamo_backend", "no"]
    return [*base[:base.index("--num_processes") + 1], str(processes), *base[base.index("--num_processes") + 2:]]


# one script per backend (all nine of each would add ~10 minutes to .ci/run, which must stay within CI's limit on a
# slow day): ppo, with the most models and engines, where sharding is deepest (ZeRO-3); an online script with one
# model under FSDP2; an offline one with a reference under ZeRO-2
COMBINATIONS = [("dpo", "zero2"), ("ppo", "zero3"), ("grpo", "fsdp2")]


@pytest.mark.parametrize("script, backend", [pytest.param(s, b, marks=BACKENDS[b], id=f"{s}-{b}")
                                             for s, b in COMBINATIONS])
def test_accumulation_and_bf16_on_two_processes_match_one_process(tmp_path, tmp_path_factory, sft_model, rm_model,
                                                                   script, backend):
    if backend != "fsdp2":
        pytest.importorskip("deepspeed")
    flags, keys = CASES[script]
    common = [f"algos/{script}.py", "--max_steps", "2", "--logging_steps", "1", *QUIET.get(script, []),
              *model_flags(script, sft_model, rm_model), *flags]
    for processes in (2, 1):
        run_script(*common, "--gradient_accumulation_steps", str(4 // processes), "--output_dir",
                   str(tmp_path / str(processes)), launcher=backend_launcher(backend, processes, tmp_path_factory),
                   env=ON_CPU if backend == "fsdp2" else os.environ)
    two, one = (read_log(str(tmp_path / n)) for n in ("2", "1"))
    assert_same_losses(two, one, [k for k in keys if k != "objective/kl"], [1, 2], tolerance=1e-2)
    if "objective/kl" in keys:  # a sum over a response's tokens of log-ratios, each as rounded as a logit (|l| ~ 8:
        assert_same_losses(two, one, ["objective/kl"], [1, 2], tolerance=5e-2)  # 2^-8 * 8 = 0.03)
        # at step 1 the policy is the reference: the frozen copy computes as the policy does in bf16 (under FSDP2
        # the same mixed-precision policy, no autocast; under DeepSpeed a bf16 engine), so its KL is 0 exactly
        assert [r["objective/kl"] for r in two + one if r["step"] == 1] == [0.0, 0.0]
    a, b = (saved_weights(str(tmp_path / n), script) for n in ("2", "1"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name].float(), b[name].float(), rtol=2**-7, atol=1e-3), name
    print(f"\n{script} {backend} GA 2 + bf16:", {k: max(abs(x[k] - y[k]) for x, y in zip(two, one) if k in x and k in y)
                                               for k in keys},
          "weights:", max((a[k].float() - b[k].float()).abs().max().item() for k in a))
