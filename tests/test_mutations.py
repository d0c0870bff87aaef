"""Every bug listed in tests/mutation_check.py makes its tests fail (python -m pytest -m mutation)."""

import os

import pytest

from tests import mutation_check


@pytest.mark.mutation
def test_every_listed_bug_makes_its_tests_fail():
    results = mutation_check.check()
    missed = [r["bug"] for r in results if not r["caught"]]
    assert not missed, f"bugs no test catches: {missed}\n{mutation_check.table(results)}"


def test_every_listed_bug_names_one_place_in_the_code():
    """Default suite (milliseconds): an edit that moves a listed line fails here, not 40 minutes into CI."""
    for i, (path, text, replacement, _, tests) in enumerate(mutation_check.MUTATIONS, 1):
        with open(os.path.join(mutation_check.ROOT, path)) as f:
            assert f.read().count(text) == 1, f"mutation {i}: {text!r} is not exactly once in {path}"
        assert text != replacement and tests, f"mutation {i}"
