"""common/vllm.py without vLLM: the LoRA weight push, and the sampler's calls into stand-ins for
vLLM's engine (sleep mode, stop tokens) and weight-transfer classes (server mode, several ranks)."""

import sys
import types
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM

from common.generation import generate, stop_token_ids, truncate_at_stop
from common.models import load_policy
from common import vllm as common_vllm
from common.vllm import VLLMSampler, _full_parameters, _hf_parameters
from tests.conftest import sampling_logprobs, vllm_options
from tests.test_sft import read_log


def stand_in_accelerator(rank=0, processes=1, barrier=lambda: None):
    return SimpleNamespace(process_index=rank, num_processes=processes, is_main_process=rank == 0,
                           device=torch.device("cpu"), unwrap_model=lambda m: m,
                           state=SimpleNamespace(deepspeed_plugin=None), wait_for_everyone=barrier)


def test_lora_push_leaves_the_base_weights_untouched():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).to(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in base.named_parameters()}
    r, alpha = 4, 16
    model = peft.get_peft_model(base, peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=["q_proj", "v_proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero, which would hide any merge error
            torch.nn.init.normal_(param, std=0.1)
    adapted = {f"{name.removeprefix('base_model.model.')}.weight": module for name, module in model.named_modules()
               if name.endswith(("q_proj", "v_proj"))}
    accelerator = stand_in_accelerator()
    for _ in range(100):
        pushed = {n: t.clone() for n, t in _full_parameters(accelerator, model)}  # vLLM copies each as it comes
    drift = {n: (p.float() - before[n].float()).abs().max().item() for n, p in _hf_parameters(model)
             if not torch.equal(p, before[n])}
    assert not drift, f"base weights moved by the pushes: {drift}"
    assert list(pushed) == list(before)  # the base model's names, in its order
    for name, weight in before.items():
        if name in adapted:
            layer = adapted[name]
            delta = (layer.lora_B["default"].weight.float() @ layer.lora_A["default"].weight.float()) * (alpha / r)
            assert pushed[name].dtype == torch.bfloat16
            torch.testing.assert_close(pushed[name].float(), weight.float() + delta, rtol=1e-2, atol=1e-3)
        else:
            assert torch.equal(pushed[name], weight), name


class FakeLLM:
    """Stands in for vllm.LLM: records the calls and which sleep-mode tags are awake; every
    completion is `completion`."""

    completion = [6, 7]

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.awake = kwargs, [], {"weights", "kv_cache"}
        type(self).last = self

    def sleep(self, level=1):
        self.calls.append(f"sleep {level}")
        self.awake = set()

    def wake_up(self, tags=None):
        self.calls.append(f"wake_up {tags}")
        if tags and not self.awake.isdisjoint(tags):
            return  # as vLLM 0.32: a tag already awake, and it wakes nothing (a warning only)
        self.awake |= set(tags or ["weights", "kv_cache"])

    def collective_rpc(self, method, kwargs=None):
        assert method == "reload_weights" and "weights" in self.awake, f"{method} with weights asleep: {self.calls}"
        self.calls.append(method)
        self.reloaded = [n for n, _ in kwargs["weights_iterator"]]

    def reset_prefix_cache(self):
        pass

    def generate(self, prompts, params, use_tqdm=True):
        asleep = {"weights", "kv_cache"} - self.awake
        assert not asleep, f"generate with {sorted(asleep)} asleep: {self.calls}"
        self.calls.append("generate")
        self.params = params
        logprobs = [{t: SimpleNamespace(logprob=-1.0)} for t in self.completion]
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=self.completion, logprobs=logprobs)])
                for _ in prompts]


