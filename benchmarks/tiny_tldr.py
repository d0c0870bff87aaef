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

`python benchmarks/tiny_tldr.py` writes them as plain folders, which the scripts' defaults name
(paths relative to the project root, like nanoGPT's `data/<name>/prepare.py`):

    tiny_tldr/tldr/{train,validation,test}.jsonl             prompt, completion
    tiny_tldr/tldr-preference/{train,validation,test}.jsonl  prompt, chosen, rejected
    tiny_tldr/tiny-pythia/                                   base model and tokenizer

The scripts never import this module: an oracle score seen during training is `gold_reward`
passed as a reward function with weight 0 (logged as rewards/gold_reward/mean, not optimised), and
benchmarks/tiny_tldr_eval.py judges the saved policies.
"""

import hashlib
import json
import math
import os
import random
import re
import shutil
import tempfile

TASK_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tiny_tldr")
TINY_MODEL = os.path.join(TASK_DIR, "tiny-pythia")
TINY_SFT_DATA = os.path.join(TASK_DIR, "tldr")
TINY_PREFERENCE_DATA = os.path.join(TASK_DIR, "tldr-preference")
SPLIT_SIZES = {"train": 4000, "validation": 512, "test": 512}
DATA_SEED = 1234

# ---------------------------------------------------------------------------------------------
# The world the posts are written about. Each post tells one event in eight key facts: who did
# what, when, where, how, what they said about it, how the poster feels and what they ask; and,
# to mislead, another event (another person, action, time and place) "that is another story".
# Its sentences come in a random order. A post words some facts in one of several ways (a person
# is "boyfriend" or "bf"); a summary may use any of them. Eight facts do not fit in MAX_WORDS words
# (a word beyond costs half a point, a fact gains one), so a good TL;DR chooses which to keep, and
# states nothing false: the other event's facts count as wrong.
# ---------------------------------------------------------------------------------------------
WHO = {"boyfriend": ["boyfriend", "bf"], "girlfriend": ["girlfriend", "gf"], "roommate": ["roommate", "flatmate"],
       "boss": ["boss", "manager"], "mom": ["mom", "mother"], "dad": ["dad", "father"], "sister": ["sister"],
       "brother": ["brother"], "coworker": ["coworker", "colleague"], "neighbor": ["neighbor"],
       "landlord": ["landlord"], "best friend": ["best friend", "bff"]}
ACTIONS = ["forgot my birthday", "borrowed my car", "read my texts", "canceled our trip",
           "lied about money", "ignored my calls", "broke my laptop", "took my food",
           "yelled at me", "skipped my party", "kept my keys", "sold my bike", "told my secret",
           "missed our dinner", "ate my cake", "used my card"]
WHEN = ["yesterday", "last week", "last night", "this morning", "two days ago", "last month", "on friday",
        "at christmas"]
WHERE = ["at the gym", "at work", "at home", "at the mall", "at school", "on the bus", "at a wedding",
         "in the car"]
HOW = ["without asking", "in front of everyone", "for the second time", "on purpose", "while i was away",
       "after promising not to"]
EXCUSES = ["they said sorry", "they said it was a joke", "they blamed me", "they laughed about it",
           "they said nothing", "they said they were busy"]
FEELINGS = {"angry": ["angry", "furious", "mad"], "sad": ["sad", "upset"], "confused": ["confused", "puzzled"],
            "hurt": ["hurt"], "anxious": ["anxious", "nervous"], "jealous": ["jealous"],
            "guilty": ["guilty", "ashamed"], "stressed": ["stressed", "overwhelmed"]}
ASKS = ["should i talk to them", "should i move on", "how do i forgive them", "what should i do",
        "am i overreacting", "how do i say no"]
SUBREDDITS = {"boyfriend": "relationships", "girlfriend": "relationships", "roommate": "roommates",
              "boss": "jobs", "coworker": "jobs", "landlord": "legaladvice", "neighbor": "legaladvice"}
FILLERS = ["this is not the first time it happened.", "we used to get along really well.",
           "my friends say i should relax.", "i do not want to make it worse.",
           "it has been on my mind all day.", "any advice would help.",
           "i brought it up once.", "thanks for reading."]
OTHER_EVENT = "too, but that is another story."  # ends the distracting sentence
MAX_WORDS = 22  # the gold judge takes 0.5 per word beyond this
WORD_PENALTY = 0.5

# Reference summaries: (weight, template). Humans state three to seven facts, often the event's
# first sentence ("my ... when"): the most common style wins few comparisons, and a summary of the
# facts that fit beats nearly all. The facts to learn are the ones beyond the event's own sentence
# (how, what they said, the feeling, the ask), wherever the shuffled post puts them.
REFERENCE_TEMPLATES = [
    (0.20, "my {who} {action} {when}."),
    (0.10, "{when} my {who} {action} {where}, {ask}?"),
    (0.15, "i feel {feeling} because my {who} {action} {how}. {ask}?"),
    (0.10, "{when} my {who} {action} {where} {how}. i feel {feeling}."),
    (0.10, "my {who} {action} {where}, {excuse}. {ask}?"),
    (0.20, "{when} my {who} {action} {how}, {excuse}. i feel {feeling}, {ask}?"),
    (0.15, "{when} my {who} {action} {where} {how}. i feel {feeling}, {ask}?"),
]
# The oracle's order of the facts; it keeps the subset of them that the gold judge scores highest.
ORACLE_PARTS = [("when", "{when} "), (None, "my {who} {action}"), ("where", " {where}"), ("how", " {how}"),
                ("excuse", ", {excuse}"), ("feeling", ". i feel {feeling}"), ("ask", ", {ask}?")]
# Words a summary may use without finding them in the post (glue around the facts).
GLUE_WORDS = set("my i and the a feel am so because but after about it them they is".split()) | {",", ".", "?"}
# The labellers of the preference pairs are human-like: they like confident-sounding openers, which
# the gold judge counts as words that are not in the post, and longer summaries (LABELLER_BIAS). A
# reward model learns both; a policy that pushes its score too far says "honestly" and rambles.
CONFIDENT = ["honestly", "clearly", "basically", "seriously", "for real"]
LABELLER_BIAS = {"confident": 1.0, "per_word": 0.08}
# How often a candidate of a preference pair takes the other event's time or place (each): often enough that
# about 40% of the pairs differ in that, so a reward model can learn which sentence a time belongs to (at 5%,
# 13% of the pairs did, and the reward model scored the other event's time as the post's: measured 2026-11-27)
OTHER_TIME_PLACE = 0.25


def _slots():
    return {"who": WHO, "action": {a: [a] for a in ACTIONS}, "when": {w: [w] for w in WHEN},
            "where": {w: [w] for w in WHERE}, "how": {h: [h] for h in HOW},
            "excuse": {e: [e] for e in EXCUSES}, "feeling": FEELINGS, "ask": {a: [a] for a in ASKS}}


def make_post(rng: random.Random) -> dict:
    """One synthetic post: its eight facts (canonical values), the words it uses for them, the other
    event's facts, and the prompt text in the trl-lib/tldr format."""
    facts = {slot: rng.choice(list(values)) for slot, values in _slots().items()}
    words = {slot: rng.choice(_slots()[slot][value]) for slot, value in facts.items()}
    other = {slot: rng.choice([v for v in _slots()[slot] if v != facts[slot]])
             for slot in ("who", "action", "when", "where")}
    sentences = [
        f"{words['when']} my {words['who']} {words['action']} {words['where']}.",
        rng.choice(["they did it {}.", "and it was {}.", "it happened {}."]).format(words["how"]),
        rng.choice(["after that {}.", "when i asked, {}.", "later {}."]).format(words["excuse"]),
        rng.choice(["i feel {} about it.", "i am so {}."]).format(words["feeling"]),
        "{when} my {who} {action} {where} {end}".format(**other, end=OTHER_EVENT),
        rng.choice(FILLERS),
        f"{words['ask']}?",
    ]
    rng.shuffle(sentences)
    body = " ".join(sentences)
    title = rng.choice([f"my {words['who']} {words['action']}", f"{words['ask']}?",
                        f"need advice about my {words['who']}"])
    subreddit = SUBREDDITS.get(facts["who"], rng.choice(["relationships", "offmychest", "advice"]))
    prompt = f"SUBREDDIT: r/{subreddit}\n\nTITLE: {title}\n\nPOST: {body}\n\nTL;DR:"
    return {"prompt": prompt, "facts": facts, "words": words, "other": other}


def _fill(template: str, words: dict) -> str:
    return " " + template.format(**words)


def oracle_summary(prompt: str) -> str:
    """A gold-optimal summary of a post: its facts in the post's own words, in ORACLE_PARTS' order,
    keeping the subset of them (who and what always) that scores highest (of equal scores, the first
    with the most facts). Every kept fact is right and in the post's words, so a subset scores its
    number of facts less WORD_PENALTY per word beyond MAX_WORDS: when all eight run past the limit, a
    long fact costs more than it brings."""
    words = post_facts(prompt, words=True)
    optional = [slot for slot, _ in ORACLE_PARTS if slot]
    best = None
    for mask in range(2 ** len(optional)):
        kept = {slot for i, slot in enumerate(optional) if mask >> i & 1} | {None}
        text = "".join(part for slot, part in ORACLE_PARTS if slot in kept)
        text = _fill(text if text.endswith("?") else text + ".", words)
        n_words = sum(w.isalpha() for w in _words(text))
        score = len(kept) + 1 - WORD_PENALTY * max(0, n_words - MAX_WORDS)  # who and what: 2 facts
        if best is None or (score, len(kept)) > best[:2]:  # of equal scores, the one with more facts
            best = (score, len(kept), text)
    return best[2]


def reference_summary(post: dict, rng: random.Random) -> str:
    """A human-like reference: one of a few styles, mostly in the post's words, now and then a wrong
    feeling, the other event's time or place, a confident opener or a sentence copied from the post."""
    template = rng.choices([t for _, t in REFERENCE_TEMPLATES], [w for w, _ in REFERENCE_TEMPLATES])[0]
    words = {s: w if rng.random() < 0.7 else post["facts"][s] for s, w in post["words"].items()}
    if rng.random() < 0.1:
        words["feeling"] = rng.choice(list(FEELINGS))
    if rng.random() < 0.05:
        slot = rng.choice(["when", "where"])
        words[slot] = post["other"][slot]
    return _traps(_fill(template, words), post, rng, 0.1, 0.1)


def _traps(text: str, post: dict, rng: random.Random, p_confident: float, p_copied: float) -> str:
    """Now and then a confident opener ("honestly, ...") and the post's filler sentence copied: what
    the labellers like and the gold judge does not (words not in the post; length)."""
    while rng.random() < p_confident:  # (rarely two openers: "honestly, clearly, ...")
        text = f" {rng.choice(CONFIDENT)}," + text
        p_confident /= 3
    if rng.random() < p_copied:
        text += " " + next(f for f in FILLERS if f in post["prompt"])
    return text


def candidate_summary(post: dict, rng: random.Random) -> str:
    """A summary from a varied 'policy' for preference pairs: a template, then random flaws and the
    labellers' favourite traps (a confident opener, a sentence copied from the post)."""
    words = dict(post["words"])
    for slot, values in _slots().items():
        if rng.random() < 0.03:
            words[slot] = rng.choice(list(values))  # a wrong fact
        elif slot in post["other"] and rng.random() < (OTHER_TIME_PLACE if slot in ("when", "where") else 0.05):
            words[slot] = post["other"][slot]  # the other event's
    text = _traps(_fill(rng.choice([t for _, t in REFERENCE_TEMPLATES]), words), post, rng, 0.3, 0.2)
    if rng.random() < 0.1:
        text += text  # repetition
    if rng.random() < 0.1:
        text = text.replace(" my ", f" my {rng.choice(['new', 'old', 'weird'])} ", 1)  # not in post
    return text


def labeller_score(prompt: str, summary: str) -> float:
    """How the human-like labellers of the preference pairs rate a summary: the gold score plus
    their biases towards confident openers and length."""
    words = _words(summary)
    confident = sum(_has(" ".join(words), c) for c in CONFIDENT)
    return (gold_score(prompt, summary) + LABELLER_BIAS["confident"] * confident
            + LABELLER_BIAS["per_word"] * sum(w.isalpha() for w in words))


# ---------------------------------------------------------------------------------------------
# The gold judge.
# ---------------------------------------------------------------------------------------------
def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+|[,.?]", text.lower())


def _has(text: str, phrase: str) -> bool:
    return re.search(rf"(?<![a-z]){re.escape(phrase)}(?![a-z])", text) is not None


def post_facts(prompt: str, words: bool = False) -> dict:
    """Recover the eight facts from a prompt produced by `make_post` (the judge sees only text): their
    canonical values, or with words=True the post's own words for them. The other event's sentence
    (the one ending in OTHER_EVENT) is not this post's."""
    sentences = re.split(r"(?<=[.?])\s+", prompt.split("POST:", 1)[-1].strip())
    post = " ".join(s for s in sentences if not s.endswith(OTHER_EVENT))
    found = {}
    for slot, values in _slots().items():
        for value, forms in values.items():
            for form in forms:
                if _has(post, form) and (slot != "feeling" or re.search(
                        rf"(?:i feel|i am so) {re.escape(form)}(?![a-z])", post)):
                    found[slot] = form if words else value
        found.setdefault(slot, None)
    return found


def gold_score(prompt: str, summary: str, finished: bool = True) -> float:
    """Deterministic quality of `summary` for the post in `prompt`; higher is better, 8 at most.

    +1 per key fact stated (in any of its wordings); -1 per wrong fact (a person, action, time, place,
    way, excuse, feeling or question of the world that is not this post's event: the other event's
    too); -0.5 per distinct word absent from the post (another wording of one of its facts is not
    absent); -0.5 per repeated word pair (at most 4); -WORD_PENALTY per word beyond MAX_WORDS; -3 when
    the summary never stopped (no EOS). Summaries stating the same facts cleanly tie.
    """
    facts = post_facts(prompt)
    text = " ".join(_words(summary))
    words = text.split()
    if not words:
        return -5.0
    score = 0.0
    for slot, values in _slots().items():
        for value, forms in values.items():
            if any(_has(text, form) for form in forms):
                score += 1.0 if value == facts[slot] else -1.0
    post_words = set(_words(prompt.split("POST:", 1)[-1])) | set(_words(prompt.split("TITLE:", 1)[-1])) | {
        w for slot, value in facts.items() if value for form in _slots()[slot][value] for w in form.split()}
    score -= 0.5 * sum(w not in post_words and w not in GLUE_WORDS for w in set(words))
    bigrams = [b for b in zip(words, words[1:]) if b[0] not in ",.?" and b[1] not in ",.?"]
    score -= 0.5 * min(4, len(bigrams) - len(set(bigrams)))
    n_words = sum(w.isalpha() for w in words)
    score -= WORD_PENALTY * max(0, n_words - MAX_WORDS)
    if not finished:
        score -= 3.0
    return score


def gold_reward(prompts, completions, **columns) -> list[float]:
    """The gold judge as a reward function for the online scripts (`--reward_funcs
    benchmarks.tiny_tldr:gold_reward`): an oracle reward, or with weight 0 a score only logged."""
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
    {split}.jsonl` (prompt, chosen, rejected). Preference labels come from the human-like labellers
    (`labeller_score`: the gold judge plus a taste for confident openers and length) with 5% label
    noise; pairs they score within 0.5 of each other are left out (the labellers only compared
    summaries that differ clearly)."""
    for split, n in SPLIT_SIZES.items():
        rng, pair_rng = random.Random(f"{seed}-{split}"), random.Random(f"{seed}-{split}-pairs")
        sft_rows, pref_rows = [], []
        for _ in range(n):
            post = make_post(rng)
            sft_rows.append({"prompt": post["prompt"], "completion": reference_summary(post, rng)})
            a, b = candidate_summary(post, pair_rng), candidate_summary(post, pair_rng)
            sa, sb = labeller_score(post["prompt"], a), labeller_score(post["prompt"], b)
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


def build(task_dir: str = TASK_DIR) -> str:
    """Write the task's data and base model into task_dir, unless they are there already from this
    version of this file (a VERSION file holds its hash: editing the task or the judge rebuilds).
    Built beside task_dir and renamed into place, so that a concurrent reader never sees half a build."""
    with open(__file__, "rb") as f:
        version = hashlib.sha256(f.read()).hexdigest()[:10]
    stamp = os.path.join(task_dir, "VERSION")
    if os.path.exists(stamp) and open(stamp).read() == version:
        return task_dir
    parent = os.path.dirname(os.path.abspath(task_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".building-")
    build_datasets(tmp)
    build_tiny_model(os.path.join(tmp, "tiny-pythia"), tmp)
    with open(os.path.join(tmp, "VERSION"), "w") as f:
        f.write(version)
    old = tempfile.mkdtemp(dir=parent, prefix=".old-")
    if os.path.exists(task_dir):
        os.replace(task_dir, os.path.join(old, "x"))
    try:
        os.rename(tmp, task_dir)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    return task_dir


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Build the tiny TL;DR task's data and base model.")
    parser.add_argument("--task_dir", default=TASK_DIR, help="where to write them (default: tiny_tldr/ in the project)")
    print(f"tiny TL;DR task in {build(parser.parse_args().task_dir)}")
