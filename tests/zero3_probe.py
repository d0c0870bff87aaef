"""Launched by tests/test_deepspeed.py on 2 processes under ZeRO-3 (argv: a model folder, an output folder): counts
the collective calls each rank makes while it generates inside `unwrapped_for_generation`, after the
context's one gather, and checks that the model computes the same logits inside (whole weights, hooks
off) as outside (sharded, hooks on). Writes rank<i>.json per rank."""

import json
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

from common.generation import generate, unwrapped_for_generation
from common.models import load_policy, load_tokenizer
from common.runtime import end_processes

accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 1
tokenizer = load_tokenizer(sys.argv[1])
model = load_policy(sys.argv[1], tokenizer)
model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))

calls = {"count": 0, "on": False}
for name in ("all_gather_into_tensor", "all_gather", "broadcast", "all_reduce", "reduce_scatter_tensor",
             "all_to_all_single", "send", "recv"):
    def counted(*args, _f=getattr(dist, name), **kwargs):
        calls["count"] += calls["on"]
        return _f(*args, **kwargs)
    setattr(dist, name, counted)

ids = torch.tensor([tokenizer.encode("hello world, this is")])
with torch.no_grad():
    sharded = model(input_ids=ids).logits
    with unwrapped_for_generation(accelerator, model) as unwrapped:
        calls["on"] = True
        whole = unwrapped(input_ids=ids).logits
        completion = generate(unwrapped, tokenizer, [ids[0].tolist()] * 2, max_new_tokens=8,
                              temperature=0.0).completion_ids
        calls["on"] = False
    again = model(input_ids=ids).logits  # the hooks are back: a sharded forward still works
with open(f"{sys.argv[2]}/rank{accelerator.process_index}.json", "w") as f:
    json.dump({"collectives_while_generating": calls["count"], "tokens": int(completion.shape[1]),
               "same_logits": bool(torch.allclose(sharded, whole, atol=1e-5)
                                   and torch.allclose(again, whole, atol=1e-5))}, f)
end_processes()  # every rank waits, then leaves without the interpreter's teardown (common/runtime.py)
