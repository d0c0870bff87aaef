"""Peak memory of one training micro-step's log-probability + loss + entropy path at real shapes.

A policy-gradient micro-step holds the LM head's logits [B, T, V] (bf16 for a real model), takes
the log-probabilities of the sampled tokens at the sampling temperature, backpropagates a loss
through them, and logs the entropy. At a 150k vocabulary and 1k-token completions those steps,
written plainly (`log_softmax(logits.float() / T)` over the whole tensor), hold several fp32 copies
of [B, T, V]. This measures, each in a fresh process on the CPU, the peak resident memory above the
logits themselves (their own size given beside it) for:

    before  the whole-tensor formula these scripts used until 2026-11-25
    ours    common.generation.token_logprobs (row by row, its own backward) + token_entropy_no_grad (chunks)
    trl     TRL 1.16's selective_log_softmax (given the temperature) + entropy_from_logits (of the
            logits divided by it), pip install -e ".[bench]"

and, for gkd.py, the generalised JSD (beta 0.5) of a student's and a teacher's logits [B, T, V] (the teacher's
without gradient) summed over the vocabulary, averaged over the tokens, and backpropagated:

    gkd-plain  the whole-tensor formula in fp32 (gkd.py's per-chunk function applied to all positions at once)
    gkd-ours   gkd.token_divergence: chunks of positions in fp32, recomputed in backward
    gkd-trl    TRL 1.16's GKDTrainer.generalized_jsd_loss (whole tensors, in the logits' dtype)

    python benchmarks/memory.py            # writes benchmarks/results/memory.md
"""

import argparse
import json
import os
import resource
import subprocess
import sys

import torch

SHAPES = [(2, 1024, 151_936), (8, 256, 49_152)]  # Qwen / Llama-3-size vocabulary at 1k tokens; SmolLM2's
TEMPERATURE = 0.7


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def run(impl: str, batch: int, length: int, vocab: int) -> dict:
    """One measurement, in this process (call it in a fresh one)."""
    import transformers  # noqa: F401  (loaded by every side, before the baseline is read)

    from common.generation import token_entropy_no_grad, token_logprobs
    if impl == "trl":
        from trl.trainer.utils import entropy_from_logits, selective_log_softmax
    torch.manual_seed(0)
    logits = torch.randn(batch, length, vocab, dtype=torch.bfloat16).requires_grad_()
    labels = torch.randint(vocab, (batch, length))
    mask = torch.ones(batch, length)
    if impl.startswith("gkd"):
        return run_gkd(impl, logits, mask)
    start = rss_mib()  # the logits are allocated and touched
    if impl == "before":
        logp = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)
        logps = logp.gather(-1, labels[..., None]).squeeze(-1)
        with torch.no_grad():
            entropy = -(logp.exp() * logp).sum(-1)
    elif impl == "ours":
        logps = token_logprobs(logits, labels, TEMPERATURE)
        entropy = token_entropy_no_grad(logits, TEMPERATURE)
    else:
        logps = selective_log_softmax(logits, labels, temperature=TEMPERATURE)
        with torch.no_grad():
            entropy = entropy_from_logits(logits / TEMPERATURE, chunk_size=128)
    loss = -(logps * mask).sum() / mask.sum()
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"impl": impl, "shape": f"{batch} x {length} x {vocab}", "logits_mib": logits.numel() * 2 / 2**20,
            "peak_above_mib": peak - start, "loss": loss.item(), "entropy": entropy.mean().item()}


def run_gkd(impl: str, student: torch.Tensor, mask: torch.Tensor) -> dict:
    """gkd.py's divergence at beta 0.5 (module docstring): peak memory above both logit tensors."""
    from algos import gkd

    teacher = torch.randn_like(student, requires_grad=False) * 2
    start = rss_mib()
    if impl == "gkd-plain":
        loss = gkd._divergence(student.flatten(0, 1), teacher.flatten(0, 1), 0.5).sum() / mask.sum()
    elif impl == "gkd-ours":
        loss = (gkd.token_divergence(student, teacher, 0.5) * mask).sum() / mask.sum()
    else:
        from trl.experimental.gkd.gkd_trainer import GKDTrainer

        # TRL's value is the undivided generalised JSD: beta (1 - beta) = 1/4 of gkd.py's at beta 0.5
        loss = GKDTrainer.generalized_jsd_loss(student, teacher, torch.ones_like(mask, dtype=torch.long), beta=0.5) * 4
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"impl": impl, "shape": f"{student.shape[0]} x {student.shape[1]} x {student.shape[2]}",
            "logits_mib": 2 * student.numel() * 2 / 2**20, "peak_above_mib": peak - start, "loss": loss.item(),
            "entropy": 0.0}


def table(rows: list[dict], impls: list[str], what: str, tolerance: float) -> list[str]:
    """Markdown rows: per shape, each implementation's peak above the logits (and its ratio to them)."""
    lines = [f"| shape (B x T x V, bf16) | {what} MiB | " + " | ".join(f"{i} peak above, MiB" for i in impls) + " |",
             "|---|---|" + "---|" * len(impls)]
    for shape in SHAPES:
        cells = {r["impl"]: r for r in rows if r["shape"] == " x ".join(map(str, shape)) and r["impl"] in impls}
        first = next(iter(cells.values()))
        lines.append(f"| {first['shape']} | {first['logits_mib']:.0f} | "
                     + " | ".join(f"{cells[i]['peak_above_mib']:.0f} "
                                  f"({cells[i]['peak_above_mib'] / first['logits_mib']:.2f}x)" for i in impls) + " |")
    losses = {shape: [r["loss"] for r in rows if r["shape"] == " x ".join(map(str, shape)) and r["impl"] in impls]
              for shape in SHAPES}
    same = all(abs(x / v[0] - 1) < tolerance for v in losses.values() for x in v)
    return lines + [f"\nSame loss across implementations (relative {tolerance:g}): {same}."]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", nargs=4, metavar=("IMPL", "B", "T", "V"), help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "memory.md"))
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run(args.one[0], *map(int, args.one[1:]))))
        return
    try:
        import trl  # noqa: F401
        impls, gkd_impls = ["before", "ours", "trl"], ["gkd-plain", "gkd-ours", "gkd-trl"]
    except ImportError:
        impls, gkd_impls = ["before", "ours"], ["gkd-plain", "gkd-ours"]
        print("trl is not installed (pip install -e '.[bench]'): measuring without it", file=sys.stderr)
    rows = []
    for shape in SHAPES:
        for impl in impls + gkd_impls:
            out = subprocess.run([sys.executable, __file__, "--one", impl, *map(str, shape)], capture_output=True,
                                 text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    lines = table(rows, impls, "logits", 1e-3) + [
        f"Temperature {TEMPERATURE}; peak resident memory of a fresh process above its logits, loss.backward() "
        "included.", "", "gkd.py's divergence (beta 0.5, temperature 1: gkd.py's docstring), student and teacher "
        "logits, the teacher's without gradient:", ""] + table(rows, gkd_impls, "both logits", 1e-2)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
