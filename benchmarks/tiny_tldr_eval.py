"""The tiny TL;DR chain's evaluation, after training: for every policy (SFT, DPO, ..., PPO) its greedy
summaries of the test prompts, judged by the gold judge against the references and scored by the
trained reward model, and a Monte-Carlo estimate of its KL divergence from the SFT model; and the same
for the oracle, the gold-optimal summaries (`tiny_tldr.oracle_summary`). Writes one JSON object
{policy: metrics}; benchmarks/run_tiny_tldr.py runs it as its "evaluate" stage.

    python benchmarks/tiny_tldr_eval.py --run_dir output/tiny_tldr --policies sft dpo ppo
"""

import glob
import json
import os
from dataclasses import dataclass, field

import torch
import tyro
from safetensors.torch import load_file

from benchmarks import tiny_tldr
from common.data import encode_prompt
from common.generation import Samples, generate, shifted_logits, token_logprobs
from common.models import load_policy, load_reward_model, load_tokenizer
from common.rewards import score_with_model


@dataclass
class Args:
    run_dir: str = "output/tiny_tldr"
    """directory holding the chain's models, one per stage: <run_dir>/sft, <run_dir>/reward, <run_dir>/dpo, ..."""
    policies: list[str] = field(default_factory=lambda: ["sft", "dpo", "kto", "grpo", "rloo", "online_dpo", "ppo"])
    """stages whose policy is evaluated"""
    num_prompts: int = 512
    """test prompts (the first ones of the split) summarised greedily, judged and scored by the reward model"""
    kl_prompts: int = 256
    """test prompts (the first ones) sampled once each at temperature 1 for the KL estimate"""
    max_new_tokens: int = 48
    """token budget of every completion (the scripts' default)"""
    batch_size: int = 64
    """prompts per generate call"""
    checkpoints: bool = False
    """also evaluate every checkpoint of each policy's run (<run_dir>/<policy>/checkpoints/step_<n>), into
    metrics["along_training"]: [{"step": n, ...}, ...] by step"""
    out: str | None = None
    """JSON file written (default <run_dir>/eval.json)"""


def sequence_kl(policy, ref, samples: Samples, batch_size: int = 64):
    """Per sequence, sum_t [log pi(y_t | x, y_<t) - log pi_ref(y_t | x, y_<t)] over the completion
    tokens (up to and including EOS). For y sampled from pi at temperature 1, its mean over sequences
    is an unbiased Monte-Carlo estimate of KL(pi || pi_ref) (the k1 estimator, summed over tokens)."""
    prompt_ids, prompt_mask, completion_ids = samples.prompt_ids, samples.prompt_mask, samples.completion_ids
    completion_mask, width = samples.completion_mask, samples.prompt_ids.shape[1]
    kls = []
    for i in range(0, len(prompt_ids), batch_size):
        ids = torch.cat([prompt_ids[i:i + batch_size], completion_ids[i:i + batch_size]], 1)
        mask = torch.cat([prompt_mask[i:i + batch_size], completion_mask[i:i + batch_size]], 1)
        labels = completion_ids[i:i + batch_size]
        with torch.no_grad():
            logps, ref_logps = (token_logprobs(shifted_logits(m, ids, mask, width - 1), labels) for m in (policy, ref))
        kls.append(((logps - ref_logps) * completion_mask[i:i + batch_size]).sum(1))
    return torch.cat(kls)