@pytest.fixture()
def fake_vllm(monkeypatch):
    """A `vllm` module with the stand-in engine and the weight-transfer classes the sampler imports;
    records the server-mode calls in `.transfers`."""
    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams, vllm.transfers = FakeLLM, lambda **kw: SimpleNamespace(**kw), []

    class ModuleSource:
        def __init__(self, module):
            self._module = module

    class Engine:  # as vLLM 0.32's NCCLTrainerWeightTransferEngine: called on every rank, where trainer
        @staticmethod  # rank 0 alone joins the NCCL group and sends; the others only iterate the source
        def trainer_init(info, client, source):
            vllm.transfers.append(("trainer_init", info))
            if info.rank == 0:
                vllm.transfers.append(("rendezvous", info.world_size))

            def send_weights():
                names = [n for n, _ in source]
                if info.rank == 0:
                    vllm.transfers.append(("send", names))
            return SimpleNamespace(send_weights=send_weights)

    modules = {"vllm": vllm, "vllm.distributed": {}, "vllm.distributed.weight_transfer": {},
               "vllm.distributed.weight_transfer.base": dict(ModuleSource=ModuleSource, ParamMeta=lambda *a: a),
               "vllm.distributed.weight_transfer.clients": dict(HTTPVLLMWeightSyncClient=lambda url: url),
               "vllm.distributed.weight_transfer.nccl_engine": dict(NCCLTrainerInitInfo=SimpleNamespace,
                                                                    NCCLTrainerWeightTransferEngine=Engine)}
    for name, attrs in modules.items():
        module = attrs if isinstance(attrs, types.ModuleType) else types.ModuleType(name)
        module.__dict__.update({} if module is attrs else attrs)
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the sampler sets it; undone after the test
    monkeypatch.setattr(common_vllm, "wait_for_server", lambda host, port, timeout: ("http://server", 2))
    return vllm


def sample(sampler, tokenizer, prompts):
    return sampler.generate(tokenizer, prompts, 4, 1.0, 1.0, 0, 0.0, 1.0, seeds=list(range(len(prompts))))


def test_sleep_mode_wakes_the_weights_before_sampling(fake_vllm, tiny_model, tokenizer):
    sampler = VLLMSampler(stand_in_accelerator(), tiny_model, max_length=64,
                          **vllm_options(enable_sleep_mode=True, dtype="float32"))
    policy = load_policy(tiny_model, tokenizer, "float32")
    for step in range(3):  # the first rollout comes before any push
        if step:
            sampler.push_weights(policy)
            assert FakeLLM.last.reloaded == [n for n, _ in policy.named_parameters()]
        sample(sampler, tokenizer, [[10, 11, 12]])
        assert FakeLLM.last.awake == set(), "the engine keeps its memory between rollouts"
    assert FakeLLM.last.calls.count("generate") == 3 and FakeLLM.last.calls.count("reload_weights") == 2


def test_server_mode_only_the_main_process_sends(fake_vllm, monkeypatch, tiny_model, tokenizer):
    policy = load_policy(tiny_model, tokenizer, "float32")
    names = [n for n, _ in policy.named_parameters()]
    iterated = []

    def full_parameters(accelerator, model):  # every rank must walk the parameters: ZeRO-3 gathers each
        for name, param in _full_parameters(accelerator, model):
            iterated.append(name)
            yield name, param
    monkeypatch.setattr(common_vllm, "_full_parameters", full_parameters)
    transfers = fake_vllm.transfers
    for rank in (1, 0):
        transfers.clear()
        accelerator = stand_in_accelerator(rank, processes=2, barrier=lambda: transfers.append("barrier"))
        sampler = VLLMSampler(accelerator, tiny_model, max_length=64, **vllm_options(mode="server"))
        for _ in range(2):
            sampler.push_weights(policy)
        assert iterated == names * 2, f"rank {rank}"
        iterated.clear()
        (call, info), *rest = transfers
        assert call == "trainer_init" and info.rank == rank and info.world_size == 1 + 2  # trainer rank 0 + 2 workers
        # rank 1 neither joins the group nor sends, and no rank samples before the server has the new weights
        sends = [] if rank else [("send", names)]
        assert rest == ([] if rank else [("rendezvous", 3)]) + (sends + ["barrier"]) * 2, f"rank {rank}: {rest}"


