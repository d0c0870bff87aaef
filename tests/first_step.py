"""A script's first optimizer step, run in-process at its default settings, for tests that compare the
gradient it is about to apply with the gradient of its loss written out by hand on the same rows.

`gradients_before_clipping` runs `main(args)` and records, by parameter name, the weights and their
gradients each time the script clips (once per optimizer step, before the clipping, so a term scaled
by a constant still shows), then stops the run. The hand side scores every row alone, unpadded, with a
model built from the recorded weights (`own_logprobs`), and takes gradients with `torch.autograd`;
`assert_gradient` compares the sum of its terms with the script's and checks that each term is large
enough that leaving it out would fail."""

import json
import random

import pytest
import torch
from accelerate import Accelerator

from common.generation import Samples
from common.models import load_policy


class _Recorded(Exception):
    """Raised once the steps asked for are recorded: the rest of the run is not needed."""


def gradients_before_clipping(monkeypatch, main, args, steps: int = 1) -> list[dict]:
    """[{parameter name: (weight, gradient)}] at each of the first `steps` optimizer steps of main(args)."""
    records, clip = [], Accelerator.clip_grad_norm_

    def record(self, parameters, max_norm, norm_type=2):
        parameters = list(parameters)
        (model,) = [m for m in self._models if any(p is parameters[0] for p in m.parameters())]
        names = {id(p): name for name, p in model.named_parameters()}
        records.append({names[id(p)]: (p.detach().cpu().clone(),  # copies: clipping then scales the gradient in place
                                       torch.zeros(p.shape) if p.grad is None else p.grad.detach().cpu().clone())
                        for p in parameters})
        if len(records) == steps:
            raise _Recorded
        return clip(self, parameters, max_norm, norm_type)

    monkeypatch.setattr(Accelerator, "clip_grad_norm_", record)
    with pytest.raises(_Recorded):
        main(args)
    return records


def weights_of(record: dict, prefix: str = "") -> dict:
    return {name[len(prefix):]: w for name, (w, _) in record.items() if name.startswith(prefix)}


def grads_of(record: dict) -> dict:
    return {name: g for name, (_, g) in record.items()}


def policy_with(path: str, tokenizer, weights: dict):
    """The causal LM of `path` with `weights` (the recorded ones), in eval mode (no dropout)."""
    model = load_policy(path, tokenizer)
    model.load_state_dict(weights)
    return model.eval()


def perturbed_reference(monkeypatch, module, scale: float = 0.05) -> list:
    """The script's second load_policy (its reference) gets weights perturbed by a fixed noise, so that
    the reference differs from the policy at the first step and KL terms have gradients. Returns the
    loaded models (the reference is [1])."""
    loaded, load = [], module.load_policy

    def perturb(*a, **k):
        model = load(*a, **k)
        if loaded:
            noise = torch.Generator().manual_seed(len(loaded))
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(scale * torch.randn(p.shape, generator=noise, dtype=p.dtype))
        loaded.append(model)
        return model

    monkeypatch.setattr(module, "load_policy", perturb)
    return loaded


def fixed_samples(monkeypatch, module, vocab_size: int = 727, eos_id: int = 0, pad_id: int = 1) -> list:
    """The script's `generate` replaced by fixed completions for whatever prompts it is given: seeded
    random ordinary tokens, most ending in EOS before max_new_tokens (then padded), the others running
    to it without one. Returns the calls: [(prompts, completions, finished)], completions without padding."""
    calls = []

    def sample(model, tokenizer, prompts, max_new_tokens, *args, **kwargs):
        rng, completions = random.Random(len(calls)), []
        for _ in prompts:
            stops = rng.random() < 0.7  # then 0 to max_new_tokens - 1 tokens and an EOS
            length = rng.randrange(max_new_tokens) if stops else max_new_tokens
            completions.append([rng.randrange(2, vocab_size) for _ in range(length)] + [eos_id] * stops)
        finished = [c[-1] == eos_id for c in completions]
        calls.append((prompts, completions, finished))
        width, device = max(map(len, prompts)), next(model.parameters()).device
        return Samples(*(torch.tensor(t, device=device) for t in (
            [[pad_id] * (width - len(p)) + p for p in prompts],
            [[0] * (width - len(p)) + [1] * len(p) for p in prompts],
            [c + [pad_id] * (max_new_tokens - len(c)) for c in completions],
            [[1] * len(c) + [0] * (max_new_tokens - len(c)) for c in completions], finished)))

    monkeypatch.setattr(module, "generate", sample)
    return calls


