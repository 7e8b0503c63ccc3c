"""Poison entries on a real Redis buffer read by a real (tiny, CPU) learner: every group that
fails validation, and one that makes the step raise each time, ends in the dead-letter stream
with its reason; the good groups are trained once and the learner keeps training
(benchmarks/reliability_security.py, docs/reliability.md `poison`)."""

from __future__ import annotations

import pytest

from benchmarks.reliability_security import RAISING, poison_groups, run_poison
from learner_service.batch import validate_group
from tests.fixtures.learner import make_group

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("gid", sorted(poison_groups()))
def test_validate_group_refuses_each_poison_kind_naming_it(gid):
    with pytest.raises(ValueError, match=gid):
        validate_group(poison_groups()[gid], vocab_size=96)


def test_validate_group_accepts_a_good_group_and_unscored_rewards():
    g = make_group("ok", [0.0, float("nan"), 1.0], seed=3)
    validate_group(g, vocab_size=96)


def test_poison_is_dead_lettered_and_training_goes_on(tmp_path):
    r = run_poison(tmp_path, good=3)
    p, d = r["poison"], r["poison_detail"]
    assert p["injected"] == len(poison_groups()) + 1
    assert p["dead_lettered"] == p["injected"], d["reasons"]
    assert p["learner_kept_training"], d
    assert d["poison_trained"] == 0 and d["unconsumed_after"] == 0
    assert d["step_raised"] == 3 and d["rolled_back"] == 3  # tried max_deliveries times, then dead-lettered
    assert "delivered 4 times" in d["reasons"][RAISING]
    assert "outside the vocabulary" in d["reasons"]["poison-token-outside-vocab"]
