"""The learner's typed data path: a group is converted once (batch.Group), loss terms add up as a type."""

import dataclasses
import logging
import pickle
import uuid

import pytest
import torch

from learner_service import batch
from learner_service.batch import Group, LayoutCounts, Rollout, rollouts_from_group
from learner_service.loop import LearnerRunner
from learner_service.loss import LossTerms, grpo_loss
from learner_service.metrics import StepTotals
from learner_service.trainer import Learner
from tests.fixtures.learner import TINY_LLAMA, learner_config, make_group

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture
def conversions(monkeypatch):
    """Counts `Group.from_proto` calls (the one proto → typed conversion), by group id."""
    calls: list[str] = []
    real = Group.from_proto.__func__

    def counting(cls, group, *args, **kwargs):
        calls.append(group.group_id)
        return real(cls, group, *args, **kwargs)

    monkeypatch.setattr(batch.Group, "from_proto", classmethod(counting))
    return calls


# ------------------------------------------------------------------ Group
def test_group_from_proto_matches_rollouts_from_group_and_pickles_without_a_proto():
    proto = make_group("g", [0.0, 1.0, 0.5], seed=3, policy_version=2)
    proto.task_id, proto.env = "task-1", "airline"
    g = Group.from_proto(proto, adv_eps=1e-6, max_seq_len=None)
    rs, info = rollouts_from_group(proto)
    assert (g.group_id, g.task_id, g.env, g.policy_version) == ("g", "task-1", "airline", 2)
    assert len(g.rollouts) == 3 and all(isinstance(r, Rollout) for r in g.rollouts)
    assert [r.advantage for r in g.rollouts] == [r.advantage for r in rs]
    assert torch.equal(g.info.adv_G, info.adv_G) and g.info.zero_variance is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.group_id = "other"  # type: ignore[misc]
    # what the broadcast sends: tensors and strings, no protobuf to serialise and parse again
    back = pickle.loads(pickle.dumps(g))
    assert b"TrajectoryGroup" not in pickle.dumps(g)
    assert [torch.equal(a.token_ids_T, b.token_ids_T) for a, b in zip(g.rollouts, back.rollouts)] == [True] * 3


def test_train_step_on_typed_groups_converts_nothing_and_matches_protos(tmp_path, conversions):
    protos = [make_group("a", [0.0, 1.0, 0.5], seed=1), make_group("b", [1.0, 0.0], seed=2)]
    m_proto = Learner(learner_config(tmp_path / "p", TINY_LLAMA), metrics=False).train_step(protos)
    assert conversions == ["a", "b"]  # protos: converted once each, in prepare
    learner = Learner(learner_config(tmp_path / "t", TINY_LLAMA), metrics=False)
    typed = [learner.to_group(p) for p in protos]
    conversions.clear()
    m_typed = learner.train_step(typed)
    assert conversions == []  # typed groups: used as they are
    for k in ("loss", "pg_loss", "kl", "clip_fraction", "ratio_mean", "entropy", "grad_norm", "optimised_tokens"):
        assert m_typed[k] == m_proto[k], k


