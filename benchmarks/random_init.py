"""A model folder with SmolLM2-135M's architecture and tokenizer and random weights (its shipped weights do not fit
in what a lent GPU machine can be sent): python benchmarks/random_init.py <config folder> <out folder>."""
import os
import shutil
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM

src, dst = sys.argv[1:]
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=torch.float32)
model.save_pretrained(dst)
for name in os.listdir(src):
    if not os.path.exists(os.path.join(dst, name)):
        shutil.copy(os.path.join(src, name), dst)
print("random-init", type(model).__name__, sum(p.numel() for p in model.parameters()), "->", dst)
