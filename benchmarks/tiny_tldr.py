"""Tiny TL;DR: a synthetic stand-in for the TL;DR summarization benchmark that runs on a laptop CPU.

It provides three things, each a drop-in for its real-scale counterpart:

1. Data in the exact column formats of `trl-lib/tldr` (prompt/completion) and
   `trl-lib/tldr-preference` (prompt/chosen/rejected): Reddit-like posts generated from a seed, with
   human-like reference summaries that are good but imperfect (most leave out one of the key facts).
2. A gold judge standing in for the GPT judge: `gold_score(prompt, summary)` rewards covering the
   post's key facts and penalises wrong facts, words that are not in the post, repetition, rambling
   and not stopping; `win_rate` compares summaries against the references with it.
3. A tiny Pythia-architecture base model (`GPTNeoXForCausalLM`, random init) and a byte-level BPE
   tokenizer trained on the task's text, saved so that the `Auto*` classes load them.

The names "tiny-pythia", "tiny-tldr" and "tiny-tldr-preference" are what the scripts use by
default; `materialize(name)` builds them once into a cache directory ($TINY_TLDR_CACHE, default
~/.cache/tiny_tldr) and returns their local path.
"""

import hashlib
import json
import math
import os
import random
import re
import shutil
import tempfile

TINY_MODEL = "tiny-pythia"
TINY_SFT_DATA = "tiny-tldr"
TINY_PREFERENCE_DATA = "tiny-tldr-preference"
SPLIT_SIZES = {"train": 4000, "validation": 512, "test": 512}
DATA_SEED = 1234

# ---------------------------------------------------------------------------------------------
# The world the posts are written about. Each post has four key facts (who, action, feeling, ask);
# a good TL;DR states all four and nothing false.
# ---------------------------------------------------------------------------------------------
WHO = ["boyfriend", "girlfriend", "roommate", "boss", "mom", "dad", "sister", "brother",
       "coworker", "neighbor", "landlord", "best friend"]
ACTIONS = ["forgot my birthday", "borrowed my car", "read my texts", "canceled our trip",
           "lied about money", "ignored my calls", "broke my laptop", "took my food",
           "yelled at me", "skipped my party", "kept my keys", "sold my bike", "told my secret",
           "missed our dinner", "ate my cake", "used my card"]
FEELINGS = ["angry", "sad", "confused", "hurt", "anxious", "jealous", "guilty", "stressed"]
ASKS = ["should i talk to them", "should i move on", "how do i forgive them", "what should i do",
        "am i overreacting", "how do i say no"]
SUBREDDITS = {"boyfriend": "relationships", "girlfriend": "relationships", "roommate": "roommates",
              "boss": "jobs", "coworker": "jobs", "landlord": "legaladvice", "neighbor": "legaladvice"}
FILLERS = ["this is not the first time it happened.", "we used to get along really well.",
           "my friends say i should relax.", "i do not want to make it worse.",
           "it has been on my mind all day.", "any advice would help.",
           "i brought it up once.", "thanks for reading."]

# Reference summaries: (weight, template). Only the first style states all four facts, so a policy
# that always does so beats most references: there is headroom above them. The most common opening
# ("my ...") leads to three facts, so greedy imitation of the references lands below them.
REFERENCE_TEMPLATES = [
    (0.40, "i feel {feeling} because my {who} {action}, {ask}?"),
    (0.30, "my {who} {action}, i am {feeling}."),
    (0.20, "my {who} {action}, {ask}?"),
    (0.05, "my {who} {action}."),
    (0.05, "{action} and i am {feeling}. {ask}?"),
]
# Words a summary may use without finding them in the post (glue around the facts).
GLUE_WORDS = set("my i and the a feel am so because but after about it them they is".split()) | {",", ".", "?"}


def _slots():
    return {"who": WHO, "action": ACTIONS, "feeling": FEELINGS, "ask": ASKS}


def make_post(rng: random.Random) -> dict:
    """One synthetic post: its four facts and the prompt text in the trl-lib/tldr format."""
    facts = {"who": rng.choice(WHO), "action": rng.choice(ACTIONS), "feeling": rng.choice(FEELINGS),
             "ask": rng.choice(ASKS)}
    sentences = [
        f"last week my {facts['who']} {facts['action']}.",
        rng.choice([f"i feel {facts['feeling']} about it.", f"honestly i am so {facts['feeling']}."]),
    ]
    sentences.insert(rng.randint(0, 2), rng.choice(FILLERS))
    body = " ".join(sentences + [f"{facts['ask']}?"])
    title = rng.choice([f"my {facts['who']} {facts['action']}", f"{facts['ask']}?",
                        f"need advice about my {facts['who']}"])
    subreddit = SUBREDDITS.get(facts["who"], rng.choice(["relationships", "offmychest", "advice"]))
    prompt = f"SUBREDDIT: r/{subreddit}\n\nTITLE: {title}\n\nPOST: {body}\n\nTL;DR:"
    return {"prompt": prompt, "facts": facts}


