"""common/vllm.py without vLLM: the LoRA weight push, and the sampler's calls into stand-ins for
vLLM's engine (sleep mode, stop tokens) and weight-transfer classes (server mode, several ranks)."""

import sys
import types
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common.generation import generate, stop_token_ids, truncate_at_stop
from common.models import load_policy
from common import vllm as common_vllm
from common.vllm import VLLMSampler, _full_parameters, _hf_parameters
from tests.conftest import vllm_options


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
