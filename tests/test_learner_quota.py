"""A learner step's quota on a real Redis buffer read by a real (tiny, CPU) learner:
dead-lettered groups count towards `batch.groups_per_step`, so a synchronous run (its driver
publishes exactly one step's groups) trains at once on the rest instead of waiting
`buffer.claim_idle_ms` for groups that will never come; and the entries a waiting step holds are
touched, so the buffer never delivers them to it again (learner_service/loop.py)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from learner_service.loop import LearnerRunner
from learner_service.trainer import Learner
from sinkflex.buffer import TrajectoryBuffer, embedded_redis_url
from tests.fixtures.learner import TINY_LLAMA, learner_config, make_group

pytestmark = [pytest.mark.usefixtures("torch_one_thread"), pytest.mark.timeout(300)]


@pytest.fixture
def buf():
    b = TrajectoryBuffer(url=embedded_redis_url(), stream=f"test-quota:{uuid.uuid4().hex[:8]}", claim_idle_ms=600)
    try:
        yield b
    finally:
        b.delete()
        b.close()


def _runner(tmp_path, buf, groups_per_step):
    cfg = learner_config(tmp_path, TINY_LLAMA, batch={"groups_per_step": groups_per_step},
                         buffer={"url": buf.url, "stream": buf.stream, "block_ms": 100})
    learner = Learner(cfg, metrics=False)
    seen: list[list[str]] = []
    real_step = learner.train_step
    learner.train_step = lambda groups, extra=None: (seen.append([g.group_id for g in groups]),
                                                     real_step(groups, extra))[1]
    steps: list[dict] = []
    return LearnerRunner(learner, buf, on_step=steps.append), seen, steps


def _run_one_step(runner, within_s):
    """runner.run(max_steps=1) in a thread; the seconds it took (a stop is requested past `within_s`)."""
    t0 = time.monotonic()
    th = threading.Thread(target=runner.run, kwargs={"max_steps": 1}, daemon=True)
    th.start()
    th.join(within_s)
    took = time.monotonic() - t0
    if th.is_alive():
        runner.request_stop()
        th.join(60)
    return took


def test_a_step_trains_on_its_groups_left_when_the_others_were_dead_lettered(tmp_path, buf):
    bad = make_group("bad", [0.0, 1.0], seed=9)
    bad.trajectories[0].loss_mask[0] = 1  # refused by validate_group: dead-lettered by the learner
    for g in (make_group("r0", [0.0, 1.0, 0.5], seed=40), bad, make_group("r1", [1.0, 0.0], seed=41)):
        buf.put(g)
    buf.claim_idle_ms = 300_000  # the default: the old loop waited this long, then trained duplicates
    runner, seen, steps = _runner(tmp_path, buf, groups_per_step=3)
    took = _run_one_step(runner, within_s=60)
    assert seen == [["r0", "r1"]], f"step not trained on the 2 valid groups within 60 s ({took:.0f} s): {seen}"
    assert steps[0]["dead_lettered_groups"] == 1.0 and steps[0]["dead_lettered_groups_total"] == 1.0
    assert steps[0]["duplicate_groups"] == 0.0
    assert buf.stats().unconsumed == 0 and buf.trained(["r0", "r1", "bad"]) == {"r0", "r1"}
    [dead] = buf.dead_letters()
    assert "loss_mask[0] must be 0" in dead["reason"]


def test_a_full_step_still_waits_for_its_groups_and_holds_them_past_claim_idle(tmp_path, buf):
    buf.put(make_group("r0", [0.0, 1.0, 0.5], seed=40))
    runner, seen, steps = _runner(tmp_path, buf, groups_per_step=2)
    th = threading.Thread(target=runner.run, kwargs={"max_steps": 1}, daemon=True)
    th.start()
    time.sleep(2.5)  # > 4 x claim_idle_ms (600 ms): r0 would be reclaimed as idle unless touched
    assert seen == []  # one group of two: no step yet (nothing was dead-lettered)
    buf.put(make_group("r1", [1.0, 0.0], seed=41))
    th.join(60)
    assert not th.is_alive()
    assert seen == [["r0", "r1"]]  # r0 trained once, not delivered again while it waited
    assert steps[0]["duplicate_groups"] == 0.0 and steps[0]["dead_lettered_groups"] == 0.0
    assert buf.stats().unconsumed == 0 and buf.trained(["r0", "r1"]) == {"r0", "r1"}
