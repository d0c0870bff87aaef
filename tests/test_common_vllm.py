"""common/vllm.py without vLLM: the LoRA weight push, and the sampler's calls into stand-ins for
vLLM's engine (sleep mode, stop tokens) and weight-transfer classes (server mode, several ranks)."""

import copy
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM

from common.generation import CACHE, generate, stop_token_ids, truncate_at_stop
from common.models import load_policy, load_tokenizer
from common import vllm as common_vllm
from common.runtime import UserError
from common.vllm import VLLMSampler, _hf_parameters, full_parameters, sample_with, wait_for_server
from tests import stand_in_vllm
from tests.conftest import run_script, sampling_logprobs, vllm_options, script_args
from tests.stand_in_vllm import TP_BUDGET, TP_EPISODES, TP_SAMPLING, FakeLLM, Server, chat_tokenizer, scripted
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
        pushed = {n: t.clone() for n, t in full_parameters(accelerator, model)}  # vLLM copies each as it comes
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


@pytest.fixture()
def fake_vllm(monkeypatch):
    """The stand-in `vllm` modules (tests/stand_in_vllm.py) in sys.modules for the test; the server's
    answers and this machine's address stood in for too."""
    vllm = stand_in_vllm.install(lambda name, module: monkeypatch.setitem(sys.modules, name, module))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the sampler sets it; undone after the test
    monkeypatch.setattr(common_vllm, "wait_for_server", lambda host, port, timeout: ("http://server", 2))
    monkeypatch.setattr(common_vllm, "address_towards", lambda host, port: f"this machine, seen from {host}:{port}")
    return vllm


def sample(sampler, tokenizer, prompts):
    return sampler.generate(tokenizer, prompts, 4, temperature=1.0, seeds=list(range(len(prompts))))


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_mode_wakes_the_weights_before_sampling(fake_vllm, tiny_model, tokenizer, level):
    """Level 1 keeps the weights (a CPU copy): the first rollout samples the engine's own, later ones after a
    push. Level 2 drops them: every rollout pushes first, the first and a second in the same step included
    (as the scripts do: `step > 0 or sampler.needs_push`), in the order wake weights, push, wake the KV cache,
    generate, sleep."""
    sampler = VLLMSampler(stand_in_accelerator(), tiny_model, max_length=64,
                          **vllm_options(enable_sleep_mode=True, sleep_level=level, dtype="float32"))
    policy = load_policy(tiny_model, tokenizer, "float32")
    for step in (0, 1, 1, 2):  # step 1 samples twice (dynamic sampling's second round)
        first_of_step = step != getattr(sampler, "_last_step", None)
        sampler._last_step = step
        if step > 0 and first_of_step or sampler.needs_push:
            sampler.push_weights(policy)
            assert FakeLLM.last.reloaded == [n for n, _ in policy.named_parameters()]
        sample(sampler, tokenizer, [[10, 11, 12]])
        assert FakeLLM.last.awake == set(), "the engine keeps its memory between rollouts"
    rollout = ["wake_up ['weights']", "reload_weights", "reset_prefix_cache", "wake_up ['kv_cache']", "generate",
               f"sleep {level}"]
    if level == 2:
        assert FakeLLM.last.calls == ["sleep 2"] + rollout * 4
    else:  # the second rollout of step 1 samples with the weights pushed for the first
        assert FakeLLM.last.calls == ["sleep 1", "wake_up None", "generate", "sleep 1", *rollout,
                                      "wake_up None", "generate", "sleep 1", *rollout]
    if level == 2:  # a rollout without a push would sample with whatever the dropped memory holds
        with pytest.raises(RuntimeError, match="sleep level 2 dropped the engine's weights"):
            sample(sampler, tokenizer, [[10, 11, 12]])


