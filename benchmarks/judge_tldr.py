"""LLM-judged win rate of a TL;DR policy against the human reference summaries.

The evaluation of the TL;DR benchmark (Stiennon et al. 2020, "Learning to summarize from human
feedback"; Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO"): the policy
summarises the first N prompts of a split (greedy by default; vLLM when it is installed and a GPU is
visible, else HF generate), and a judge model behind an OpenAI-compatible chat-completions endpoint
says which of two summaries, the policy's or the dataset's reference (its `completion`), better
captures the post. LLM judges favour one position (Zheng et al. 2023, "Judging LLM-as-a-Judge with
MT-Bench and Chatbot Arena"), so each pair is asked in both orders: a win counts 1 when both orders
prefer the policy, 0.5 when they disagree, 0 when both prefer the reference. Prints the win rate with
the half-width of its 95% interval and writes every prompt, summary and verdict to --output_file.

    export OPENAI_API_KEY=...
    python benchmarks/judge_tldr.py --model_name_or_path output/pythia-1b/ppo --output_file ppo.json
    # a local judge: `vllm serve <model> --port 8000`, then
    OPENAI_API_KEY=EMPTY python benchmarks/judge_tldr.py --model_name_or_path output/pythia-1b/ppo \
        --base_url http://localhost:8000/v1 --judge_model <model>
"""

import importlib.util
import json
import math
import os
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import tyro

from common.data import check_columns, completion_text, encode_prompt, load_split, prompt_text
from common.generation import generate
from common.models import load_policy, load_tokenizer
from common.runtime import UserError, exit_on_user_error

OPENAI_URL = "https://api.openai.com/v1"


@dataclass
class Args:
    # policy and data
    model_name_or_path: str = "output/sft"
    """policy whose summaries are judged: hub name or local directory"""
    dataset_name: str = "trl-lib/tldr"
    """prompt/completion data; the completion is the reference summary (tiny_tldr/tldr: the tiny task)"""
    dataset_split: str = "test"
    """split whose first num_examples prompts are summarised"""
    num_examples: int = 1000
    """prompts to judge, the first ones of the split (0: all)"""

    # generation
    max_new_tokens: int = 53
    """token budget of a summary (53: the TL;DR response length of the N+ paper)"""
    temperature: float = 0.0
    """sampling temperature (0: greedy)"""
    seed: int = 1
    """seed of the sampled summaries when temperature > 0 (one seed per prompt)"""
    generation_backend: Literal["auto", "vllm", "hf"] = "auto"
    """vllm, HF generate, or auto: vLLM when it is installed and a GPU is visible, HF generate otherwise"""
    generation_batch_size: int = 64
    """prompts per HF generate call"""
    torch_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """dtype the policy is loaded in (auto: the checkpoint's)"""
    vllm_gpu_memory_utilization: float = 0.9
    """vLLM: share of the GPU's memory the engine may take"""

    # judge
    judge_model: str = "gpt-4o-mini-2024-07-18"
    """judge model at the endpoint (a dated snapshot, so that win rates stay comparable over time)"""
    base_url: str = OPENAI_URL
    """OpenAI-compatible endpoint (a local vLLM server: http://localhost:8000/v1); the key comes from
    $OPENAI_API_KEY ("EMPTY" is used for other endpoints when it is unset)"""
    num_workers: int = 16
    """requests to the judge in flight at once"""
    max_retries: int = 5
    """retries of a request that fails (no answer, HTTP 429 / 5xx, an answer that is neither A nor B)"""
    request_timeout: float = 60.0
    """seconds to wait for one answer"""

    # output
    output_file: str = "judge_tldr.json"
    """JSON file with the settings, the win rate and every prompt, summary, reference and verdict"""


# Our own wording. {post} is the prompt without its closing "TL;DR:".
JUDGE_TEMPLATE = """Below is a Reddit post followed by two candidate summaries of it.

{post}

Summary A: {a}

Summary B: {b}

Which summary better captures the most important points of the post, without unimportant or \
irrelevant details? Answer with a single letter: "A" or "B"."""

