"""The poison-entry and authorisation campaigns of docs/reliability.md (`poison`, `authz`).

Run through `benchmarks/reliability_inputs.py --sections poison,authz` (which writes the
report); `tests/test_poison.py` and `tests/test_authz.py` run them too.

- `run_poison`: a real learner (the tiny gpt-oss of the tests, CPU, one rank) reads a real
  Redis buffer holding good groups and poison ones: a token id outside the vocabulary,
  token ids / log-probs / loss mask of different lengths, a non-finite log-prob on a
  loss-mask token, an infinite reward, a loss-mask value of 2, and one group that passes
  validation but makes the learner's step raise each time it is tried (a fault injected
  into `Learner.train_step` for that group id). Every poison entry must end in the
  dead-letter stream with its reason, every good group must be trained once, and the
  learner must have kept training (its step count = the good steps).
"""

from __future__ import annotations

import tempfile
import time
import uuid
from pathlib import Path

from sinkflex.api.common.v1 import common_pb2


def _group(group_id: str, seed: int, vocab: int = 96) -> common_pb2.TrajectoryGroup:
    from tests.fixtures.learner import make_group

    return make_group(group_id, [0.0, 1.0, 0.5], seed=seed, vocab=vocab)


def poison_groups(vocab: int = 96) -> dict[str, common_pb2.TrajectoryGroup]:
    """Group id -> a poison TrajectoryGroup, one per kind (the id names the kind)."""
    out: dict[str, common_pb2.TrajectoryGroup] = {}
    g = _group("poison-token-outside-vocab", 71, vocab)
    g.trajectories[1].token_ids[3] = vocab + 5
    out[g.group_id] = g
    g = _group("poison-negative-token", 72, vocab)
    g.trajectories[0].token_ids[2] = -7
    out[g.group_id] = g
    g = _group("poison-length-mismatch", 73, vocab)
    del g.trajectories[2].logprobs[-1]
    out[g.group_id] = g
    g = _group("poison-nan-logprob", 74, vocab)
    tr = g.trajectories[0]
    k = next(i for i, m in enumerate(tr.loss_mask) if m)
    tr.logprobs[k] = float("nan")
    out[g.group_id] = g
    g = _group("poison-inf-reward", 75, vocab)
    g.trajectories[1].reward = float("inf")
    out[g.group_id] = g
    g = _group("poison-mask-value", 76, vocab)
    g.trajectories[0].loss_mask[4] = 2
    out[g.group_id] = g
    g = _group("poison-no-trajectories", 77, vocab)
    del g.trajectories[:]
    out[g.group_id] = g
    return out


#: The group that passes validation and makes every step that holds it raise.
RAISING = "poison-step-raises"


def run_poison(run_dir: Path | None = None, redis_url: str | None = None, good: int = 4) -> dict:
    """The poison campaign (module docstring). Returns the `poison` section and its detail."""
    import torch

    from learner_service.loop import LearnerRunner
    from learner_service.trainer import Learner
    from sinkflex.buffer import TrajectoryBuffer, embedded_redis_url
    from tests.fixtures.learner import TINY_GPT_OSS, learner_config, one_thread

    tmp = None
    if run_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="sinkflex-poison-")
        run_dir = Path(tmp.name)
    t0 = time.monotonic()
    buf = TrajectoryBuffer(url=redis_url or embedded_redis_url(), stream=f"poison:{uuid.uuid4().hex[:8]}",
                           max_deliveries=3)
    try:
        poison = poison_groups()
        poison[RAISING] = _group(RAISING, 78)
        goods = [_group(f"good-{i}", 80 + i) for i in range(good)]
        # a good group first (its step leaves a checkpoint to roll back to), then poison and good
        # interleaved, the last good groups after every poison one (all read before the last step)
        mixed = [x for pair in zip(list(poison.values()), goods[1:-1] + [None] * len(poison)) for x in pair if x]
        order = [goods[0], *mixed, goods[-1]]
        for g in order:
            buf.put(g)
        cfg = learner_config(run_dir, TINY_GPT_OSS, batch=dict(groups_per_step=1), checkpoint_every=1,
                             buffer=dict(url=buf.url, stream=buf.stream, block_ms=200, max_deliveries=3))
        with one_thread():
            torch.manual_seed(0)
            learner = Learner(cfg, metrics=False)
            real_step = learner.train_step
            raised = []

            def train_step(groups, extra=None):
                if any(g.group_id == RAISING for g in groups):
                    raised.append(RAISING)
                    raise RuntimeError(f"fault injected: the step raises on group {RAISING}")
                return real_step(groups, extra)

            learner.train_step = train_step
            runner = LearnerRunner(learner, buf)
            steps = runner.run(max_steps=good)
        dead = buf.dead_letters(count=1000)
        dead_ids = {}
        for d in dead:
            gid = d.get("field:group_id", b"")
            dead_ids[gid.decode() if isinstance(gid, bytes) else gid] = d["reason"]
        stats = buf.stats()
        trained = buf.trained([g.group_id for g in goods] + list(poison))
        result = {
            "poison": {
                "injected": len(poison),
                "dead_lettered": sum(gid in dead_ids for gid in poison),
                "learner_kept_training": steps == good and trained == {g.group_id for g in goods},
            },
            "poison_detail": {
                "reasons": {gid: dead_ids.get(gid, "NOT DEAD-LETTERED")[:300] for gid in poison},
                "good_groups": good, "good_trained": len(trained & {g.group_id for g in goods}),
                "poison_trained": len(trained & set(poison)), "learner_steps": steps,
                "step_raised": len(raised), "rolled_back": runner.step_failures,
                "unconsumed_after": stats.unconsumed, "max_deliveries": buf.max_deliveries,
                "seconds": round(time.monotonic() - t0, 1),
            },
        }
        return result
    finally:
        buf.delete()
        buf.close()
        if tmp is not None:
            tmp.cleanup()
