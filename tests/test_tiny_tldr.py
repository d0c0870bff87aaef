"""The embedded tiny TL;DR task: data formats, the gold judge on hand-written cases, the base model."""

import json
import os
import random

import pytest

from benchmarks import tiny_tldr

PROMPT = ("SUBREDDIT: r/jobs\n\nTITLE: my boss ate my cake\n\nPOST: last week my boss ate my cake. "
          "i feel angry about it. my mom thinks i should just forget it. should i move on?\n\nTL;DR:")


def test_post_facts_are_recovered_from_text():
    assert tiny_tldr.post_facts(PROMPT) == {"who": "boss", "action": "ate my cake", "feeling": "angry",
                                            "ask": "should i move on"}


def test_generated_posts_parse_back_to_their_facts():
    rng = random.Random(0)
    for _ in range(200):
        post = tiny_tldr.make_post(rng)
        assert tiny_tldr.post_facts(post["prompt"]) == post["facts"]


@pytest.mark.parametrize("summary,expected", [
    (" my boss ate my cake. i feel angry, should i move on?", 4),
    (" my boss ate my cake.", 2),
    # mom is in the post but is not who ate the cake: a wrong fact, +2 (action, feeling) - 1
    (" my mom ate my cake and i feel angry.", 2 - 1),
    # 'purple' is in neither the post nor the glue words
    (" my purple boss ate my cake.", 2 - 0.5),
    # 3 facts; 22 words: 2 beyond 20; 8 repeated word pairs ("my boss" twice again, "boss ate"
    # twice again, "ate my", "my cake", "cake and", "and my" once again each), counted at most 4
    (" my boss ate my cake and my boss ate my cake and my boss ate it so i feel angry about it",
     3 - 0.5 * 4 - 0.3 * 2),
])
def test_gold_score_hand_computed(summary, expected):
    assert tiny_tldr.gold_score(PROMPT, summary) == pytest.approx(expected)


def test_degenerate_summaries_score_low():
    good = tiny_tldr.gold_score(PROMPT, " my boss ate my cake, should i move on?")
    repeated = " my boss ate my cake" * 6
    assert tiny_tldr.gold_score(PROMPT, repeated) < good - 2
    assert tiny_tldr.gold_score(PROMPT, " my boss ate my cake, should i move on?", finished=False) == pytest.approx(good - 3)
    assert tiny_tldr.gold_score(PROMPT, "") == -5.0
    rambling = " my boss ate my cake. " + "i feel angry. " * 8
    assert tiny_tldr.gold_score(PROMPT, rambling) < good


def test_win_rate_counts_ties_as_half():
    better, worse = " my boss ate my cake. i feel angry, should i move on?", " my boss ate my cake."
    rate, ci = tiny_tldr.win_rate([PROMPT] * 4, [better, worse, better, better], [worse, better, better, worse])
    assert rate == pytest.approx((1 + 0 + 0.5 + 1) / 4)
    assert ci > 0


def test_datasets_have_the_trl_lib_columns(tiny_cache):
    data = os.path.dirname(tiny_tldr.materialize(tiny_tldr.TINY_SFT_DATA))
    for split in tiny_tldr.SPLIT_SIZES:
        with open(os.path.join(data, "tldr", f"{split}.jsonl")) as f:
            row = json.loads(f.readline())
        assert set(row) == {"prompt", "completion"}
        assert row["prompt"].startswith("SUBREDDIT: r/") and row["prompt"].endswith("\n\nTL;DR:")
        assert row["completion"].startswith(" ")
        with open(os.path.join(data, "tldr-preference", f"{split}.jsonl")) as f:
            pairs = [json.loads(line) for line in f]
        assert set(pairs[0]) == {"prompt", "chosen", "rejected"}
        # labels come from the judge, with a little noise
        agree = sum(tiny_tldr.gold_score(p["prompt"], p["chosen"]) > tiny_tldr.gold_score(p["prompt"], p["rejected"])
                    for p in pairs) / len(pairs)
        assert 0.9 < agree < 0.99


def test_references_leave_headroom(tiny_cache):
    """References are good but imperfect: a summary stating all four facts beats most of them."""
    with open(os.path.join(tiny_tldr.materialize(tiny_tldr.TINY_SFT_DATA), "test.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    facts = [tiny_tldr.post_facts(r["prompt"]) for r in rows]
    ideal = [" my {who} {action}. i feel {feeling}, {ask}?".format(**f) for f in facts]
    rate, _ = tiny_tldr.win_rate([r["prompt"] for r in rows], ideal, [r["completion"] for r in rows])
    assert 0.6 < rate < 0.95


def test_tiny_model_loads_with_auto_classes(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert model.config.model_type == "gpt_neox"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert 300 <= len(tokenizer) <= 4_096  # BPE runs out of merges at ~640 on this small-vocabulary text
    assert 500_000 < sum(p.numel() for p in model.parameters()) < 10_000_000