def test_loop_converts_each_group_once_and_drops_invalid_ones(tmp_path, conversions, caplog):
    from sinkflex.buffer import TrajectoryBuffer, embedded_redis_url

    buf = TrajectoryBuffer(url=embedded_redis_url(), stream=f"test-typed:{uuid.uuid4().hex[:8]}")
    try:
        bad = make_group("bad", [0.0, 1.0], seed=9)
        bad.trajectories[0].loss_mask[0] = 1
        for g in (make_group("r0", [0.0, 1.0, 0.5], seed=40), bad, make_group("r1", [1.0, 0.0], seed=41)):
            buf.put(g)
        cfg = learner_config(tmp_path, TINY_LLAMA, batch={"groups_per_step": 2},
                             buffer={"url": buf.url, "stream": buf.stream, "block_ms": 100})
        learner = Learner(cfg, metrics=False)
        seen: list = []
        real_step = learner.train_step
        learner.train_step = lambda groups, extra=None: (seen.append(groups), real_step(groups, extra))[1]
        runner = LearnerRunner(learner, buf)
        with caplog.at_level(logging.ERROR, logger="learner_service.loop"):
            assert runner.run(max_steps=1) == 1
        assert sorted(conversions) == ["r0", "r1"]  # one conversion per valid group read, none in train_step
        assert len(seen) == 1 and all(isinstance(g, Group) for g in seen[0])
        assert sorted(g.group_id for g in seen[0]) == ["r0", "r1"]
        assert runner.invalid_groups == 1 and runner.dead_lettered == 1
        assert "dead-lettering invalid group bad" in caplog.text and "loss_mask[0] must be 0" in caplog.text
        assert buf.stats().unconsumed == 0 and buf.trained(["r0", "r1", "bad"]) == {"r0", "r1"}
        [dead] = buf.dead_letters()
        assert dead["source_id"] and "loss_mask[0] must be 0" in dead["reason"]
    finally:
        buf.delete()
        buf.close()


# ------------------------------------------------------------------ LossTerms
def _terms(*values, dtype=torch.float32) -> LossTerms:
    return LossTerms(*(torch.tensor(v, dtype=dtype) for v in values))


def test_loss_terms_add_as_a_type():
    a, b = _terms(1.0, 2.0, 3.0, 4.0, 5.0), _terms(0.5, 0.25, 1.0, 2.0, 3.0)
    s = LossTerms.zero() + a + b
    assert s.item() == {"pg_sum": 1.5, "kl_sum": 2.25, "clipped_tokens": 4.0, "ratio_sum": 6.0, "tokens": 8.0}
    assert all(getattr(s, f.name).dtype == torch.float64 for f in dataclasses.fields(LossTerms))
    assert sum([a, b]).item() == (a + b).item()  # sum() starts from 0
    assert (LossTerms.zero() + a).item() == a.item()
    assert LossTerms.from_tensor(s.to_tensor()).item() == s.item()
    with pytest.raises(TypeError):
        a + 1.0


def test_loss_terms_sum_in_float64_like_python_floats():
    """The float64 sum from zero() is the Python-float sum of the values (what the trainer did)."""
    g = torch.Generator().manual_seed(0)
    parts = [_terms(*torch.randn(5, generator=g).tolist()) for _ in range(50)]
    total = LossTerms.zero()
    py = [0.0] * 5
    for p in parts:
        total = total + p
        py = [x + getattr(p, f.name).item() for x, f in zip(py, dataclasses.fields(LossTerms))]
    assert list(total.item().values()) == py


def test_step_totals_all_reduce_packs_and_unpacks_by_name():
    logp = torch.randn(2, 4, dtype=torch.float64)
    _, terms = grpo_loss(logp, logp - 0.1, torch.tensor([1.0, -1.0]), torch.ones(2, 4), num_tokens=8.0)
    sums = StepTotals()
    sums.add_terms(terms, entropy=1.5, positions=8, positions_computed=6)
    sums.add_terms(terms, entropy=0.5, positions=8, positions_computed=6)
    sums.add_layout(LayoutCounts(shared_prefix_rows=1, shared_prefix_fallback_groups=0, shared_prefix_positions=3))
    before = sums.terms.item()
    calls: list[torch.Tensor] = []

    def two_ranks(t: torch.Tensor) -> None:  # an all-reduce over 2 identical ranks
        calls.append(t.clone())
        t.mul_(2)

    sums.all_reduce(two_ranks)
    assert len(calls) == 1 and calls[0].dtype == torch.float64  # one collective
    assert sums.terms.item() == {k: 2 * v for k, v in before.items()}
    assert before["tokens"] == 16.0
    assert (sums.entropy, sums.positions, sums.positions_computed) == (4.0, 32.0, 24.0)
    assert (sums.shared_prefix_rows, sums.shared_prefix_positions) == (2.0, 6.0)
