"""Stand-ins for vLLM, for tests without it: its engine (`vllm.LLM`) and the weight-transfer classes of
server mode, which record what the sampler calls and copy every weight pushed into them, as vLLM's
loader copies each into a plain tensor of its own. Used by tests/test_common_vllm.py in-process and by
tests/fsdp_vllm_probe.py under FSDP2."""

import types
import weakref
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
        self.received, self.most_alive = receive(kwargs["weights_iterator"])
        self.reloaded = list(self.received)

    def reset_prefix_cache(self):
        pass

    def generate(self, prompts, params, use_tqdm=True):
        asleep = {"weights", "kv_cache"} - self.awake
        assert not asleep, f"generate with {sorted(asleep)} asleep: {self.calls}"
        self.calls.append("generate")
        self.prompts, self.params = [p["prompt_token_ids"] for p in prompts], params
        completions = [self.completion_of(p, q.seed) for p, q in zip(self.prompts, params)]
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
