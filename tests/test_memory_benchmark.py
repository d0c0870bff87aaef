"""benchmarks/memory.py: every implementation it measures computes the same loss and entropy."""

import pytest

from benchmarks import memory


def test_implementations_agree_on_a_small_shape():
    impls = ["before", "ours"] + (["trl"] if _has_trl() else [])
    rows = [memory.run(impl, 2, 40, 3000) for impl in impls]
    for row in rows:
        assert row["loss"] == pytest.approx(rows[0]["loss"], rel=1e-3)  # TRL divides bf16 logits by T in bf16
        assert row["entropy"] == pytest.approx(rows[0]["entropy"], rel=1e-2)
        assert row["logits_mib"] == pytest.approx(2 * 40 * 3000 * 2 / 2**20) and row["peak_above_mib"] >= 0


def _has_trl():
    try:
        import trl  # noqa: F401
        return True
    except ImportError:
        return False
