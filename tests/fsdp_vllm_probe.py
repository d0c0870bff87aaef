"""Launched by tests/test_common_vllm.py on 2 processes under FSDP2 (argv: a model folder, an output folder,
plain|lora): pushes the sharded policy's weights into the recording stand-ins for vLLM
(tests/stand_in_vllm.py), in colocate and in server mode, and writes, per rank and mode, what its engine
(colocate) or the weight source (server) received and the most pushed tensors alive at once; rank 0 also
writes the policy's weights before they were sharded (with LoRA its base and adapter weights), from which
the test works out what must arrive. With a plain policy also: --vllm_tensor_parallel_size 2, both ranks
sharing one engine, which samples both ranks' prompts (each with its seed); each rank writes what its
engine was asked and the completions it got back; then the same for multi-turn episodes with tools
(tests/stand_in_vllm.py's tp_episodes), every generate call's requests on each rank."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's tests package
from common import vllm as common_vllm
from common.models import adapt, load_policy, load_tokenizer
from common.runtime import end_processes, setup
from tests import stand_in_vllm
from tests.conftest import vllm_options

model_path, out, kind = sys.argv[1:4]
vllm = stand_in_vllm.install(sys.modules.__setitem__)
common_vllm.wait_for_server = lambda host, port, timeout: ("http://server", 1)
common_vllm.address_towards = lambda host, port: "127.0.0.1"
accelerator = setup(seed=1, gradient_accumulation_steps=1, per_device_train_batch_size=1, max_grad_norm=1.0)
tokenizer = load_tokenizer(model_path)
lora = dict(r=4, lora_alpha=16, lora_dropout=0.0, target_modules=None) if kind == "lora" else None
model = adapt(load_policy(model_path, tokenizer, "float32"), lora=lora)
with torch.no_grad():
    for name, param in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero, which would hide the delta
            param.normal_(std=0.1)
if accelerator.is_main_process:
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, f"{out}/unsharded.pt")
model, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
assert any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters()), "not sharded"
for mode in ("colocate", "server"):
    sampler = common_vllm.VLLMSampler(accelerator, model_path, 64, **vllm_options(mode=mode, dtype="float32"))
    sampler.push_weights(model)
    engine = vllm if mode == "server" else vllm.LLM.last
    torch.save({"received": engine.received, "most_alive": engine.most_alive},
               f"{out}/{mode}{accelerator.process_index}.pt")
if kind == "plain":  # the engine answers [the prompt's last token, the seed], so each completion shows its origin
    vllm.LLM.completion_of = lambda self, prompt, seed: [prompt[-1], seed]
    sampler = common_vllm.VLLMSampler(accelerator, model_path, 64,
                                      **vllm_options(dtype="float32", tensor_parallel_size=2))
    rank = accelerator.process_index
    prompts, seeds = [[5, 10 + 10 * rank + i] for i in range(2 + rank)], [100 + 10 * rank + i for i in range(2 + rank)]
    ids = sampler.generate(tokenizer, prompts, 2, seeds=seeds).completion_ids
    engine = vllm.LLM.last
    torch.save({"asked": engine.prompts, "seeds": [q.seed for q in engine.params], "got": ids.tolist(),
                "tensor_parallel_size": engine.kwargs["tensor_parallel_size"]}, f"{out}/tp{rank}.pt")
    # multi-turn episodes (tests/stand_in_vllm.py's TP_EPISODES), whose budgets differ between the ranks from turn 2
    tokenizer = stand_in_vllm.chat_tokenizer(tokenizer)
    sampler = common_vllm.VLLMSampler(accelerator, model_path, 1024,
                                      **vllm_options(dtype="float32", tensor_parallel_size=2))
    sampler.llm.completion_of = stand_in_vllm.scripted(tokenizer, stand_in_vllm.TP_EPISODES[0]
                                                       | stand_in_vllm.TP_EPISODES[1])
    sample = common_vllm.sample_with(accelerator, model, tokenizer, sampler, gather=False, generate=None)
    samples = stand_in_vllm.tp_episodes(sample, tokenizer, rank, accelerator).samples
    torch.save({"requests": sampler.llm.requests, "samples": {k: getattr(samples, k).cpu() for k in (
        "completion_ids", "completion_mask", "model_mask", "finished")}}, f"{out}/tp_episodes{rank}.pt")
end_processes()  # every rank waits, then leaves without the interpreter's teardown (common/runtime.py)
