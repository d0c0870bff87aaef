"""Every bug listed in tests/mutation_check.py makes its tests fail (python -m pytest -m mutation)."""

import pytest

from tests import mutation_check


@pytest.mark.mutation
def test_every_listed_bug_makes_its_tests_fail():
    results = mutation_check.check()
    missed = [r["bug"] for r in results if not r["caught"]]
    assert not missed, f"bugs no test catches: {missed}\n{mutation_check.table(results)}"
