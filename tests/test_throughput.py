"""benchmarks/throughput.py: the instrumentation counts each model call once, and a short run writes
every field with shares that add up to 1."""

import json
import time

import pytest
import torch

from benchmarks import throughput

NAP = 0.1  # seconds each dummy module sleeps: long enough to stand out from a busy CPU's delays


class Sleeper(torch.nn.Module):
    def forward(self, x):
        time.sleep(NAP)
        return x


class Nested(torch.nn.Module):
    """Sleeps once itself and calls two sleeping children: 3 naps in all."""

    def __init__(self):
        super().__init__()
        self.a, self.b = Sleeper(), Sleeper()

    def forward(self, x):
        time.sleep(NAP)
        return self.b(self.a(x))


def test_nested_module_calls_are_timed_once():
    model = Nested()
    with throughput.Meter() as meter:
        model(torch.zeros(1))  # before the window opens: not counted
        meter.on = True
        model(torch.zeros(1))
        meter.on = False
    # double counting the children would give 5 naps
    assert 3 * NAP <= meter.seconds["forward"] < 4.5 * NAP
    assert meter.calls["forward"] == 1
    assert torch.nn.Module.__call__ is torch.nn.Module._wrapped_call_impl  # uninstalled


def test_model_calls_inside_generate_and_backward_are_not_forward(tiny_model):
    from transformers import AutoModelForCausalLM
    from transformers.generation.utils import GenerationMixin

    model, original = AutoModelForCausalLM.from_pretrained(tiny_model), GenerationMixin.generate
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    with throughput.Meter() as meter:
        meter.on = True
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
                       do_sample=False, pad_token_id=1)
        assert meter.seconds["forward"] == 0 and meter.calls["generate"] == 1
        assert 0 < meter.generate_model_seconds <= meter.seconds["generate"]
        # prefill of 2 x 3 positions, then 3 decoding steps of 2 x 1 (the 4th token needs no model call)
        assert meter.tokens == {"forward": 0, "generate": 2 * 3 + 3 * 2}
        loss = model(input_ids=ids).logits.sum()  # the inner GPTNeoXModel call is neither timed nor counted again
        assert meter.calls["forward"] == 1 and meter.tokens["forward"] == ids.numel()
        from accelerate import Accelerator

        Accelerator().backward(loss)  # as the scripts create it
        meter.on = False
    assert meter.calls["backward"] == 1 and meter.seconds["backward"] > 0
    assert GenerationMixin.generate is original  # uninstalled


@pytest.mark.long  # 17 s or more: in .ci/run's lane 1, out of the default suite
def test_benchmark_two_scripts(tmp_path, sft_model, rm_model):
    out = tmp_path / "throughput.json"
    report = throughput.main(throughput.Args(algos=["sft", "grpo"], warmup_steps=1, steps=2, sft_model_path=sft_model,
                                             reward_model_path=rm_model, output_json=str(out), markdown=True))
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    for key in ("date", "device", "torch_threads", "definitions", "args"):
        assert key in report
    for algo in ("sft", "grpo"):
        r = report["results"][algo]
        for key in ("steps_per_second", "seconds_per_step", "tokens_per_second", "peak_memory_mib", "memory_kind",
                    "share", "generate_model_share", "step_seconds", "command"):
            assert key in r, (algo, key)
        assert len(r["step_seconds"]) == 2 and r["steps_per_second"] > 0 and r["peak_memory_mib"] > 100
        assert set(r["share"]) == {"forward", "backward", "generate", "optimizer", "other"}
        assert sum(r["share"].values()) == pytest.approx(1.0, abs=1e-9)
        assert all(0 <= v <= 1 for v in r["share"].values()), r["share"]
        assert r["share"]["forward"] > 0 and r["share"]["backward"] > 0 and r["share"]["optimizer"] > 0
        assert r["tokens_per_second"] > 0
    assert report["results"]["sft"]["share"]["generate"] == 0 and report["results"]["sft"]["tokens"]["generate"] == 0
    grpo = report["results"]["grpo"]
    assert grpo["share"]["generate"] > 0 and grpo["tokens"]["generate"] > 0
    assert grpo["calls"]["generate"] == 2  # one sampling call per measured step
    assert 0 < grpo["generate_model_share"] < grpo["share"]["generate"]