def _fill(template: str, facts: dict) -> str:
    return " " + template.format(**facts)


def reference_summary(facts: dict, rng: random.Random) -> str:
    """A human-like reference: one of a few styles, and now and then a wrong feeling."""
    template = rng.choices([t for _, t in REFERENCE_TEMPLATES], [w for w, _ in REFERENCE_TEMPLATES])[0]
    facts = dict(facts)
    if rng.random() < 0.1:
        facts["feeling"] = rng.choice(FEELINGS)
    return _fill(template, facts)


def candidate_summary(facts: dict, rng: random.Random) -> str:
    """A summary from a varied 'policy' for preference pairs: a template, then random flaws."""
    facts = dict(facts)
    for slot, values in _slots().items():
        if rng.random() < 0.03:
            facts[slot] = rng.choice(values)  # a wrong fact
    text = _fill(rng.choice([t for _, t in REFERENCE_TEMPLATES]), facts)
    if rng.random() < 0.1:
        text += text  # repetition
    if rng.random() < 0.1:
        text = text.replace(" my ", f" my {rng.choice(['new', 'old', 'weird'])} ", 1)  # not in post
    return text


# ---------------------------------------------------------------------------------------------
# The gold judge.
# ---------------------------------------------------------------------------------------------
def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+|[,.?]", text.lower())


def _has(text: str, phrase: str) -> bool:
    return re.search(rf"(?<![a-z]){re.escape(phrase)}(?![a-z])", text) is not None


def post_facts(prompt: str) -> dict:
    """Recover the key facts from a prompt produced by `make_post` (the judge sees only text)."""
    post = prompt.split("POST:", 1)[-1]
    subject = re.search(r"last week my (.+?) (" + "|".join(map(re.escape, ACTIONS)) + r")\.", post)
    feeling = re.search(r"(?:i feel|i am so) ([a-z]+)", post)
    ask = [a for a in ASKS if _has(post, a)]
    return {"who": subject.group(1) if subject else None, "action": subject.group(2) if subject else None,
            "feeling": feeling.group(1) if feeling else None, "ask": ask[-1] if ask else None}


def gold_score(prompt: str, summary: str, finished: bool = True) -> float:
    """Deterministic quality of `summary` for the post in `prompt`; higher is better.

    +1 per key fact stated; -1 per wrong fact (a person, action, feeling or question of the world
    that is not this post's); -0.5 per word absent from the post; -0.5 per repeated word pair;
    -0.3 per word beyond 20; -3 when the summary never stopped (no EOS). Summaries stating the same
    facts cleanly tie.
    """
    facts = post_facts(prompt)
    text = " ".join(_words(summary))
    words = text.split()
    if not words:
        return -5.0
    score = 0.0
    for slot, values in _slots().items():
        for value in values:
            if _has(text, value):
                score += 1.0 if value == facts[slot] else -1.0
    post_words = set(_words(prompt.split("POST:", 1)[-1])) | set(_words(prompt.split("TITLE:", 1)[-1]))
    score -= 0.5 * min(4, sum(w not in post_words and w not in GLUE_WORDS for w in set(words)))
    bigrams = [b for b in zip(words, words[1:]) if b[0] not in ",.?" and b[1] not in ",.?"]
    score -= 0.5 * min(4, len(bigrams) - len(set(bigrams)))
    n_words = sum(w.isalpha() for w in words)
    score -= 0.3 * max(0, n_words - 20)
    if not finished:
        score -= 3.0
    return score


def gold_reward(prompts, completions, **columns) -> list[float]:
    """The gold judge as a reward function for grpo.py / rloo.py (`--reward_funcs
    benchmarks.tiny_tldr:gold_reward`): an oracle reward, for comparison with a learned one."""
    return [gold_score(p, c) for p, c in zip(prompts, completions)]


def win_rate(prompts, summaries, references, finished=None) -> tuple[float, float]:
    """Share of prompts where the judge prefers the summary to the reference (ties count 0.5),
    with the half-width of its 95% normal interval over prompts."""
    finished = finished if finished is not None else [True] * len(prompts)
    wins = []
    for p, s, r, f in zip(prompts, summaries, references, finished):
        a, b = gold_score(p, s, f), gold_score(p, r)
        wins.append(1.0 if a > b + 1e-9 else 0.5 if abs(a - b) <= 1e-9 else 0.0)
    mean = sum(wins) / len(wins)
    std = math.sqrt(sum((w - mean) ** 2 for w in wins) / max(1, len(wins) - 1))
    return mean, 1.96 * std / math.sqrt(len(wins))


