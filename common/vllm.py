"""Sampling with vLLM for the online scripts (`--use_vllm`; vLLM is imported only then).

colocate: a `vllm.LLM` inside each training process (or one per group of --vllm_tensor_parallel_size
    processes); the policy's weights go in one parameter at a time (each gathered alone under ZeRO-3 and
    FSDP2) through vLLM's in-place `reload_weights`.
server: `VLLM_SERVER_DEV_MODE=1 vllm serve <model> --weight-transfer-config '{"backend": "nccl"}'
    --logprobs-mode processed_logprobs` on other GPUs or another machine; completions over HTTP, weights over NCCL
    with vLLM's weight-transfer engine, in a group whose rendezvous trainer rank 0 opens at --vllm_group_host.
The policy always recomputes the training logprobs; the sampler's only feed the mismatch correction."""

import contextlib
import importlib
import json
import math
import os
import socket
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import torch
import tyro
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, GenerationConfig

from common.generation import Samples, pad, stop_token_ids, truncate_at_stop, unwrapped_for_generation
from common.models import deepspeed_stage
from common.runtime import UserError


@tyro.conf.configure(tyro.conf.OmitArgPrefixes)  # --vllm_mode, not --vllm.vllm-mode
@dataclass
class VLLMArgs:
    """sampling with vLLM (common/vllm.py)"""
    use_vllm: bool = False
    """sample with vLLM instead of HF generate (needs `pip install 'minimal-post-training[vllm]'` and a GPU)"""
    vllm_mode: Literal["colocate", "server"] = "colocate"
    """colocate: an engine inside each training process; server: a `vllm serve` on other GPUs"""
    vllm_gpu_memory_utilization: float = 0.3
    """colocate: share of each GPU's memory the engine may take (weights + KV cache)"""
    vllm_enable_sleep_mode: bool = False
    """colocate: release the engine's memory during the update and take it back to sample"""
    vllm_sleep_level: Literal[1, 2] = 2
    """colocate, sleep mode: 2 drops the weights while asleep (each rollout pushes them again), 1 keeps a CPU copy"""
    vllm_tensor_parallel_size: int = 1
    """colocate: processes that share one engine, each holding a slice of it (a divisor of the number of processes)"""
    vllm_max_num_batched_tokens: int | None = 4096
    """colocate: tokens vLLM schedules per step (bounds the activation memory it reserves; TRL's value)"""
    vllm_server_host: str = "127.0.0.1"
    """server: host of the vLLM server"""
    vllm_server_port: int = 8000
    """server: HTTP port of the vLLM server"""
    vllm_group_host: str | None = None
    """server: this machine's address as the server reaches it, for the weights' NCCL group (default: by connecting)"""
    vllm_group_port: int = 51216
    """server: port on which the trainer opens the NCCL group that carries the weights"""
    vllm_server_timeout: float = 240.0
    """server: seconds to wait for the server to answer before giving up"""


def _hf_parameters(model):
    """(name in the base model's checkpoint, parameter): with LoRA, the base weights only."""
    for name, param in model.named_parameters():
        if hasattr(model, "merge_adapter"):  # peft
            if "lora_" in name or "modules_to_save" in name:
                continue
            name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        yield name, param


def full_parameters(accelerator, model):
    """(HF name, full tensor), one at a time (gathered alone under ZeRO-3 and FSDP2, on every rank). A LoRA
    layer's weight goes out as base + the adapters' delta, computed aside: merging into a bf16 base and back
    would not restore it exactly, and the base (also the KL reference) would drift with every push."""
    unwrapped = accelerator.unwrap_model(model)
    lora = {id(m.get_base_layer().weight): m for m in unwrapped.modules() if hasattr(m, "lora_A")}
    for name, param in _hf_parameters(unwrapped):
        if deepspeed_stage(accelerator) == 3:  # never with LoRA (refused in check)
            import deepspeed
            with deepspeed.zero.GatheredParameters([param]):
                yield name, param.data
        else:  # a LoRA layer's weight plus its adapters' deltas (none elsewhere), in the base's dtype (peft's are
            # fp32); under FSDP2 a DTensor, this rank's shard of it: every rank gathers the whole (a collective)
            layer = lora.get(id(param))
            deltas = [layer.get_delta_weight(a) for a in layer.active_adapters if a in layer.lora_A] if layer else []
            weight = sum(deltas, param.data)
            yield name, (weight.full_tensor() if isinstance(weight, DTensor) else weight).to(param.dtype)


