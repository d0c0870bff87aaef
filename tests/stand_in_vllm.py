"""Stand-ins for vLLM, for tests without it: its engine (`vllm.LLM`) and the weight-transfer classes of
server mode, which record what the sampler calls and copy every weight pushed into them, as vLLM's
loader copies each into a plain tensor of its own; a `vllm serve` answering HTTP (Server); scripted multi-turn
completions, and the episodes of a tensor-parallel group of 2 (tp_episodes). Used by tests/test_common_vllm.py
in-process and by tests/fsdp_vllm_probe.py under FSDP2."""

import json
import os
import threading
import types
import weakref
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import torch


def receive(weights) -> tuple[dict, int]:
    """({name: a copy of the tensor}, the most pushed tensors alive at once): 1 when the sender hands over
    one gathered parameter at a time and keeps none of them."""
    received, alive, most = {}, [], 0
    for name, tensor in weights:
        alive = [ref for ref in alive if ref() is not None] + [weakref.ref(tensor)]
        most = max(most, len(alive))
        received[name] = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)  # a DTensor shard fails here
        del tensor
    return received, most


class FakeLLM:
    """Stands in for vllm.LLM: records the calls (the prefix-cache resets too), which sleep-mode tags are awake, the
    log-probability mode it was built with (vLLM's default when none: raw_logprobs) and every generate call's
    requests (`requests`: per call [(prompt ids, SamplingParams as a dict)]); every completion is `completion`
    (or completion_of's), cut at its request's max_tokens as vLLM cuts it."""

    completion = [6, 7]

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.awake, self.requests = kwargs, [], {"weights", "kv_cache"}, []
        self.logprobs_mode = kwargs.get("logprobs_mode", "raw_logprobs")
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
        self.received, self.most_alive = receive(kwargs["weights_iterator"])
        self.reloaded = list(self.received)

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def generate(self, prompts, params, use_tqdm=True):
        asleep = {"weights", "kv_cache"} - self.awake
        assert not asleep, f"generate with {sorted(asleep)} asleep: {self.calls}"
        self.calls.append("generate")
        self.prompts, self.params = [p["prompt_token_ids"] for p in prompts], params
        self.requests.append([(p, dict(vars(q))) for p, q in zip(self.prompts, params)])
        completions = [list(self.completion_of(p, q.seed))[:q.max_tokens] for p, q in zip(self.prompts, params)]
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=c, logprobs=[{t: SimpleNamespace(logprob=-1.0)}
                                                                                 for t in c])]) for c in completions]

    def completion_of(self, prompt, seed):
        return self.completion


def install(put) -> types.ModuleType:
    """Calls put(name, module) for `vllm` and the submodules the sampler imports; returns the `vllm` stand-in,
    whose `.transfers` records the server-mode calls and `.received` what the weight source yielded."""
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
                vllm.received, vllm.most_alive = receive(source)
                if info.rank == 0:
                    vllm.transfers.append(("send", list(vllm.received)))
            return SimpleNamespace(send_weights=send_weights)

    modules = {"vllm": vllm, "vllm.distributed": {}, "vllm.distributed.weight_transfer": {},
               "vllm.distributed.weight_transfer.base": dict(ModuleSource=ModuleSource, ParamMeta=lambda *a: a),
               "vllm.distributed.weight_transfer.clients": dict(HTTPVLLMWeightSyncClient=lambda url: url),
               "vllm.distributed.weight_transfer.nccl_engine": dict(NCCLTrainerInitInfo=SimpleNamespace,
                                                                    NCCLTrainerWeightTransferEngine=Engine)}
    for name, attrs in modules.items():
        module = attrs if isinstance(attrs, types.ModuleType) else types.ModuleType(name)
        module.__dict__.update({} if module is attrs else attrs)
        put(name, module)
    return vllm


def scripted(tokenizer, replies: dict):
    """completion_of(prompt, seed) of a scripted policy: episode e's turn k (seed e + k * 2**48, as run_episodes
    seeds a turn) is replies[e][k] then EOS; a turn no episode has gets a filler."""
    def completion_of(prompt, seed):
        turns, k = replies.get(seed % 2**48, []), seed // 2**48
        text = turns[k] if k < len(turns) else "(a turn no episode here needs)"
        return tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    return completion_of