def test_server_mode_only_the_main_process_sends(fake_vllm, monkeypatch, tiny_model, tokenizer):
    policy = load_policy(tiny_model, tokenizer, "float32")
    names = [n for n, _ in policy.named_parameters()]
    iterated = []

    def walked(accelerator, model):  # every rank must walk the parameters: ZeRO-3 gathers each
        for name, param in full_parameters(accelerator, model):
            iterated.append(name)
            yield name, param
    monkeypatch.setattr(common_vllm, "full_parameters", walked)
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
        assert info.master_address == "this machine, seen from 127.0.0.1:8000"  # rank 0 opens the group there
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
    out = generate(policy, tokenizer, [[10, 11, 5], [12, 6]], max_new_tokens=6, temperature=0)
    ids, mask, finished = out.completion_ids, out.completion_mask, out.finished
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
    out = sample(sampler, tokenizer, [[10, 11, 5]])
    ids, mask, finished = out.completion_ids, out.completion_mask, out.finished
    assert FakeLLM.last.params[0].stop_token_ids == [eos, second]
    assert ids.tolist() == [[6, second, pad, pad]] and mask.tolist() == [[1, 1, 0, 0]] and finished.tolist() == [True]


def test_server_mode_the_group_opens_at_this_machines_address_not_the_servers(fake_vllm, monkeypatch, tiny_model):
    """Trainer rank 0 is rank 0 of the weights' NCCL group, so it opens the rendezvous, and the server's
    workers connect to it: the group's address is this machine's (--vllm_group_host, default: the address
    on the route to the server), not --vllm_server_host (which vLLM 0.32 would try to bind, failing on a
    server of its own node). Here the server listens on 127.0.0.2, a second loopback address."""
    import socket

    for given, expected in ((None, "this machine, seen from 127.0.0.2:8100"), ("10.0.0.5", "10.0.0.5")):
        fake_vllm.transfers.clear()
        sampler = VLLMSampler(stand_in_accelerator(), tiny_model, max_length=64,
                              **vllm_options(mode="server", server_host="127.0.0.2", server_port=8100,
                                             group_host=given))
        sampler.push_weights(torch.nn.Linear(1, 1))
        (_, info), *_ = fake_vllm.transfers
        assert info.master_address == expected and sampler.url == "http://server"
    monkeypatch.undo()  # the real address_towards, against a listening socket
    with socket.create_server(("127.0.0.2", 0)) as server:
        assert common_vllm.address_towards("127.0.0.2", server.getsockname()[1]) == "127.0.0.1"


