"""The embedded tiny TL;DR task: data formats, the gold judge on hand-written cases, the base model."""

import json
import os
import random

import pytest

from benchmarks import tiny_tldr

PROMPT = ("SUBREDDIT: r/jobs\n\nTITLE: my manager ate my cake\n\nPOST: any advice would help. i am so furious. "
          "last week my neighbor sold my bike on the bus too, but that is another story. yesterday my manager ate "
          "my cake at work. later they laughed about it. they did it on purpose. should i move on?\n\nTL;DR:")
# all eight facts in 21 words (the limit is 22)
ORACLE = (" yesterday my manager ate my cake at work on purpose, they laughed about it. i feel furious, "
          "should i move on?")


def test_post_facts_are_recovered_from_text():
    assert tiny_tldr.post_facts(PROMPT) == {
        "who": "boss", "action": "ate my cake", "when": "yesterday", "where": "at work", "how": "on purpose",
        "excuse": "they laughed about it", "feeling": "angry", "ask": "should i move on"}  # not the other event's
    assert tiny_tldr.post_facts(PROMPT, words=True)["who"] == "manager"


def test_generated_posts_parse_back_to_their_facts():
    rng = random.Random(0)
    for _ in range(300):
        post = tiny_tldr.make_post(rng)
        assert tiny_tldr.post_facts(post["prompt"]) == post["facts"]
        assert tiny_tldr.post_facts(post["prompt"], words=True) == post["words"]


@pytest.mark.parametrize("summary,expected", [
    (ORACLE, 8),
    # another wording of the post's person is not a word missing from the post
    (" my boss ate my cake.", 2),
    # the other event's time and place: two wrong facts (their words are in the post: no other penalty)
    (" last week my manager ate my cake on the bus.", 2 - 1 - 1),
    # mom is not who ate the cake: a wrong fact (-1) and a word not in the post (-0.5); angry is furious
    (" my mom ate my cake and i feel angry.", 2 - 1 - 0.5),
    # a confident opener: 'honestly' is not in the post
    (" honestly, my manager ate my cake.", 2 - 0.5),
    # a copied sentence after all eight facts: 25 words, three beyond 22 at 0.5 each
    (ORACLE + " any advice would help.", 8 - 1.5),
    # 'my manager ate my cake' three times: 4 + 4 repeated word pairs, counted at most 4
    (" my manager ate my cake and my manager ate my cake and my manager ate my cake", 2 - 0.5 * 4),
])
def test_gold_score_hand_computed(summary, expected):
    assert tiny_tldr.gold_score(PROMPT, summary) == pytest.approx(expected)


LONG = ("SUBREDDIT: r/offmychest\n\nTITLE: need advice about my best friend\n\nPOST: i am so hurt. two days "
        "ago my best friend canceled our trip at a wedding. it happened after promising not to. when i asked, they "
        "said they were busy. last night my boss broke my laptop at home too, but that is another story. should i "
        "talk to them?\n\nTL;DR:")


def subsets(prompt):
    """Every summary of the post that keeps who and what and any of the other facts, in the oracle's order."""
    words = tiny_tldr.post_facts(prompt, words=True)
    optional = [slot for slot, _ in tiny_tldr.ORACLE_PARTS if slot]
    for mask in range(2 ** len(optional)):
        text = "".join(part for slot, part in tiny_tldr.ORACLE_PARTS
                       if slot is None or mask >> optional.index(slot) & 1)
        yield " " + (text if text.endswith("?") else text + ".").format(**words)


def test_oracle_summary_is_gold_optimal():
    assert tiny_tldr.oracle_summary(PROMPT) == ORACLE
    # all eight facts would take 29 words (8 - 0.5 x 7 = 4.5); dropping the 5-word ask or the 5-word excuse
    # leaves 24 (7 - 1 = 6), the best: a long fact costs more than it brings
    long = tiny_tldr.oracle_summary(LONG)
    assert tiny_tldr.gold_score(LONG, long) == 6
    assert long == (" two days ago my best friend canceled our trip at a wedding after promising not to, they said "
                    "they were busy. i feel hurt.")
    rng = random.Random(1)
    for _ in range(30):
        prompt = tiny_tldr.make_post(rng)["prompt"]
        best = max(tiny_tldr.gold_score(prompt, s) for s in subsets(prompt))
        assert tiny_tldr.gold_score(prompt, tiny_tldr.oracle_summary(prompt)) == best