PAIRS = [{"prompt": "TITLE: my cat\n\nPOST: she ate my cake again\n\nTL;DR:", "chosen": " cat ate cake",
          "rejected": " cake"},
         {"prompt": "TITLE: a walk\n\nPOST: we went to the park\n\nTL;DR:", "chosen": " park trip with friends",
          "rejected": " we went to the park today and it was fun"},
         {"prompt": "TITLE: job\n\nPOST: my boss shouts\n\nTL;DR:", "chosen": " boss shouts", "rejected": " job"},
         {"prompt": "TITLE: rent\n\nPOST: the rent went up by half\n\nTL;DR:", "chosen": " rent up by half",
          "rejected": " my rent went up"}]


def online_first_step(monkeypatch, module, args, model_path: str, prefix: str = ""):
    """An online script's first step on fixed samples, with a perturbed reference: (its gradient record, the
    tokenizer, the policy at the recorded weights (`prefix`: where they sit in the saved state), the reference,
    and the samples' prompts, completions and finished flags)."""
    from common.models import load_tokenizer

    loaded, calls = perturbed_reference(monkeypatch, module), fixed_samples(monkeypatch, module)
    (record,) = gradients_before_clipping(monkeypatch, module.main, args)
    tokenizer = load_tokenizer(model_path)
    (prompts, completions, finished), = calls
    policy = policy_with(model_path, tokenizer, weights_of(record, prefix))
    return record, tokenizer, policy, loaded[1], prompts, completions, finished


def write_splits(path, rows) -> str:
    """`rows` as the train and validation splits of a data folder (its path)."""
    path.mkdir()
    for split in ("train", "validation"):
        (path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def encode(tokenizer, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """A plain-text row's tokens: the prompt as the tokenizer encodes it, the completion without special
    tokens and then one EOS (docs/usage.md "Tokens": each completion ends in exactly one EOS)."""
    return (tokenizer(prompt).input_ids,
            tokenizer(completion, add_special_tokens=False).input_ids + [tokenizer.eos_token_id])


def own_logprobs(model, prompt: list[int], completion: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log pi(completion token t | row so far) of the row alone, unpadded, one plain forward (with gradients)."""
    ids = torch.tensor([prompt + completion], device=next(model.parameters()).device)  # a reference may be on a GPU
    logits = model(ids).logits[0, len(prompt) - 1:-1].float().cpu() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def gradient(loss, model, prefix: str = "") -> dict:
    """d loss / d weight by parameter name (prefixed; unused weights: zeros)."""
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(loss, list(params.values()), retain_graph=True, allow_unused=True)
    return {prefix + n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(params.items(), grads)}


def flat(grads: dict, names, like: dict) -> torch.Tensor:
    """One vector of the gradients of `names` (a name missing from `grads`: zeros shaped as in `like`)."""
    return torch.cat([grads.get(n, torch.zeros_like(like[n])).flatten().double() for n in names])


def assert_gradient(got: dict, terms: dict[str, dict], rtol: float = 1e-5):
    """got == the sum of the terms (each {name: gradient}; a name missing: 0) within rtol of the largest of
    their norms and the sum's; every term at least 10 x that tolerance, so that one left out fails."""
    names = sorted(got)
    parts = {k: flat(t, names, got) for k, t in terms.items()}
    expected, actual = sum(parts.values()), flat(got, names, got)
    sizes = {k: round(v.norm().item(), 6) for k, v in parts.items()}
    error, tolerance = (actual - expected).norm().item(), rtol * max(expected.norm().item(), *sizes.values())
    assert error <= tolerance, f"|script - hand| = {error:.3g} > {tolerance:.3g}; hand terms' norms {sizes}"
    small = [k for k, v in sizes.items() if v < 10 * tolerance]
    assert not small, f"terms {small} too small to be checked: {sizes}, tolerance {tolerance:.3g}"