@contextlib.contextmanager
def _keep_hf_classes(model_type: str):
    """vLLM runs architectures it does not implement (Pythia's GPT-NeoX) through its Transformers backend,
    which patches `__init__` / `__call__` of the HF model classes in place; in this process that breaks
    the policy, an instance of the same class. Undo the patches once the engine is built. The model's
    own module is imported first, so it is restored even when no policy of its class was loaded yet."""
    with contextlib.suppress(ImportError):
        name = model_type.replace("-", "_")
        importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    saved = {(cls, key): cls.__dict__.get(key) for name, module in list(sys.modules.items())
             if name.startswith("transformers.models.") for cls in vars(module).values()
             if isinstance(cls, type) and issubclass(cls, torch.nn.Module) for key in ("__init__", "__call__")}
    try:
        yield
    finally:
        for (cls, key), value in saved.items():
            if cls.__dict__.get(key) is not value:
                setattr(cls, key, value) if value is not None else delattr(cls, key)


def _get(url: str, timeout: float = 30):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


def address_towards(host: str, port: int) -> str:
    """This machine's address on its route to host:port (the server's HTTP port, which answers): where the
    server's workers can reach trainer rank 0, which opens the weights' NCCL group as its rank 0."""
    with socket.create_connection((host, port), timeout=30) as connection:
        return connection.getsockname()[0]


SERVE = ("VLLM_SERVER_DEV_MODE=1 vllm serve <model> --port <port> --weight-transfer-config '{\"backend\": \"nccl\"}' "
         "--logprobs-mode processed_logprobs")  # the server mode's server (docs/scaling.md)


def server_logprobs_mode(url: str) -> str | None:
    """The server's logprobs_mode (vLLM's ModelConfig field) from its dev-mode /server_info in JSON, as vLLM >= 0.32
    serves it: {"vllm_config": {"model_config": {"logprobs_mode": ...}}}; None where it does not say."""
    try:
        return _get(f"{url}/server_info?config_format=json", timeout=30)["vllm_config"]["model_config"]["logprobs_mode"]
    except (OSError, ValueError, KeyError, TypeError):  # no such endpoint, not JSON, the text form, another layout
        return None


def wait_for_server(host: str, port: int, timeout: float) -> tuple[str, int]:
    """(URL, number of its workers) of the vLLM server, waiting up to `timeout` seconds for it, once it reports the
    log-probabilities colocated engines give: processed, i.e. of the distribution sampled from (after temperature
    and top-k/top-p/min-p), which --vllm_importance_sampling_cap and --max_staleness's weight divide by. vLLM's
    default, raw_logprobs (softmax at temperature 1, untruncated), would bias both; a server that does not report its
    mode is refused as well, since the corrections could not be trusted (server mode needs the dev mode that serves
    /server_info anyway)."""
    url, deadline = f"http://{host}:{port}", time.time() + timeout
    while True:
        try:
            workers = _get(f"{url}/get_world_size", timeout=5)["world_size"]
            break
        except OSError:
            if time.time() > deadline:
                raise UserError(f"no vLLM server answered at {url} within {timeout:.0f} s; start one with `{SERVE}` "
                                "(common/vllm.py) or raise --vllm_server_timeout") from None
            time.sleep(1)
    if (mode := server_logprobs_mode(url)) != "processed_logprobs":
        said = f"reports logprobs_mode {mode}" if mode else "does not report its logprobs_mode at /server_info"
        raise UserError(f"the vLLM server at {url} {said}; the sampler's log-probabilities must be processed_logprobs "
                        f"(of the distribution sampled from, after temperature and top-k/top-p/min-p): start it with "
                        f"`{SERVE}`")
    return url, workers


def sample_with(accelerator, model, tokenizer, sampler, *, gather: bool, generate):
    """sample(prompt_ids, seeds, **options) -> Samples: by the VLLMSampler, the policy's weights pushed first when
    they are stale (needs_push), or with `generate` (common.generation's, as the script imported it) on the
    policy unwrapped for generation (gather: --ds3_gather_for_generation)."""
    def sample(prompts: list, seeds: list, **options) -> Samples:
        if sampler is None:
            with unwrapped_for_generation(accelerator, model, gather) as unwrapped:
                return generate(unwrapped, tokenizer, prompts, seeds=seeds, **options)
        if sampler.needs_push:
            sampler.push_weights(model)
        return sampler.generate(tokenizer, prompts, seeds=seeds, **options)
    return sample


def sampler_options(args: VLLMArgs, accelerator, *, seed: int, dtype: str, use_peft: bool) -> dict:
    """The --vllm_<x> flags as the VLLMSampler's <x> options, checked before anything loads (vLLM installed, the
    options compatible, the server up)."""
    options = dict(seed=seed, dtype=dtype, use_peft=use_peft,
                   **{k.removeprefix("vllm_"): v for k, v in vars(args).items() if k != "use_vllm"})
    VLLMSampler.check(accelerator, **options)
    return options