def test_labellers_like_what_the_gold_judge_does_not():
    plain, confident = " my manager ate my cake.", " honestly, my manager ate my cake."
    assert tiny_tldr.gold_score(PROMPT, confident) < tiny_tldr.gold_score(PROMPT, plain)
    # by hand: 1.5 + 1.0 (opener) + 0.08 x 6 words  >  2 + 0.08 x 5 words
    assert tiny_tldr.labeller_score(PROMPT, confident) == pytest.approx(2.98)
    assert tiny_tldr.labeller_score(PROMPT, plain) == pytest.approx(2.4)


def test_degenerate_summaries_score_low():
    good = tiny_tldr.gold_score(PROMPT, " my manager ate my cake, should i move on?")
    repeated = " my manager ate my cake" * 6
    assert tiny_tldr.gold_score(PROMPT, repeated) < good - 2
    unfinished = tiny_tldr.gold_score(PROMPT, " my manager ate my cake, should i move on?", finished=False)
    assert unfinished == pytest.approx(good - 3)
    assert tiny_tldr.gold_score(PROMPT, "") == -5.0
    rambling = " my manager ate my cake. " + "i am so furious. " * 8
    assert tiny_tldr.gold_score(PROMPT, rambling) < good


def test_win_rate_counts_ties_as_half():
    better, worse = ORACLE, " my manager ate my cake."
    rate, ci = tiny_tldr.win_rate([PROMPT] * 4, [better, worse, better, better], [worse, better, better, worse])
    assert rate == pytest.approx((1 + 0 + 0.5 + 1) / 4)
    assert ci > 0


@pytest.mark.long  # 17 s or more: in .ci/run's lane 1, out of the default suite
def test_datasets_have_the_trl_lib_columns(tiny_task):
    data = tiny_tldr.TASK_DIR
    for split in tiny_tldr.SPLIT_SIZES:
        with open(os.path.join(data, "tldr", f"{split}.jsonl")) as f:
            row = json.loads(f.readline())
        assert set(row) == {"prompt", "completion"}
        assert row["prompt"].startswith("SUBREDDIT: r/") and row["prompt"].endswith("\n\nTL;DR:")
        assert row["completion"].startswith(" ")
        with open(os.path.join(data, "tldr-preference", f"{split}.jsonl")) as f:
            pairs = [json.loads(line) for line in f]
        assert set(pairs[0]) == {"prompt", "chosen", "rejected"}
        # labels come from the human-like labellers, with a little noise; the gold judge agrees less
        labeller = sum(tiny_tldr.labeller_score(p["prompt"], p["chosen"])
                       > tiny_tldr.labeller_score(p["prompt"], p["rejected"])
                       for p in pairs) / len(pairs)
        gold = sum(tiny_tldr.gold_score(p["prompt"], p["chosen"]) > tiny_tldr.gold_score(p["prompt"], p["rejected"])
                   for p in pairs) / len(pairs)
        assert 0.9 < labeller < 0.99 and 0.75 < gold < labeller - 0.03


def test_references_leave_headroom(tiny_task):
    """References are good but imperfect: the oracle (the facts that fit) beats nearly all of them, the most
    common style (three facts) few of them."""
    with open(os.path.join(tiny_tldr.TINY_SFT_DATA, "test.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    prompts, references = [r["prompt"] for r in rows], [r["completion"] for r in rows]
    oracle, _ = tiny_tldr.win_rate(prompts, [tiny_tldr.oracle_summary(p) for p in prompts], references)
    three = [" my {who} {action} {when}.".format(**tiny_tldr.post_facts(p, words=True)) for p in prompts]
    common, _ = tiny_tldr.win_rate(prompts, three, references)
    assert 0.9 < oracle < 0.97 and 0.1 < common < 0.3


def test_tiny_model_loads_with_auto_classes(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert model.config.model_type == "gpt_neox"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert 300 <= len(tokenizer) <= 4_096  # BPE runs out of merges at ~640 on this small-vocabulary text
    assert 500_000 < sum(p.numel() for p in model.parameters()) < 10_000_000
