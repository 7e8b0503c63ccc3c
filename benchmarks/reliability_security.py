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


# ----------------------------------------------------------------------------- authz


def write_pki(folder: Path) -> Path:
    """The dev CA and one certificate per identity (scripts/tls_dev_certs.py) in `folder`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tls_dev_certs", Path(__file__).parents[1] / "scripts" / "tls_dev_certs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.write_certs(folder, mod.NAMES)
    return folder


def _tls(pki: Path, identity: str | None, server: bool = False, client_auth: bool = True):
    from sinkflex.tls import TLSConfig

    if identity is None:
        return TLSConfig(ca_file=str(pki / "ca.crt"))
    return TLSConfig(cert_file=str(pki / f"{identity}.crt"), key_file=str(pki / f"{identity}.key"),
                     ca_file=str(pki / "ca.crt"), require_client_auth=server and client_auth)


def run_authz(worker, learner_runner, policy_root: Path, outside: Path, pki: Path) -> dict:
    """Unauthorised calls of every protected method against a real rollout service (around
    `worker`, a RolloutWorker with its engine) and a real learner service (around
    `learner_runner`), each served twice: with mutual TLS (wrong identities) and with TLS
    but no client certificates (no identity). `policy_root` holds the learner's published
    versions; `outside` is a loadable model folder outside it. Every call must be refused
    with PERMISSION_DENIED or INVALID_ARGUMENT, and nothing change: the engine's policy
    version, the buffer's groups, the learner's checkpoints and step.

    Returns the `authz` section {tried, refused} and its detail (every case, its status).
    """
    import grpc

    from learner_service.checkpoint import checkpoint_root
    from learner_service.server import SERVICE_NAME as LEARNER_S
    from learner_service.server import LearnerServicer
    from rollout_service.config import RolloutLimits
    from rollout_service.server import SERVICE_NAME as ROLLOUT_S
    from rollout_service.server import RolloutServicer
    from sinkflex.api.learner.v1 import learner_pb2, learner_pb2_grpc
    from sinkflex.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
    from sinkflex.serving import ServiceServer, make_channel, wait_for_serving

    servers = {}
    for name, client_auth in (("mtls", True), ("tls", False)):
        tls = _tls(pki, "rollout", server=True, client_auth=client_auth)
        rs = ServiceServer(port=0, service_names=[ROLLOUT_S], tls=tls, grace_seconds=1.0)
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(
            RolloutServicer(worker, RolloutLimits(), str(policy_root), rs.authz), rs.server)
        rs.start()
        rs.set_serving()
        ls = ServiceServer(port=0, service_names=[LEARNER_S], tls=_tls(pki, "learner", server=True, client_auth=client_auth),
                           grace_seconds=1.0)
        learner_pb2_grpc.add_LearnerServiceServicer_to_server(LearnerServicer(learner_runner, checkpoint_timeout_s=30), ls.server)
        ls.start()
        ls.set_serving()
        servers[name] = (rs, ls)

    def state() -> dict:
        ck = checkpoint_root(learner_runner.learner.cfg.run_dir)
        buf = worker.loop.buffer.stats() if getattr(worker.loop, "buffer", None) is not None else None
        return {"engine_policy_version": worker.engine.policy_version,
                "buffer_groups_added": buf.added if buf else None,
                "checkpoints": sorted(p.name for p in ck.glob("step_*")) if ck.is_dir() else [],
                "learner_step": learner_runner.learner.state.step,
                "checkpoint_requests": len(learner_runner._ckpt_waiters)}  # noqa: SLF001

    published = sorted(int(p.name[1:]) for p in policy_root.glob("v*") if p.name[1:].isdigit())
    have = published[-1] if published else 1
    link = policy_root / f"v{have + 5}"
    if not link.exists():
        link.symlink_to(outside, target_is_directory=True)
    uw = rollout_pb2.UpdateWeightsRequest
    rollout_req = rollout_pb2.RolloutRequest(env="mock", task_ids=["create_task_1"], group_size=2, publish=True,
                                             solo_mode=True)
    cases = [
        # (name, server, identity, method, request)
        ("UpdateWeights as reward (wrong identity)", "mtls", "reward", "UpdateWeights", uw(policy_version=have + 1, location=str(policy_root / f"v{have}"))),
        ("UpdateWeights as rollout (wrong identity)", "mtls", "rollout", "UpdateWeights", uw(policy_version=have + 1, location=str(policy_root / f"v{have}"))),
        ("UpdateWeights as env (wrong identity)", "mtls", "env", "UpdateWeights", uw(policy_version=have + 1, location=str(outside))),
        ("UpdateWeights with no client certificate (TLS on)", "tls", None, "UpdateWeights", uw(policy_version=have + 1, location=str(policy_root / f"v{have}"))),
        ("UpdateWeights as driver: a folder outside the policy root", "mtls", "driver", "UpdateWeights", uw(policy_version=have + 1, location=str(outside))),
        ("UpdateWeights as learner: a folder outside the policy root", "mtls", "learner", "UpdateWeights", uw(policy_version=have + 1, location="/tmp")),
        ("UpdateWeights as driver: ../ out of the policy root", "mtls", "driver", "UpdateWeights", uw(policy_version=have + 1, location=str(policy_root / f"v{have}" / ".." / ".." / outside.name))),
        ("UpdateWeights as driver: a symlink in the root pointing outside", "mtls", "driver", "UpdateWeights", uw(policy_version=have + 5, location=str(link))),
        ("UpdateWeights as learner: a version the learner never published", "mtls", "learner", "UpdateWeights", uw(policy_version=have + 7, location=str(policy_root / f"v{have + 7}"))),
        ("UpdateWeights as driver: version 1000000 naming a published folder", "mtls", "driver", "UpdateWeights", uw(policy_version=1_000_000, location=str(policy_root / f"v{have}"))),
        ("UpdateWeights as driver: version 0", "mtls", "driver", "UpdateWeights", uw(policy_version=0, location=str(policy_root / "v0"))),
        ("UpdateWeights as driver: a negative version", "mtls", "driver", "UpdateWeights", uw(policy_version=-3, location=str(policy_root / "v-3"))),
        ("Checkpoint as reward (wrong identity)", "mtls", "reward", "Checkpoint", learner_pb2.CheckpointRequest()),
        ("Checkpoint as rollout (wrong identity)", "mtls", "rollout", "Checkpoint", learner_pb2.CheckpointRequest()),
        ("Checkpoint as env (wrong identity)", "mtls", "env", "Checkpoint", learner_pb2.CheckpointRequest()),
        ("Checkpoint with no client certificate (TLS on)", "tls", None, "Checkpoint", learner_pb2.CheckpointRequest()),
        ("Rollout publish=true as learner (wrong identity)", "mtls", "learner", "Rollout", rollout_req),
        ("Rollout publish=true as rollout (wrong identity)", "mtls", "rollout", "Rollout", rollout_req),
        ("Rollout publish=true as reward (wrong identity)", "mtls", "reward", "Rollout", rollout_req),
        ("Rollout publish=true with no client certificate (TLS on)", "tls", None, "Rollout", rollout_req),
    ]
    before = state()
    rows = []
    try:
        for name, srv, identity, method, req in cases:
            rs, ls = servers[srv]
            port = ls.port if method == "Checkpoint" else rs.port
            with make_channel(f"localhost:{port}", tls=_tls(pki, identity)) as ch:
                wait_for_serving(ch, timeout=10)
                try:
                    if method == "Checkpoint":
                        learner_pb2_grpc.LearnerServiceStub(ch).Checkpoint(req, timeout=20)
                    elif method == "UpdateWeights":
                        rollout_pb2_grpc.RolloutServiceStub(ch).UpdateWeights(req, timeout=20)
                    else:
                        list(rollout_pb2_grpc.RolloutServiceStub(ch).Rollout(req, timeout=20))
                    code, message = "OK", ""
                except grpc.RpcError as err:
                    code, message = err.code().name, err.details() or ""
            rows.append({"case": name, "method": method, "identity": identity or "(none)", "status": code,
                         "message": message[:300],
                         "refused": code in ("PERMISSION_DENIED", "INVALID_ARGUMENT")})
        after = state()
    finally:
        for rs, ls in servers.values():
            rs.stop()
            ls.stop()
        if link.is_symlink():
            link.unlink()
    return {
        "authz": {"tried": len(rows), "refused": sum(r["refused"] for r in rows)},
        "authz_detail": {"cases": rows, "state_before": before, "state_after": after,
                         "nothing_changed": before == after},
    }