class VLLMSampler:
    """Samples completions for token-id prompts (a seed per completion) and takes new weights. The options
    are the scripts' --vllm_* flags."""

    @staticmethod
    def check(accelerator, *, use_peft: bool, mode: str, server_host: str, server_port: int, server_timeout: float,
              tensor_parallel_size: int, **_):
        """Fail early, before any model loads: vLLM importable, the options compatible, the server up."""
        try:
            import vllm
        except ImportError:
            raise UserError("--use_vllm needs vLLM: pip install 'minimal-post-training[vllm]' (on CUDA)") from None
        if use_peft and deepspeed_stage(accelerator) == 3:
            raise UserError("--use_vllm with --use_peft under ZeRO-3 is not supported (merging adapters needs whole "
                            "layers); use ZeRO-2 (configs/deepspeed_zero2.yaml): LoRA's optimizer state is small")
        if tensor_parallel_size > 1 and (mode == "server" or accelerator.num_processes % tensor_parallel_size):
            raise UserError(f"--vllm_tensor_parallel_size {tensor_parallel_size} needs colocate mode and a number of "
                            f"processes it divides (got {mode}, {accelerator.num_processes}); a server takes vLLM's "
                            "own --tensor-parallel-size")
        if mode == "server":
            wait_for_server(server_host, server_port, server_timeout)
        return vllm

    def __init__(self, accelerator, model_path: str, max_length: int, *, seed: int, dtype: str, use_peft: bool,
                 mode: str, gpu_memory_utilization: float, enable_sleep_mode: bool, sleep_level: int, server_host: str,
                 server_port: int, server_timeout: float, group_host: str | None, group_port: int,
                 tensor_parallel_size: int, max_num_batched_tokens: int | None):
        self.accelerator, self.mode, self.enable_sleep_mode = accelerator, mode, enable_sleep_mode
        self.sleep_level, self.tp, self.needs_push = sleep_level, tensor_parallel_size, False
        self.push_seconds = math.nan  # of the last push
        self.vllm = vllm = self.check(accelerator, use_peft=use_peft, mode=mode, server_host=server_host,
                                      server_port=server_port, server_timeout=server_timeout,
                                      tensor_parallel_size=tensor_parallel_size)
        config = AutoConfig.from_pretrained(model_path)
        try:  # where HF and vLLM read the model's EOS ids: generation_config.json, else config.json
            self.generation_config = GenerationConfig.from_pretrained(model_path)
        except OSError:
            self.generation_config = config
        if mode == "server":
            self.url, workers = wait_for_server(server_host, server_port, server_timeout)
            from vllm.distributed.weight_transfer import base, clients, nccl_engine

            class Source(base.ModuleSource):  # full (gathered, merged) parameters under their HF names
                def metadata(self):  # shapes without gathering (ds_shape: the full shape under ZeRO-3)
                    return [base.ParamMeta(n, p.dtype, tuple(getattr(p, "ds_shape", p.shape)))
                            for n, p in _hf_parameters(accelerator.unwrap_model(self._module))]

                def __iter__(self):
                    return full_parameters(accelerator, self._module)

            # on every rank (vLLM's contract): trainer rank 0 joins the group and sends, the others only gather
            info = nccl_engine.NCCLTrainerInitInfo(
                rank=accelerator.process_index, master_port=group_port, world_size=1 + workers,
                master_address=group_host or address_towards(server_host, server_port))
            self.transfer = lambda model: nccl_engine.NCCLTrainerWeightTransferEngine.trainer_init(
                info, client=clients.HTTPVLLMWeightSyncClient(self.url), source=Source(model))
            self.sender = None
            return
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: in-place weights
        if self.tp > 1:  # consecutive ranks form one engine (vLLM's external launcher), and sample for the group
            self.group = torch.distributed.new_subgroups_by_enumeration(
                [list(range(r, r + self.tp)) for r in range(0, accelerator.num_processes, self.tp)])[0]
        with _keep_hf_classes(config.model_type):
            self.llm = vllm.LLM(
                model=model_path, gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=self.tp,
                max_model_len=min(max_length, getattr(config, "max_position_embeddings", max_length)),
                seed=seed, enable_sleep_mode=enable_sleep_mode, logprobs_mode="processed_logprobs", dtype=dtype,
                max_num_batched_tokens=max_num_batched_tokens,
                distributed_executor_backend="external_launcher" if accelerator.num_processes > 1 else None)
        if enable_sleep_mode:  # its memory goes back to training until the first rollout
            self.sleep()
        self.weights_asleep = enable_sleep_mode

    def sleep(self):
        """Level 1 keeps the weights in CPU memory and copies them back when woken; level 2 drops them, so
        the next rollout must push them first (`needs_push`), as the policy's are newer anyway."""
        self.llm.sleep(level=self.sleep_level)
        self.weights_asleep, self.needs_push = True, self.sleep_level == 2

    @torch.no_grad()
    def push_weights(self, model) -> float:
        """Load the policy's current weights into the engine; returns the seconds it took."""
        start = time.time()
        if self.mode == "server":
            self.sender = self.sender or self.transfer(model)  # NCCL rendezvous with the server's workers, once
            self.sender.send_weights()  # every rank iterates (gathers); trainer rank 0 alone sends
            self.accelerator.wait_for_everyone()  # no rank samples before the server holds every new weight
        else:
            if self.weights_asleep:  # the weights alone: the KV cache stays released while they load
                self.llm.wake_up(tags=["weights"])
                self.weights_asleep = False
            # vLLM's in-place reload: checkpoint-format weights, re-processed layer by layer into kernel layouts
            self.llm.collective_rpc("reload_weights", kwargs={
                "weights_iterator": full_parameters(self.accelerator, model), "is_checkpoint_format": True})
            self.llm.reset_prefix_cache()  # cached prompt states came from the old weights
        self.needs_push = False  # both modes: until the next version (server mode pushed at every sample() before)
        self.push_seconds = time.time() - start  # logged as vllm/push_seconds
        return self.push_seconds

    def generate(self, tokenizer, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0,
                 seeds: list[int]) -> Samples:
        """As common.generation.generate, with the sampler's logprob of each completion token."""
        stop_ids = stop_token_ids(self.generation_config, tokenizer)  # the same as HF generate's
        params = dict(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k or -1,
                      min_p=min_p, repetition_penalty=repetition_penalty, logprobs=0, stop_token_ids=stop_ids)
        if self.mode == "server":
            self.model_name = getattr(self, "model_name", None) or _get(f"{self.url}/v1/models")["data"][0]["id"]

            def one(prompt, seed):
                body = json.dumps({"model": self.model_name, "prompt": prompt, "seed": seed, "return_token_ids": True,
                                   **params}).encode()
                post = urllib.request.Request(f"{self.url}/v1/completions", body, {"Content-Type": "application/json"})
                with urllib.request.urlopen(post, timeout=600) as r:
                    choice = json.load(r)["choices"][0]
                return choice["token_ids"], choice["logprobs"]["token_logprobs"]
            with ThreadPoolExecutor(32) as pool:
                results = list(pool.map(one, prompts, seeds))
        else:
            if self.needs_push:
                raise RuntimeError("sleep level 2 dropped the engine's weights: push_weights before generate")
            if self.enable_sleep_mode:  # vLLM schedules nothing until every tag is awake
                self.llm.wake_up(tags=None if self.weights_asleep else ["kv_cache"])
            mine, group = slice(0, len(prompts)), [(prompts, seeds, params)]
            if self.tp > 1:  # the group's engine samples every rank's prompts, each with its own seed and its own
                # rank's options (multi-turn: each rank's remaining budget as max_tokens), so that every rank asks
                # the engine the same requests, as vLLM's external launcher needs (else its collectives mismatch)
                group = [None] * self.tp
                torch.distributed.all_gather_object(group, (prompts, seeds, params), group=self.group)
                start = sum(len(p) for p, _, _ in group[:torch.distributed.get_rank(self.group)])
                mine = slice(start, start + len(prompts))
            outputs = self.llm.generate([{"prompt_token_ids": p} for ps, _, _ in group for p in ps],
                                        [self.vllm.SamplingParams(seed=s, **o) for _, ss, o in group for s in ss],
                                        use_tqdm=False)[mine]
            results = [(o.outputs[0].token_ids, [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
                       for o in outputs]
            if self.enable_sleep_mode:
                self.sleep()
        device = self.accelerator.device
        prompt_ids, prompt_mask = pad(prompts, tokenizer.pad_token_id, side="left")
        ids = torch.tensor([list(t) + [tokenizer.pad_token_id] * (max_new_tokens - len(t)) for t, _ in results])
        logps = torch.tensor([list(lp) + [0.0] * (max_new_tokens - len(lp)) for _, lp in results])
        completion_ids, completion_mask, finished = truncate_at_stop(ids, stop_ids, tokenizer.pad_token_id)
        return Samples(*(t.to(device) for t in (prompt_ids, prompt_mask, completion_ids, completion_mask, finished)),
                       sampler_logps=(logps * completion_mask).to(device))