# ---------------------------------------------------------------------------------------------
# Datasets and the tiny base model, built on demand.
# ---------------------------------------------------------------------------------------------
def build_datasets(out_dir: str, seed: int = DATA_SEED) -> None:
    """Write `<out_dir>/tldr/{split}.jsonl` (prompt, completion) and `<out_dir>/tldr-preference/
    {split}.jsonl` (prompt, chosen, rejected). Preference labels come from the gold judge with 5%
    label noise, like human labels; pairs the judge scores within 0.5 of each other are left out
    (the labellers only compared summaries that differ clearly)."""
    for split, n in SPLIT_SIZES.items():
        rng, pair_rng = random.Random(f"{seed}-{split}"), random.Random(f"{seed}-{split}-pairs")
        sft_rows, pref_rows = [], []
        for _ in range(n):
            post = make_post(rng)
            sft_rows.append({"prompt": post["prompt"], "completion": reference_summary(post["facts"], rng)})
            a, b = candidate_summary(post["facts"], pair_rng), candidate_summary(post["facts"], pair_rng)
            sa, sb = gold_score(post["prompt"], a), gold_score(post["prompt"], b)
            if abs(sa - sb) < 0.5:
                continue
            chosen, rejected = (a, b) if (sa > sb) != (pair_rng.random() < 0.05) else (b, a)
            pref_rows.append({"prompt": post["prompt"], "chosen": chosen, "rejected": rejected})
        for name, rows in (("tldr", sft_rows), ("tldr-preference", pref_rows)):
            os.makedirs(os.path.join(out_dir, name), exist_ok=True)
            with open(os.path.join(out_dir, name, f"{split}.jsonl"), "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)


def build_tiny_model(out_dir: str, data_dir: str, vocab_size: int = 1024, seed: int = 0) -> None:
    """A randomly initialised ~1M-parameter GPT-NeoX (Pythia's architecture) and a byte-level BPE
    tokenizer trained on the task's training text, with Pythia's special tokens: EOS/BOS
    `<|endoftext|>` and a distinct pad token `<|padding|>`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, PreTrainedTokenizerFast

    with open(os.path.join(data_dir, "tldr", "train.jsonl")) as f:
        texts = [r["prompt"] + r["completion"] for r in map(json.loads, f)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|padding|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>",
                                        eos_token="<|endoftext|>", unk_token="<|endoftext|>",
                                        pad_token="<|padding|>", model_max_length=512)
    config = GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=4,
                           num_attention_heads=4, intermediate_size=512, max_position_embeddings=512,
                           bos_token_id=0, eos_token_id=0, pad_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = GPTNeoXForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def cache_dir() -> str:
    """$TINY_TLDR_CACHE/<hash of this file>: editing the task or the judge rebuilds everything."""
    with open(__file__, "rb") as f:
        version = hashlib.sha256(f.read()).hexdigest()[:10]
    return os.path.join(os.path.expanduser(os.environ.get("TINY_TLDR_CACHE", "~/.cache/tiny_tldr")), version)


def _build_once(path: str, build) -> None:
    """Build into a temp dir beside `path`, then rename: concurrent processes never see half a build."""
    if os.path.isdir(path):
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(path), prefix=".building-")
    build(tmp)
    try:
        os.rename(tmp, path)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)


def materialize(name: str) -> str | None:
    """Local path for a tiny-task name (built on first use), or None for any other name."""
    if name not in (TINY_MODEL, TINY_SFT_DATA, TINY_PREFERENCE_DATA) or os.path.exists(name):
        return None
    data_dir = os.path.join(cache_dir(), "data")
    _build_once(data_dir, build_datasets)
    if name != TINY_MODEL:
        return os.path.join(data_dir, name.removeprefix("tiny-"))
    model_dir = os.path.join(cache_dir(), TINY_MODEL)
    _build_once(model_dir, lambda p: build_tiny_model(p, data_dir))
    return model_dir


def local(name: str) -> str:
    """The local folder of a tiny-task name (built on first use); any other name or path unchanged.
    The scripts pass their model and dataset names through this before loading, so that the
    defaults work out of the box while common/ knows nothing of the tiny task."""
    return materialize(name) or name


def judge_policy(model, tokenizer, split: str = "test", temperature: float = 0.0,
                 max_new_tokens: int = 48, batch_size: int = 64) -> dict:
    """Summarise every prompt of a split of the tiny task and judge against the references:
    gold win rate (with its 95% interval), mean gold score, completion length, share that stopped."""
    from common.data import encode_prompt
    from common.generation import generate

    with open(os.path.join(materialize(TINY_SFT_DATA), f"{split}.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    prompts = [r["prompt"] for r in rows]
    _, _, ids, mask, finished = generate(model, tokenizer, [encode_prompt(tokenizer, p) for p in prompts],
                                         max_new_tokens, temperature, batch_size=batch_size)
    summaries = tokenizer.batch_decode(ids, skip_special_tokens=True)
    rate, ci = win_rate(prompts, summaries, [r["completion"] for r in rows], finished.tolist())
    scores = [gold_score(p, s, f) for p, s, f in zip(prompts, summaries, finished.tolist())]
    return {"win_rate": rate, "win_rate_ci": ci, "score": sum(scores) / len(scores),
            "mean_length": mask.sum(1).float().mean().item(), "finished": finished.float().mean().item()}