def test_hf_and_vllm_stop_at_every_eos_of_the_generation_config(fake_vllm, tmp_path, tiny_model, tokenizer):
    eos, second = tokenizer.eos_token_id, 7  # chat models list their end-of-turn token too (Llama 3, Qwen)
    policy = load_policy(tiny_model, tokenizer, "float32").eval()
    policy.generation_config.eos_token_id = [eos, second]
    assert stop_token_ids(policy, tokenizer) == [eos, second]
    assert stop_token_ids(policy.generation_config, tokenizer) == [eos, second]

    # a policy whose next token depends only on the current one: 5 -> 6 -> 7 -> 8 -> EOS
    vocab = policy.config.vocab_size
    table = torch.full((vocab, vocab), -1e4)
    table[:, 9] = 0
    for token, following in {5: 6, 6: second, second: 8, 8: eos}.items():
        table[token] = -1e4
        table[token, following] = 0

    def fixed_logits(module, args, kwargs, out):
        out.logits = table[kwargs["input_ids"]][:, -out.logits.shape[1]:]
        return out
    policy.register_forward_hook(fixed_logits, with_kwargs=True)
    _, _, ids, mask, finished = generate(policy, tokenizer, [[10, 11, 5], [12, 6]], max_new_tokens=6, temperature=0)
    pad = tokenizer.pad_token_id
    assert ids.tolist() == [[6, second] + [pad] * 4, [second] + [pad] * 5]
    assert mask.tolist() == [[1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]] and finished.tolist() == [True, True]

    # truncation cuts at the first of any stop id; a single id still works
    ids = torch.tensor([[4, second, 5, eos], [4, eos, second, 5], [4, 5, 6, 8]])
    out, mask, finished = truncate_at_stop(ids, [eos, second], pad)
    assert out.tolist() == [[4, second, pad, pad], [4, eos, pad, pad], [4, 5, 6, 8]]
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]] and finished.tolist() == [True, True, False]
    assert truncate_at_stop(ids, eos, pad)[0].tolist() == [[4, second, 5, eos], [4, eos, pad, pad], [4, 5, 6, 8]]

    # vLLM is asked to stop at the same ids (read from the saved model's generation_config.json),
    # and its completions are cut and masked at them
    policy.save_pretrained(tmp_path)
    sampler = VLLMSampler(stand_in_accelerator(), str(tmp_path), max_length=64, **vllm_options())
    _, _, ids, mask, finished, _ = sample(sampler, tokenizer, [[10, 11, 5]])
    assert FakeLLM.last.params[0].stop_token_ids == [eos, second]
    assert ids.tolist() == [[6, second, pad, pad]] and mask.tolist() == [[1, 1, 0, 0]] and finished.tolist() == [True]