@pytest.mark.fsdp
@pytest.mark.parametrize("kind", ["plain", "lora"])
def test_fsdp2_push_sends_every_full_weight_one_at_a_time(tmp_path, tiny_model, kind):
    """Under FSDP2 (2 gloo processes, configs/fsdp2.yaml) each rank holds a shard of each weight (a DTensor),
    which a push used to hand to vLLM as it was: its loader's copy into a plain tensor failed at the first
    push. Now every rank's engine (colocate) and the server's weight source receive each weight whole, as
    the unsharded policy holds it (with LoRA: base + lora_alpha / r x B @ A, worked out here), one gathered
    parameter alive at a time. With a plain policy also --vllm_tensor_parallel_size 2: one engine for both
    ranks samples both ranks' prompts with their own seeds, and each rank gets its own completions back; with
    multi-turn episodes both ranks ask it the same requests on every turn (check_tp_episodes)."""
    if kind == "lora":
        pytest.importorskip("peft")
    from tests.test_fsdp import LAUNCHER, ON_CPU

    run_script("tests/fsdp_vllm_probe.py", tiny_model, str(tmp_path), kind, launcher=LAUNCHER, env=ON_CPU, timeout=300)
    unsharded = torch.load(tmp_path / "unsharded.pt")
    expected = {}
    for name, weight in unsharded.items():
        if "lora_" in name:
            continue
        layer = name.removesuffix(".base_layer.weight")
        if layer != name:  # scale 16 / 4: the probe's lora_alpha / r
            lora_b, lora_a = unsharded[f"{layer}.lora_B.default.weight"], unsharded[f"{layer}.lora_A.default.weight"]
            weight = weight + 4.0 * lora_b @ lora_a
        expected[name.removeprefix("base_model.model.").replace(".base_layer", "")] = weight
    differences = []
    for mode in ("colocate", "server"):
        for rank in (0, 1):
            pushed = torch.load(tmp_path / f"{mode}{rank}.pt")
            assert list(pushed["received"]) == list(expected) and pushed["most_alive"] == 1, (mode, rank)
            for name, weight in expected.items():
                torch.testing.assert_close(pushed["received"][name], weight, rtol=1e-6, atol=1e-6)
                differences.append((pushed["received"][name] - weight).abs().max().item())
    print(f"\nFSDP2 push ({kind}): {len(expected)} weights x 2 modes x 2 ranks, max difference {max(differences):.1e}")
    if kind == "plain":  # --vllm_tensor_parallel_size 2: one engine for both ranks, each rank its own completions
        asked = [[5, 10], [5, 11], [5, 20], [5, 21], [5, 22]]
        for rank, own in ((0, slice(0, 2)), (1, slice(2, 5))):
            tp = torch.load(tmp_path / f"tp{rank}.pt")
            assert tp["asked"] == asked and tp["seeds"] == [100, 101, 110, 111, 112] and tp["tensor_parallel_size"] == 2
            assert tp["got"] == [[prompt[-1], seed] for prompt, seed in zip(asked[own], tp["seeds"][own])], rank
        episodes = [torch.load(tmp_path / f"tp_episodes{rank}.pt") for rank in (0, 1)]
        check_tp_episodes(chat_tokenizer(load_tokenizer(tiny_model)), [e["requests"] for e in episodes],
                          [SimpleNamespace(**e["samples"]) for e in episodes])


def test_engine_options_reach_vllm_and_bad_tensor_parallel_sizes_are_refused(fake_vllm, tiny_model):
    sampler = VLLMSampler(stand_in_accelerator(), tiny_model, max_length=64,
                          **vllm_options(max_num_batched_tokens=2048))
    assert FakeLLM.last.kwargs["max_num_batched_tokens"] == 2048 and FakeLLM.last.kwargs["tensor_parallel_size"] == 1
    # the sampler's logprobs are those of the distribution it samples from (the corrections divide by them)
    assert FakeLLM.last.logprobs_mode == "processed_logprobs"
    assert not sampler.needs_push  # no sleep mode: the engine keeps the weights it loaded
    sampler.needs_push = True
    sampler.push_weights(torch.nn.Linear(2, 3))  # the cached prompt states of the old weights go with them
    assert FakeLLM.last.calls == ["reload_weights", "reset_prefix_cache"] and not sampler.needs_push
    for processes, mode in ((3, "colocate"), (2, "server")):
        with pytest.raises(UserError, match=f"--vllm_tensor_parallel_size 2 needs colocate mode and a number of "
                                            f"processes it divides \\(got {mode}, {processes}\\)"):
            VLLMSampler.check(stand_in_accelerator(processes=processes),
                              **vllm_options(mode=mode, tensor_parallel_size=2))


class SamplingLLM(FakeLLM):
    """Stands in for vllm.LLM with a sampler: draws each completion from the model it was built from (and the
    weights pushed since), one token at a time with the request's own seed, from logits / temperature truncated
    as vLLM 0.32 truncates (the tests' own rule, conftest.sampling_logprobs), and reports those processed
    logprobs, as the engine does under logprobs_mode="processed_logprobs" (else the raw ones)."""

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
                out = self.policy(torch.tensor([new]), use_cache=True, **{CACHE: cache})
                logq = sampling_logprobs(out.logits[0, -1].float() / p.temperature, top_k=max(p.top_k, 0),
                                         top_p=p.top_p, min_p=p.min_p)
                new, cache = [torch.multinomial(logq.exp(), 1, generator=generator).item()], getattr(out, CACHE)
                ids.append(new[0])  # reported: vLLM's default raw_logprobs are at temperature 1, untruncated
                reported = logq if self.logprobs_mode == "processed_logprobs" else out.logits[0, -1].log_softmax(-1)
                logprobs.append({new[0]: SimpleNamespace(logprob=reported[new[0]].item())})
                if new[0] in p.stop_token_ids:
                    break
            outputs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, logprobs=logprobs)]))
        return outputs