# A pair the endpoint is asked about once before any model loads: a wrong URL, key or model name
# then fails in seconds, not after the summaries are generated.
PROBE = ("SUBREDDIT: r/test\n\nTITLE: Checking the judge\n\nPOST: My cat slept on my keyboard all day, so "
         "I could not work. How do I keep her off it?\n\nTL;DR:",
         "my cat sleeps on my keyboard, how do I stop her?", "I like turtles.")


def judge_prompt(prompt: str, a: str, b: str) -> str:
    post = prompt.strip().removesuffix("TL;DR:").strip()
    return JUDGE_TEMPLATE.format(post=post, a=a.strip(), b=b.strip())


def parse_verdict(answer) -> str | None:
    """"A" or "B" when the answer starts with that letter (after quotes or markdown), else None."""
    match = re.match(r"\W*([AB])\b", answer.strip()) if isinstance(answer, str) else None
    return match.group(1) if match else None


def ask_judge(args: Args, api_key: str, prompt: str) -> str:
    """The judge's pick, "A" or "B", for one prompt; retried with backoff on network errors, HTTP
    429 / 5xx and answers that are neither. A UserError names the endpoint and what went wrong."""
    body = json.dumps({"model": args.judge_model, "messages": [{"role": "user", "content": prompt}],
                       "temperature": 0.0, "max_tokens": 3}).encode()
    request = urllib.request.Request(f"{args.base_url.rstrip('/')}/chat/completions", body,
                                     {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"})
    for attempt in range(max(0, args.max_retries) + 1):
        if attempt:
            time.sleep(min(2 ** (attempt - 1), 30))
        try:
            with urllib.request.urlopen(request, timeout=args.request_timeout) as response:
                answer = json.load(response)["choices"][0]["message"]["content"]
        except urllib.error.HTTPError as e:
            problem = f"HTTP {e.code}: {' '.join(e.read().decode(errors='replace').split())[:200]}"
            if e.code < 500 and e.code not in (408, 409, 429):  # a wrong key, model or URL: retrying will not help
                break
            continue
        except (OSError, ValueError, KeyError, IndexError, TypeError) as e:  # no answer, or not chat-completions JSON
            problem = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no details'}"
            continue
        verdict = parse_verdict(answer)
        if verdict:
            return verdict
        problem = f"answered {str(answer)[:80]!r}, which is neither A nor B"
    raise UserError(f"judge '{args.judge_model}' at {args.base_url}: {problem} (after {attempt + 1} "
                    "tries; check --base_url, --judge_model and $OPENAI_API_KEY)")


def judge_all(args: Args, api_key: str, prompts: list[str]) -> list[str]:
    """Verdicts for all prompts, --num_workers at a time; after one fails for good, the rest are dropped."""
    with ThreadPoolExecutor(args.num_workers) as pool:
        futures = [pool.submit(ask_judge, args, api_key, p) for p in prompts]
        try:
            return [f.result() for f in futures]
        finally:
            for f in futures:
                f.cancel()


def mean_and_ci(wins: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% normal interval over prompts (the statistic of
    benchmarks/tiny_tldr.py's win_rate, whose wins come from the gold judge instead)."""
    mean = sum(wins) / len(wins)
    std = math.sqrt(sum((w - mean) ** 2 for w in wins) / max(1, len(wins) - 1))
    return mean, 1.96 * std / math.sqrt(len(wins))


def generate_hf(args: Args, tokenizer, prompt_ids: list[list[int]]) -> tuple[list[str], list[bool]]:
    model = load_policy(args.model_name_or_path, tokenizer, args.torch_dtype)
    model.to("cuda" if torch.cuda.is_available() else "cpu")
    seeds = [args.seed * 10**9 + i for i in range(len(prompt_ids))]
    samples = generate(model, tokenizer, prompt_ids, args.max_new_tokens, temperature=args.temperature,
                       batch_size=args.generation_batch_size, seeds=seeds)
    return tokenizer.batch_decode(samples.completion_ids, skip_special_tokens=True), samples.finished.tolist()


def generate_vllm(args: Args, tokenizer, prompt_ids: list[list[int]]) -> tuple[list[str], list[bool]]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model_name_or_path, dtype=args.torch_dtype, seed=args.seed,
              gpu_memory_utilization=args.vllm_gpu_memory_utilization)
    params = [SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed * 10**9 + i)
              for i in range(len(prompt_ids))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params)
    ids = [list(o.outputs[0].token_ids) for o in outputs]
    # decoded by our tokenizer, as the HF path does, so both backends post-process alike
    return ([tokenizer.decode(t, skip_special_tokens=True) for t in ids],
            [tokenizer.eos_token_id in t or o.outputs[0].finish_reason == "stop" for t, o in zip(ids, outputs)])


def main(args: Args) -> dict:
    api_key = os.environ.get("OPENAI_API_KEY") or ("" if args.base_url.rstrip("/") == OPENAI_URL else "EMPTY")
    if not api_key:
        raise UserError(f"set OPENAI_API_KEY for {OPENAI_URL} (or --base_url to another OpenAI-compatible endpoint)")
    ask_judge(args, api_key, judge_prompt(*PROBE))

    # ---- summaries of the first num_examples prompts ----
    tokenizer = load_tokenizer(args.model_name_or_path)
    dataset = load_split(args.dataset_name, args.dataset_split)
    check_columns(dataset, {"prompt-completion": ["prompt", "completion"]},
                  f"dataset '{args.dataset_name}' (split {args.dataset_split}), given to judge_tldr.py,")
    n = len(dataset) if args.num_examples <= 0 else min(args.num_examples, len(dataset))
    rows = list(dataset.select(range(n)))
    prompts = [prompt_text(tokenizer, r["prompt"]) for r in rows]
    references = [completion_text(tokenizer, r["prompt"], r["completion"]) for r in rows]
    prompt_ids = [encode_prompt(tokenizer, r["prompt"]) for r in rows]
    backend = args.generation_backend
    if backend == "auto":
        backend = "vllm" if importlib.util.find_spec("vllm") and torch.cuda.is_available() else "hf"
    print(f"summarising {n} prompts of {args.dataset_name} ({args.dataset_split}) with {args.model_name_or_path} "
          f"({backend})")
    summaries, finished = (generate_vllm if backend == "vllm" else generate_hf)(args, tokenizer, prompt_ids)

    # ---- judge every pair twice: the policy's summary as A, then as B ----
    print(f"judging {2 * n} pairs with {args.judge_model} at {args.base_url}")
    verdicts = judge_all(args, api_key, [judge_prompt(p, s, r) for p, s, r in zip(prompts, summaries, references)] +
                         [judge_prompt(p, r, s) for p, s, r in zip(prompts, summaries, references)])
    first, second = verdicts[:n], verdicts[n:]
    wins = [((a == "A") + (b == "B")) / 2 for a, b in zip(first, second)]
    rate, ci = mean_and_ci(wins)

    result = {"win_rate": rate, "win_rate_ci": ci, "num_examples": n,
              "judge_picked_a": sum(v == "A" for v in verdicts) / len(verdicts),  # position bias, for the record
              "finished": sum(finished) / n, "generation_backend": backend, "args": asdict(args),
              "judge_template": JUDGE_TEMPLATE,
              "examples": [{"prompt": p, "summary": s, "reference": r, "finished": f, "verdict_summary_as_a": a,
                            "verdict_summary_as_b": b, "win": w}
                           for p, s, r, f, a, b, w
                           in zip(prompts, summaries, references, finished, first, second, wins)]}
    if os.path.dirname(args.output_file):
        os.makedirs(os.path.dirname(args.output_file), exist_ok=True)
    with open(args.output_file, "w") as f:
        json.dump(result, f, indent=1)
    print(f"win rate vs references: {rate:.1%} ± {ci:.1%} ({n} prompts, both orders, judge {args.judge_model}); "
          f"wrote {args.output_file}")
    return result


if __name__ == "__main__":
    with exit_on_user_error():
        main(tyro.cli(Args))
