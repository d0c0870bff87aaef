"""Shared fixtures: the tiny task built once per session, scripts run as subprocesses, offline."""

import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled",
                  TOKENIZERS_PARALLELISM="false")


def pytest_collection_modifyitems(config, items):
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def tiny_task():
    """The tiny task (data, tokenizer, base model) in <project>/tiny_tldr, where the scripts' defaults
    point; built by `python benchmarks/tiny_tldr.py` (kept while this version of the task is current)."""
    from benchmarks import tiny_tldr

    os.chdir(ROOT)  # the defaults are paths relative to the project root
    return tiny_tldr.build()


@pytest.fixture(scope="session")
def tiny_model(tiny_task):
    from benchmarks import tiny_tldr

    return tiny_tldr.TINY_MODEL


@pytest.fixture()
def one_torch_thread():
    """One torch thread for a test that runs a script in-process on the tiny model: a second thread saves
    nothing at that size, and on a 2-core machine shared with other jobs it mostly waits (the ten first-step
    tests: 7-14 s in all on one thread, 64-146 s on two, on such a machine within the hour; test_vllm.py's
    multi-turn test beside the vLLM engine, its training and HF episodes: 235 s on two, 5 s on one)."""
    threads = torch.get_num_threads()
    torch._C.set_num_threads(1)  # = torch.set_num_threads, which vLLM's CPU worker replaces by a no-op
    yield
    torch._C.set_num_threads(threads)


@pytest.fixture()
def tokenizer(tiny_model):
    from common.models import load_tokenizer

    return load_tokenizer(tiny_model)


def sampling_logprobs(z: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, label=None):
    """log q over the vocabulary at one position, z = logits / temperature [V]: what vLLM 0.32's sampler draws
    from and reports as processed logprobs (v1/sample/sampler.py: min-p, then top-k, then top-p over what
    they keep), written here without HF's warpers: top-p keeps a token while the tokens more probable than it
    hold less than top_p. -inf off the kept tokens; `label` counts as kept."""
    p = z.softmax(-1)
    keep = p >= min_p * p.max()
    if top_k:
        keep &= z >= z.masked_fill(~keep, -math.inf).topk(top_k).values[-1]
    if top_p < 1:
        q = p * keep / (p * keep).sum()
        order = q.argsort(descending=True)
        above = q[order].cumsum(0) - q[order]
        keep[order[above >= top_p]] = False
    if label is not None:
        keep[label] = True
    return z.masked_fill(~keep, -math.inf).log_softmax(-1)


class FixedLogits(torch.nn.Module):
    """A 'model' whose next-token distribution depends only on the current token: row t of `table`
    (so expected logprobs can be worked out by hand)."""

    def __init__(self, table):
        super().__init__()
        self.table = table

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None, logits_to_keep=0):
        return type("Out", (), {"logits": self.table[input_ids][:, -logits_to_keep:]})


def vllm_options(**overrides) -> dict:
    """VLLMSampler's options as the scripts pass them at their defaults, with `overrides`."""
    return {**dict(seed=1, dtype="auto", use_peft=False, mode="colocate", gpu_memory_utilization=0.3,
                   enable_sleep_mode=False, sleep_level=2, server_host="127.0.0.1", server_port=8000,
                   server_timeout=240.0,
                   group_host=None, group_port=51216, tensor_parallel_size=1, max_num_batched_tokens=4096), **overrides}


def script_args(cls, **flags):
    """A script's Args from flags by name, as on its command line: those of its groups (ModelArgs, VLLMArgs, ...,
    which tyro shows without a prefix) go into their group."""
    groups = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory):
            group = f.default_factory
            groups[f.name] = group(**{k: flags.pop(k) for k in list(flags) if k in group.__dataclass_fields__})
    return cls(**flags, **groups)


def run_script(*argv, launcher=None, check=True, timeout=600, env=None):
    """Run `python <argv>` (or `<launcher> <argv>`) from the repo root; returns CompletedProcess."""
    cmd = (launcher or [sys.executable]) + list(argv)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


@pytest.fixture(scope="session")
def sft_model(tmp_path_factory, tiny_model):
    """A tiny SFT model trained for a few steps (shared by tests that need a starting checkpoint)."""
    out = tmp_path_factory.mktemp("sft")
    run_script("algos/sft.py", "--max_steps", "4", "--per_device_train_batch_size", "8",
               "--eval_steps", "4", "--num_sample_generations", "1", "--max_new_tokens", "8",
               "--output_dir", str(out))
    return str(out)


@pytest.fixture(scope="session")
def rm_model(tmp_path_factory, sft_model):
    """A one-label reward model made from the SFT model, its score head untrained (seeded): for tests
    that need a reward model's plumbing, not its judgement. A causal LM is refused as a reward model."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path_factory.mktemp("rm")
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(sft_model, num_labels=1).save_pretrained(out)
    AutoTokenizer.from_pretrained(sft_model).save_pretrained(out)
    return str(out)