ONLINE = dict(reward_model_paths=[], reward_funcs=["tests.toy_rewards:short"], torch_dtype="float32", max_steps=2,
              per_device_train_batch_size=8, max_completion_length=12, vllm_importance_sampling_cap=2.0)


@pytest.mark.parametrize("script, truncation", [("grpo", dict(top_k=2)), ("grpo", dict(top_p=0.5)),
                                                ("rloo", dict(top_k=2))],
                                                ids=["grpo-top_k", "grpo-top_p", "rloo-top_k"])
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
    module.main(script_args(module.Args, model_name_or_path=tiny_model, use_vllm=True, output_dir=out, **group,
                            **ONLINE, **truncation))
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
        grpo.main(script_args(grpo.Args, output_dir=str(tmp_path / path), use_vllm=use_vllm, num_generations=4,
                              **common))
    engine = vars(FakeLLM.last.params[0])
    assert {k: hf[k] for k in flags} == {k: engine[k] for k in flags} == flags


class Ranks:
    """A tensor-parallel group of 2 in one process, a thread per rank: torch.distributed's all_gather_object and
    get_rank within the group, and run_episodes' reduce (max) across the ranks, stood in for."""

    def __init__(self, monkeypatch, size=2):
        self.size, self.barrier, self.slots, self.local = size, threading.Barrier(size, timeout=60), [None] * size, \
            threading.local()
        monkeypatch.setattr(torch.distributed, "new_subgroups_by_enumeration", lambda ranks: ("the group", None))
        monkeypatch.setattr(torch.distributed, "all_gather_object", self.all_gather_object)
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: self.local.rank)

    def exchange(self, value) -> list:
        self.slots[self.local.rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out

    def all_gather_object(self, output, obj, group=None):
        assert group == "the group"
        output[:] = self.exchange(copy.deepcopy(obj))  # a copy, as pickled through gloo

    def accelerator(self, rank):
        accelerator = stand_in_accelerator(rank, processes=self.size)
        accelerator.reduce = lambda t, reduction: torch.stack(self.exchange(t)).amax(0)
        return accelerator

    def run(self, fn) -> list:
        """[fn(rank) for every rank], each on its own thread."""
        def one(rank):
            self.local.rank = rank
            try:
                return fn(rank)
            except BaseException:
                self.barrier.abort()  # the other rank stops waiting
                raise
        with ThreadPoolExecutor(self.size) as pool:
            return list(pool.map(one, range(self.size)))


def glue(result: str, eos: str) -> str:
    """By hand, from configs/chatml_tools.jinja: after the assistant's end of turn, a user turn holding the tool's
    result, then the next assistant header (as tests/test_episodes.py)."""
    return f"\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response>{eos}\n<|im_start|>assistant\n"


def check_tp_episodes(tok, requests: list, samples: list):
    """tests/stand_in_vllm.py's TP_EPISODES, sampled by a tensor-parallel group of 2 (requests: what each rank's
    engine was asked, call by call; samples: each rank's episodes), against their tokens counted here: both ranks
    ask the same requests on every turn, each of a rank's prompts with that rank's budget left (the episode's
    max_completion_length less its tokens so far; 1 for a rank with no episode going), and each rank gets its own
    episodes back, cut to its own budget."""
    def n(text):
        return len(tok(text, add_special_tokens=False).input_ids)
    eos, m = tok.eos_token, TP_BUDGET
    (e0,), (e10, e11) = TP_EPISODES[0].values(), TP_EPISODES[1].values()
    first0 = n(e0[0]) + 1 + n(glue("36", eos))  # a turn: the reply, EOS, the tool result up to the next header
    second0 = first0 + n(e0[1]) + 1 + n(glue("72", eos))
    first10 = n(e10[0]) + 1 + n(glue("97406784", eos))
    turn = 2**48
    asked = [[(0, m), (10, m), (11, m)], [(turn, m - first0), (10 + turn, m - first10)],
             [(2 * turn, m - second0), (10 + 2 * turn, 1)]]  # (seed, max_tokens) of each request
    assert m - first0 != m - first10 and n(e10[1]) + 1 > m - first10  # the case: budgets differ, rank 1 cut
    assert requests[0] == requests[1], "the ranks of one engine asked it different requests"
    assert [[(q["seed"], q["max_tokens"]) for _, q in call] for call in requests[0]] == asked
    assert all({k: q[k] for k in TP_SAMPLING} == TP_SAMPLING for call in requests[0] for _, q in call)
    s0, s1 = samples
    own = [tok.decode(s.completion_ids[i][s.model_mask[i].bool()]) for s in samples for i in range(len(s.finished))]
    cut = tok.decode(tok(e10[1], add_special_tokens=False).input_ids[:m - first10])
    assert own == [e0[0] + eos + e0[1] + eos + e0[2] + eos, e10[0] + eos + cut, e11[0] + eos]
    assert s0.completion_mask.sum(1).tolist() == [second0 + n(e0[2]) + 1]
    assert s1.completion_mask.sum(1).tolist() == [m, n(e11[0]) + 1]
    assert s0.finished.tolist() == [True] and s1.finished.tolist() == [False, True]  # 10 did not stop in its budget


def test_a_tensor_parallel_group_asks_its_engine_the_same_requests_on_every_turn(fake_vllm, monkeypatch, tiny_model,
                                                                                 tokenizer):
    """--vllm_tensor_parallel_size 2 with multi-turn episodes: the two ranks of one engine (vLLM's external
    launcher) must ask it identical requests, or its collectives mismatch or hang. From turn 2 their budgets
    differ (each rank's episodes have their own lengths; a rank with none going asks 1 token); each prompt goes
    with its own rank's budget and options, the same list on both ranks (before: each rank asked every prompt with
    its own budget). Two ranks in-process (threads), the group's collectives stood in for."""
    tok, ranks = chat_tokenizer(tokenizer), Ranks(monkeypatch)
    samplers = [VLLMSampler(ranks.accelerator(rank), tiny_model, max_length=1024,
                            **vllm_options(tensor_parallel_size=2)) for rank in (0, 1)]
    for sampler in samplers:
        sampler.llm.completion_of = scripted(tok, TP_EPISODES[0] | TP_EPISODES[1])

    def episodes(rank):
        sampler = samplers[rank]
        sample = sample_with(sampler.accelerator, None, tok, sampler, gather=False, generate=None)
        return stand_in_vllm.tp_episodes(sample, tok, rank, sampler.accelerator).samples
    samples = ranks.run(episodes)
    check_tp_episodes(tok, [sampler.llm.requests for sampler in samplers], samples)


@pytest.fixture()
def served(monkeypatch):
    """The stand-in `vllm` modules for server mode, the server itself run by the test (stand_in_vllm.Server)."""
    return stand_in_vllm.install(lambda name, module: monkeypatch.setitem(sys.modules, name, module))


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logits", None])
def test_a_server_without_processed_logprobs_is_refused_before_any_model_loads(served, monkeypatch, tmp_path,
                                                                                tiny_model, mode):
    """Colocated engines report processed log-probabilities (of the distribution sampled from, after temperature and
    truncation), which the sampler-mismatch and staleness corrections divide by; a `vllm serve` at vLLM's default
    (raw_logprobs: temperature 1, no truncation) would bias both, as would one that does not say (None: no
    /server_info). Refused by the check, before the tokenizer or any model loads (before: accepted)."""
    from algos import grpo

    def loaded(*args, **kwargs):
        raise AssertionError("a tokenizer loaded before the server was checked")
    monkeypatch.setattr(grpo, "load_tokenizer", loaded)
    with Server(logprobs_mode=mode) as server, pytest.raises(UserError) as refused:
        grpo.main(script_args(grpo.Args, model_name_or_path=tiny_model, output_dir=str(tmp_path), use_vllm=True,
                            num_generations=4, vllm_mode="server", vllm_server_port=server.port, vllm_server_timeout=5,
                            **{**ONLINE, "vllm_importance_sampling_cap": None}))
    message = str(refused.value)
    said = f"reports logprobs_mode {mode};" if mode else "does not report its logprobs_mode at /server_info;"
    assert message.startswith(f"the vLLM server at http://127.0.0.1:{server.port} {said}") and "\n" not in message
    assert message.endswith("`VLLM_SERVER_DEV_MODE=1 vllm serve <model> --port <port> --weight-transfer-config "
                            "'{\"backend\": \"nccl\"}' --logprobs-mode processed_logprobs`")


def test_a_server_with_processed_logprobs_is_accepted(served):
    with Server(logprobs_mode="processed_logprobs", workers=3) as server:
        assert wait_for_server("127.0.0.1", server.port, 5) == (f"http://127.0.0.1:{server.port}", 3)
        VLLMSampler.check(stand_in_accelerator(), **vllm_options(mode="server", server_port=server.port))


def sends(vllm) -> int:
    return sum(call == "send" for call, *_ in vllm.transfers)


def test_server_mode_pushes_once_per_rollout_of_several_turns(served, tiny_model, tokenizer):
    """Three rollouts of a 3-turn episode (run_episodes through sample_with, as the scripts at --max_staleness 0)
    from a stand-in `vllm serve`: the weights go over once before each rollout of a new policy, none before the
    first, which samples the server's own (before: once before every turn of every rollout after the first)."""
    tok = chat_tokenizer(tokenizer)
    policy = load_policy(tiny_model, tok, "float32")
    with Server(complete=scripted(tok, TP_EPISODES[0]), workers=2) as server:
        sampler = VLLMSampler(stand_in_accelerator(), tiny_model, max_length=1024,
                              **vllm_options(mode="server", server_port=server.port))
        sample = sample_with(sampler.accelerator, policy, tok, sampler, gather=False, generate=None)
        pushed = []
        for version in range(3):
            sampler.needs_push |= version > 0  # as the scripts publish a new policy (common/rollouts.py, K = 0)
            episodes = stand_in_vllm.tp_episodes(sample, tok, 0, None)
            assert episodes.turns.tolist() == [3] and episodes.samples.finished.tolist() == [True]
            pushed.append(sends(served))
    assert pushed == [0, 1, 2] and len(server.completions) == 9


def test_grpo_dynamic_sampling_pushes_to_the_server_once_per_rollout(served, tmp_path, tiny_model):
    """grpo --dynamic_sampling against a stand-in `vllm serve` whose completions are all alike, so no group's
    rewards differ and every step draws --max_dynamic_sampling_rounds 3 batches: 3 steps, 9 batches, and the
    weights go over once per step after the first (before: once per batch, 6)."""
    from algos import grpo

    out = str(tmp_path / "grpo")
    with Server(complete=lambda prompt, seed: [20, 21, 22]) as server:
        grpo.main(script_args(grpo.Args, model_name_or_path=tiny_model, output_dir=out, use_vllm=True,
                            num_generations=4, vllm_mode="server", vllm_server_port=server.port, dynamic_sampling=True,
                            max_dynamic_sampling_rounds=3,
                            **{**ONLINE, "max_steps": 3, "vllm_importance_sampling_cap": None}))
    assert [log["dynamic_sampling/rounds"] for log in read_log(out)] == [3, 3, 3]
    assert len(server.completions) == 3 * 3 * 8 and sends(served) == 2