class SamplingLLM(FakeLLM):
    """Stands in for vllm.LLM with a sampler: draws each completion from the model it was built from (and the
    weights pushed since), one token at a time with the request's own seed, from logits / temperature truncated
    as vLLM 0.32 truncates (the tests' own rule, conftest.sampling_logprobs), and reports those processed
    logprobs, as the engine does under logprobs_mode="processed_logprobs"."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.policy = AutoModelForCausalLM.from_pretrained(kwargs["model"], dtype=torch.float32).eval()

    def collective_rpc(self, method, kwargs=None):
        assert method == "reload_weights"
        self.policy.load_state_dict({name: t.clone() for name, t in kwargs["weights_iterator"]}, strict=False)

    @torch.no_grad()
    def generate(self, prompts, params, use_tqdm=True):
        self.params, outputs = params, []
        for prompt, p in zip(prompts, params):
            assert p.repetition_penalty == 1 and p.logprobs == 0
            generator, ids, logprobs, cache = torch.Generator().manual_seed(p.seed), [], [], None
            new = list(prompt["prompt_token_ids"])
            for _ in range(p.max_tokens):
                out = self.policy(torch.tensor([new]), past_key_values=cache, use_cache=True)
                logq = sampling_logprobs(out.logits[0, -1].float() / p.temperature, top_k=max(p.top_k, 0),
                                         top_p=p.top_p, min_p=p.min_p)
                new, cache = [torch.multinomial(logq.exp(), 1, generator=generator).item()], out.past_key_values
                ids.append(new[0])
                logprobs.append({new[0]: SimpleNamespace(logprob=logq[new[0]].item())})
                if new[0] in p.stop_token_ids:
                    break
            outputs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, logprobs=logprobs)]))
        return outputs


ONLINE = dict(reward_model_paths=[], reward_funcs=["tests.toy_rewards:short"], torch_dtype="float32", max_steps=2,
              per_device_train_batch_size=8, max_completion_length=12, vllm_importance_sampling_cap=2.0)


@pytest.mark.parametrize("script, truncation", [("grpo", dict(top_k=2)), ("grpo", dict(top_p=0.5)),
                                                ("rloo", dict(top_k=2))], ids=["grpo-top_k", "grpo-top_p", "rloo-top_k"])
def test_truncated_sampling_leaves_the_sampler_ratio_at_one(fake_vllm, monkeypatch, tmp_path, tiny_model, script,
                                                           truncation):
    """Same weights in the trainer and in a stand-in engine that samples with top-k 2 or top-p 0.5 and reports
    the truncated distribution's logprobs: the trainer's logprobs are of that distribution too, so pi_train /
    pi_vllm is 1 to float precision at every step (before: the trainer's were over the whole vocabulary, and
    the ratio was the kept probability mass, 0.0054 under top-k 2 on this untrained model, 0.50 under top-p 0.5)."""
    from algos import grpo, rloo

    monkeypatch.setattr(fake_vllm, "LLM", SamplingLLM)
    module, group = (grpo, dict(num_generations=4)) if script == "grpo" else (rloo, dict(rloo_k=4))
    out = str(tmp_path / script)
    module.main(module.Args(model_name_or_path=tiny_model, use_vllm=True, output_dir=out, **group, **ONLINE,
                            **truncation))
    logs = read_log(out)
    assert len(logs) == 2 and SamplingLLM.last.params[0].top_k == truncation.get("top_k", -1)
    for log in logs:
        stats = {k: log[f"sampling/importance_sampling_ratio/{k}"] for k in ("mean", "min", "max")}
        print(script, truncation, {k: round(v, 6) for k, v in stats.items()})
        assert abs(stats["mean"] - 1) < 1e-4 and 1 - 1e-3 < stats["min"] <= stats["max"] < 1 + 1e-3, stats


def test_the_same_sampling_settings_reach_hf_generate_and_vllm(fake_vllm, monkeypatch, tmp_path, tiny_model):
    """For the same flags, the HF path's sampler and generation config and the SamplingParams vLLM gets hold
    the same temperature, top-k, top-p, min-p and repetition penalty (the penalty with the sampler correction
    is refused: tests/test_bad_input.py); the order of the truncations: test_common_generation.py."""
    import inspect

    from algos import grpo
    from common import generation

    hf, sampler = {}, generation.SeededSampler

    class RecordingSampler(sampler):
        def __init__(self, *args, **kwargs):
            hf.update(inspect.signature(sampler.__init__).bind(self, *args, **kwargs).arguments)
            super().__init__(*args, **kwargs)

    def recording_config(**kwargs):
        hf["repetition_penalty"] = kwargs["repetition_penalty"]
        return GenerationConfig(**kwargs)
    monkeypatch.setattr(generation, "SeededSampler", RecordingSampler)
    monkeypatch.setattr(generation, "GenerationConfig", recording_config)
    flags = dict(temperature=0.8, top_k=3, top_p=0.9, min_p=0.05, repetition_penalty=1.1)
    common = dict(model_name_or_path=tiny_model, **{**ONLINE, "max_steps": 1, "vllm_importance_sampling_cap": None},
                  **flags)
    for path, use_vllm in (("hf", False), ("vllm", True)):
        grpo.main(grpo.Args(output_dir=str(tmp_path / path), use_vllm=use_vllm, num_generations=4, **common))
    engine = vars(FakeLLM.last.params[0])
    assert {k: hf[k] for k in flags} == {k: engine[k] for k in flags} == flags