def evaluate_policy(policy, tokenizer, rows, sft, reward_model, reward_tokenizer, args: Args) -> dict:
    """Gold win rate / score and RM score of the greedy summaries of `rows`, their length, and the KL
    estimate on the first `args.kl_prompts` rows."""
    prompts = [r["prompt"] for r in rows]
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    # 1. greedy summaries: what each script's final gold evaluation judged (deterministic)
    greedy = generate(policy, tokenizer, encoded, args.max_new_tokens, temperature=0.0, batch_size=args.batch_size)
    summaries = tokenizer.batch_decode(greedy.completion_ids, skip_special_tokens=True)
    finished = greedy.finished.tolist()
    rate, ci = tiny_tldr.win_rate(prompts, summaries, [r["completion"] for r in rows], finished)
    gold = [tiny_tldr.gold_score(p, s, f) for p, s, f in zip(prompts, summaries, finished)]
    # 2. the trained reward model's score of the same summaries (as the online scripts score samples)
    rm_scores = score_with_model(reward_model, reward_tokenizer, prompts, summaries)
    # 3. KL to the SFT model: one temperature-1 sample per prompt, seeded by the prompt's index, so
    # every policy (and every training seed) is measured on the same prompts with the same seeds
    n = min(args.kl_prompts, len(rows))
    sampled = generate(policy, tokenizer, encoded[:n], args.max_new_tokens, temperature=1.0, batch_size=args.batch_size,
                       seeds=list(range(n)))
    kl = sequence_kl(policy, sft, sampled, args.batch_size)
    return {"win_rate": rate, "win_rate_ci": ci, "gold_score": sum(gold) / len(gold),
            "rm_score": rm_scores.mean().item(), "kl": kl.mean().item(), "kl_sem": (kl.std() / n ** 0.5).item(),
            "mean_length": greedy.completion_mask.sum(1).float().mean().item(),
            "finished": sum(finished) / len(finished),
            "num_prompts": len(rows), "kl_prompts": n}


def load_checkpoint(path: str, checkpoint: str):
    """The policy saved in <path> with the weights of one of its run's checkpoints (common/checkpoint.py:
    accelerate's save_state of the prepared model; PPO's holds policy.* and value_model.*)."""
    state = load_file(os.path.join(checkpoint, "model.safetensors"))
    if any(k.startswith("policy.") for k in state):
        state = {k.removeprefix("policy."): v for k, v in state.items() if k.startswith("policy.")}
    policy = load_policy(path, load_tokenizer(path))
    policy.load_state_dict(state)  # strict: every weight, no more
    return policy.eval()


def main(args: Args):
    with open(os.path.join(tiny_tldr.build(), "tldr", "test.jsonl")) as f:
        rows = [json.loads(line) for line in f][:args.num_prompts]
    sft_path, reward_path = os.path.join(args.run_dir, "sft"), os.path.join(args.run_dir, "reward")
    sft = load_policy(sft_path, load_tokenizer(sft_path)).eval()
    reward_tokenizer = load_tokenizer(reward_path)
    reward_model = load_reward_model(reward_path, reward_tokenizer).eval()
    # the oracle: gold-optimal summaries (the most a summary of the post can score), every policy's ceiling
    prompts = [r["prompt"] for r in rows]
    oracle = [tiny_tldr.oracle_summary(p) for p in prompts]
    rate, ci = tiny_tldr.win_rate(prompts, oracle, [r["completion"] for r in rows])
    results = {"oracle": {
        "win_rate": rate, "win_rate_ci": ci,
        "gold_score": sum(tiny_tldr.gold_score(p, s) for p, s in zip(prompts, oracle)) / len(rows),
        "rm_score": score_with_model(reward_model, reward_tokenizer, prompts, oracle).mean().item(),
        "mean_length": sum(len(reward_tokenizer(s)["input_ids"]) + 1 for s in oracle) / len(rows)}}  # + EOS
    for name in args.policies:
        path = os.path.join(args.run_dir, name)
        tokenizer = load_tokenizer(path)
        policy = sft if name == "sft" else load_policy(path, tokenizer).eval()
        results[name] = evaluate_policy(policy, tokenizer, rows, sft, reward_model, reward_tokenizer, args)
        print(f"{name}: " + "  ".join(f"{k}={v:.4g}" for k, v in results[name].items()), flush=True)
        if not args.checkpoints:
            continue
        saved, results[name]["along_training"] = glob.glob(os.path.join(path, "checkpoints", "step_*")), []
        for checkpoint in sorted(saved, key=lambda c: int(c.rsplit("_", 1)[1])):
            model, step = load_checkpoint(path, checkpoint), int(checkpoint.rsplit("_", 1)[1])
            same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), policy.state_dict().values()))
            metrics = ({k: v for k, v in results[name].items() if k != "along_training"} if same else
                       evaluate_policy(model, tokenizer, rows, sft, reward_model, reward_tokenizer, args))
            results[name]["along_training"].append({"step": step, "final": same, **metrics})
            print(f"{name} step {step}: " + "  ".join(f"{k}={v:.4g}" for k, v in metrics.items()), flush=True)
    out = args.out or os.path.join(args.run_dir, "eval.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(tyro.cli(Args))