class Server:
    """`vllm serve` standing in on 127.0.0.1 (a thread, `with Server(...) as server`, at server.port): the dev-mode
    /get_world_size and /server_info in its JSON form ({"vllm_config": {"model_config": {"logprobs_mode"}}}; None:
    no /server_info, 404), /v1/models, and /v1/completions for token-id prompts: complete(prompt, seed) cut at
    max_tokens, each token's logprob -0.5. `completions` records the completion requests' bodies."""

    def __init__(self, logprobs_mode: str | None = "processed_logprobs", workers: int = 1,
                 complete=lambda prompt, seed: [6, 7]):
        self.logprobs_mode, self.workers, self.complete, self.completions = logprobs_mode, workers, complete, []

    def answer(self, path: str, body: dict | None):
        if path == "/get_world_size":
            return {"world_size": self.workers}
        if path == "/server_info?config_format=json" and self.logprobs_mode:
            return {"vllm_config": {"model_config": {"model": "stand-in", "logprobs_mode": self.logprobs_mode}}}
        if path == "/v1/models":
            return {"object": "list", "data": [{"id": "stand-in", "object": "model"}]}
        if path == "/v1/completions" and body is not None:
            self.completions.append(body)
            ids = list(self.complete(body["prompt"], body["seed"]))[:body["max_tokens"]]
            return {"choices": [{"index": 0, "token_ids": ids, "logprobs": {"token_logprobs": [-0.5] * len(ids)}}]}
        return None

    def __enter__(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def reply(self, body):
                out = server.answer(self.path, body)
                data = json.dumps(out if out is not None else {"detail": "Not Found"}).encode()
                self.send_response(200 if out is not None else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.reply(None)

            def do_POST(self):
                self.reply(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.http.server_address[1]
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.http.shutdown()
        self.http.server_close()


CALL = '<tool_call>\n{{"name": "multiply", "arguments": {{"a": {}, "b": {}}}}}\n</tool_call>'
# the episodes of a tensor-parallel group of 2, by seed: rank 0's episode 0 calls twice, then answers (3 turns);
# rank 1's episode 10 calls once, then writes more than is left of its budget (truncated), its episode 11 answers
# at once: on turn 2 the ranks have different budgets left, on turn 3 rank 1 has no episode going (one token)
TP_EPISODES = ({0: [CALL.format(12, 3), CALL.format(36, 2), "It is 72."]},
               {10: [CALL.format(123456, 789), "one two three four five six seven eight nine ten " * 10],
                11: ["No tool is needed: 42."]})
TP_BUDGET, TP_SAMPLING = 300, dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.0)


def chat_tokenizer(tokenizer):
    """The tiny tokenizer with configs/chatml_tools.jinja, its turns ended by its EOS (tests/test_episodes.py)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tokenizer.chat_template = open(os.path.join(root, "configs", "chatml_tools.jinja")).read().replace(
        "<|im_end|>", tokenizer.eos_token)
    return tokenizer


def tp_episodes(sample, tokenizer, rank: int, accelerator):
    """Rank `rank`'s episodes of TP_EPISODES (tool: tests.toy_tools:multiply), sampled by `sample` as the scripts'
    run_episodes calls it (max_completion_length TP_BUDGET, TP_SAMPLING's options); tokenizer: chat_tokenizer's."""
    from common.episodes import load_tools, run_episodes

    seeds = list(TP_EPISODES[rank])
    tools = load_tools(tokenizer, ["tests.toy_tools:multiply"], None, num_episodes=len(seeds))
    rows = [{"prompt": [{"role": "user", "content": f"What is 12 * 3 * 2? (episode {seed})"}]} for seed in seeds]
    return run_episodes(sample, tokenizer, rows, tools, prompt_ids=None, seeds=seeds, max_new_tokens=TP_BUDGET,
                        max_prompt_length=1000, max_calls=None, accelerator=accelerator, **TP_SAMPLING)
