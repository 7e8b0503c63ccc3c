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


def run_authz(worker, learner_runner, policy_root: Path, outside: Path, pki: Path, buffer=None) -> dict:
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
        b = buffer if buffer is not None else getattr(worker, "_buffer", None)
        buf = b.stats() if b is not None else None
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


# ----------------------------------------------------------------------------- bad input, loaded services


def _garbage(k: int) -> bytes:
    import random

    rng = random.Random(1000 + k)
    return b"\x0f" + bytes(rng.randrange(256) for _ in range(rng.randrange(8, 300)))


def loaded_cases(policy_root: Path, outside: Path) -> list[tuple[str, str, str, object, str]]:
    """(family, service, method, request or raw bytes, expected status) of the loaded-services campaign."""
    from sinkflex.api.common.v1 import common_pb2 as c
    from sinkflex.api.learner.v1 import learner_pb2
    from sinkflex.api.rollout.v1 import rollout_pb2

    R = rollout_pb2.RolloutRequest
    U = rollout_pb2.UpdateWeightsRequest
    ok_task = dict(env="mock", task_ids=["create_task_1"], solo_mode=True)
    IA, PD, NF, RE = "INVALID_ARGUMENT", "PERMISSION_DENIED", "NOT_FOUND", "RESOURCE_EXHAUSTED"
    out: list = []
    add = out.append
    for k in range(3):
        for method in ("Rollout", "UpdateWeights", "Status"):
            add(("garbage bytes", "rollout", method, _garbage(k + 10 * len(method)), IA))
        for method in ("Status", "Checkpoint", "PolicyVersion"):
            add(("garbage bytes", "learner", method, _garbage(k + 100 + len(method)), IA))
    # Rollout on a loaded engine: every bad field, nothing sampled
    for name, req, code in [
        ("empty env", R(task_ids=["create_task_1"], group_size=2), IA),
        ("unknown env", R(env="nope", task_ids=["x"], group_size=2), NF),
        ("a 10 kB env of NULs", R(env="\0" * 10_000, task_ids=["x"], group_size=2), NF),
        ("no task ids", R(env="mock", group_size=2), IA),
        ("an unknown task id", R(env="mock", task_ids=["nope"], group_size=2), NF),
        ("a 100 kB task id", R(env="mock", task_ids=["t" * 100_000], group_size=2), NF),
        ("10000 task ids", R(env="mock", task_ids=[f"t{i}" for i in range(10_000)], group_size=2), IA),
        ("group_size 0", R(**ok_task, group_size=0), IA),
        ("group_size -1", R(**ok_task, group_size=-1), IA),
        ("group_size 1000000", R(**ok_task, group_size=1_000_000), IA),
        ("max_turns -1", R(**ok_task, group_size=2, max_turns=-1), IA),
        ("max_turns 1000000", R(**ok_task, group_size=2, max_turns=1_000_000), IA),
        ("max_context_tokens -5", R(**ok_task, group_size=2, max_context_tokens=-5), IA),
        ("max_context_tokens 2^31-1", R(**ok_task, group_size=2, max_context_tokens=2**31 - 1), IA),
        ("temperature inf", R(**ok_task, group_size=2, sampling=c.SamplingParams(temperature=float("inf"))), IA),
        ("temperature NaN", R(**ok_task, group_size=2, sampling=c.SamplingParams(temperature=float("nan"))), IA),
        ("temperature -1", R(**ok_task, group_size=2, sampling=c.SamplingParams(temperature=-1.0)), IA),
        ("temperature 1e6", R(**ok_task, group_size=2, sampling=c.SamplingParams(temperature=1e6)), IA),
        ("top_p 5", R(**ok_task, group_size=2, sampling=c.SamplingParams(top_p=5.0)), IA),
        ("top_p NaN", R(**ok_task, group_size=2, sampling=c.SamplingParams(top_p=float("nan"))), IA),
        ("max_new_tokens 2^31-1", R(**ok_task, group_size=2, sampling=c.SamplingParams(max_new_tokens=2**31 - 1)), IA),
        ("max_new_tokens -3", R(**ok_task, group_size=2, sampling=c.SamplingParams(max_new_tokens=-3)), IA),
        ("top_k -7", R(**ok_task, group_size=2, sampling=c.SamplingParams(top_k=-7)), IA),
        ("a 2 MiB request (above its 1 MiB limit)", R(env="mock", task_ids=["t" * 2_000_000], group_size=2), RE),
    ]:
        add(("rollout request (engine loaded)", "rollout", "Rollout", req, code))
    have = max([int(p.name[1:]) for p in policy_root.glob("v*") if p.name[1:].isdigit()] or [1])
    for name, req, code in [
        ("version -5", U(policy_version=-5, location=str(policy_root / "v1")), IA),
        ("version 0", U(policy_version=0, location=str(policy_root / "v0")), IA),
        ("a folder outside the policy root", U(policy_version=have + 1, location=str(outside)), PD),
        ("the policy root itself", U(policy_version=have + 1, location=str(policy_root)), PD),
        ("an empty location", U(policy_version=have + 1, location=""), PD),
        ("a location with a NUL byte", U(policy_version=have + 1, location="/tmp/\0x"), IA),
        ("a 60 kB location", U(policy_version=have + 1, location="/" + "d" * 60_000), PD),
        ("a 100 kB location (above its 64 KiB limit)", U(policy_version=have + 1, location="/" + "d" * 100_000), RE),
        ("a version never published", U(policy_version=have + 3, location=str(policy_root / f"v{have + 3}")), IA),
        ("version 2^62 naming a published folder", U(policy_version=2**62, location=str(policy_root / f"v{have}")), PD),
    ]:
        add(("weight update (engine loaded)", "rollout", "UpdateWeights", req, code))
    big = learner_pb2.StatusRequest().SerializeToString() + b"\x1a" + b"\xe0\xd4\x03" + b"x" * 60_000  # unknown field 3
    add(("learner request", "learner", "Status", big, "OK"))
    add(("learner request", "learner", "Checkpoint", b"\x1a\x80\xa0\x06" + b"y" * 102_400, RE))
    add(("learner request", "learner", "PolicyVersion", b"\x08\x01", "OK"))  # an unknown varint field: ignored
    add(("learner request", "learner", "Checkpoint", learner_pb2.CheckpointRequest(), "OK"))  # nothing new: a no-op
    return out


def run_loaded(log, smollm2_dir: Path, work: Path, authz: bool = False) -> dict:
    """Bad input against the rollout service with its vLLM engine loaded (SmolLM2, CPU; the mock
    domain in-process, the embedded Redis buffer) and the learner service (tiny CPU learner,
    running), both on loopback with TLS off as the embedded default runs them. Every answer
    must be clear (the expected status; never UNKNOWN or INTERNAL; a message of at most 1 KiB),
    both services must still answer SERVING, and nothing may change: the engine's policy
    version, the buffer's groups, the learner's checkpoints and step. Returns the figures; with
    `authz`, also `run_authz`'s result on the same engine and learner under "authz_result"."""
    import threading

    import grpc

    from env_service.client import LocalEnvClient
    from env_service.config import EnvServiceConfig
    from learner_service.checkpoint import checkpoint_root
    from learner_service.loop import LearnerRunner
    from learner_service.server import SERVICE_NAME as LEARNER_S
    from learner_service.server import LearnerServicer
    from learner_service.trainer import Learner
    from reward_service.client import LocalRewardClient
    from rollout_service.config import AgentConfig, EngineConfig, RolloutConfig
    from rollout_service.server import build_server
    from rollout_service.worker import RolloutWorker
    from sinkflex.api.learner.v1 import learner_pb2_grpc
    from sinkflex.buffer import TrajectoryBuffer, embedded_redis_url
    from sinkflex.errors import MAX_MESSAGE_BYTES
    from sinkflex.serving import ServiceServer, channel_options, wait_for_serving
    from tests.fixtures.learner import TINY_GPT_OSS, learner_config, one_thread

    t0 = time.monotonic()
    policy_root = work / "learner" / "policy"
    (policy_root / "v1").mkdir(parents=True, exist_ok=True)
    buf = TrajectoryBuffer(url=embedded_redis_url(), stream=f"bad-inputs:{uuid.uuid4().hex[:8]}")
    config = RolloutConfig(engine=EngineConfig(model=str(smollm2_dir), kv_cache_gib=0.5, max_model_len=4096),
                           agent=AgentConfig(max_turns=2, max_new_tokens=16), policy_root=str(policy_root))
    env = LocalEnvClient(EnvServiceConfig(domains=("mock",), user_base_url=None))
    worker = RolloutWorker(config, env=env, reward=LocalRewardClient(), buffer=buf)
    rserver, _ = build_server(config, port=0, worker=worker, grace_seconds=2.0)
    lcfg = learner_config(work / "learner", TINY_GPT_OSS, buffer=dict(url=buf.url, stream=buf.stream, block_ms=100))
    rows = []
    try:
        with one_thread():
            runner = LearnerRunner(Learner(lcfg, metrics=False), buf)
            lserver = ServiceServer(port=0, service_names=[LEARNER_S], grace_seconds=1.0)
            learner_pb2_grpc.add_LearnerServiceServicer_to_server(LearnerServicer(runner, checkpoint_timeout_s=60), lserver.server)
            lserver.start()
            lserver.set_serving()
            loop = threading.Thread(target=runner.run, daemon=True)
            loop.start()
            channels = {"rollout": grpc.insecure_channel(f"127.0.0.1:{rserver.port}", options=channel_options()),
                        "learner": grpc.insecure_channel(f"127.0.0.1:{lserver.port}", options=channel_options())}
            for ch in channels.values():
                wait_for_serving(ch, timeout=30)
            prefix = {"rollout": "/sinkflex.api.rollout.v1.RolloutService/", "learner": "/sinkflex.api.learner.v1.LearnerService/"}
            channels["learner"].unary_unary(prefix["learner"] + "Checkpoint")(b"", timeout=60)  # the baseline checkpoint

            def state() -> dict:
                ck = checkpoint_root(lcfg.run_dir)
                return {"engine_policy_version": worker.engine.policy_version, "buffer_groups_added": buf.stats().added,
                        "checkpoints": sorted(p.name for p in ck.glob("step_*")), "learner_step": runner.learner.state.step}

            before = state()
            for family, service, method, req, expect in loaded_cases(policy_root, Path(smollm2_dir)):
                data = req if isinstance(req, bytes) else req.SerializeToString()
                full = prefix[service] + method
                try:
                    if method == "Rollout":
                        list(channels[service].unary_stream(full)(data, timeout=120))
                    else:
                        channels[service].unary_unary(full)(data, timeout=120)
                    code, message = "OK", ""
                except grpc.RpcError as err:
                    code, message = err.code().name, err.details() or ""
                problems = []
                if code in ("UNKNOWN", "INTERNAL"):
                    problems.append(f"unclear status {code}")
                if code != expect:
                    problems.append(f"expected {expect}, got {code}")
                if code != "OK" and (not message.strip() or len(message.encode()) > MAX_MESSAGE_BYTES):
                    problems.append(f"message of {len(message.encode())} bytes")
                serving = all(_serving(ch) for ch in channels.values()) and not worker.engine.dead()
                if not serving:
                    problems.append("a service stopped answering")
                rows.append({"family": family, "service": service, "rpc": method, "status": code,
                             "message": message[:200], "problems": problems, "crash": not serving})
                if problems:
                    log(f"UNCLEAR {family} {method}: {code} {problems} {message[:200]}")
            after = state()
            authz_result = None
            if authz:
                t1 = time.monotonic()
                authz_result = run_authz(worker, runner, policy_root, Path(smollm2_dir), write_pki(work / "pki"), buffer=buf)
                authz_result["authz_detail"]["seconds"] = round(time.monotonic() - t1, 1)
            runner.request_stop()
            loop.join(60)
            lserver.stop()
            for ch in channels.values():
                ch.close()
    finally:
        rserver.stop()
        worker.close()
        buf.delete()
        buf.close()
    families: dict[str, dict] = {}
    for r in rows:
        f = families.setdefault(r["family"], {"tried": 0, "clear_status": 0, "methods": set(), "codes": {}})
        f["tried"] += 1
        f["clear_status"] += not r["problems"]
        f["methods"].add(f"{r['service']}.{r['rpc']}")
        f["codes"][r["status"]] = f["codes"].get(r["status"], 0) + 1
    for f in families.values():
        f["methods"] = sorted(f["methods"])
    return {"tried": len(rows), "clear_status": sum(not r["problems"] for r in rows),
            "unclear": sum(bool(r["problems"]) for r in rows), "crashes": sum(r["crash"] for r in rows),
            "state_changed": before != after, "state_before": before, "state_after": after, "families": families,
            "unclear_cases": [r for r in rows if r["problems"]], "seconds": round(time.monotonic() - t0, 1),
            "authz_result": authz_result}


def _serving(channel) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        r = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        return r.status == health_pb2.HealthCheckResponse.SERVING
    except Exception:  # noqa: BLE001 - not answering
        return False


# ----------------------------------------------------------------------------- standalone runs and the report


def run_authz_standalone(work: Path) -> dict:
    """`run_authz` on its own stack: the rollout service's worker with its vLLM engine (SmolLM2, CPU,
    the mock domain in-process, the embedded Redis buffer) and a running tiny CPU learner."""
    import threading

    from env_service.client import LocalEnvClient
    from env_service.config import EnvServiceConfig
    from learner_service.loop import LearnerRunner
    from learner_service.trainer import Learner
    from reward_service.client import LocalRewardClient
    from rollout_service.config import AgentConfig, EngineConfig, RolloutConfig
    from rollout_service.worker import RolloutWorker
    from sinkflex.buffer import TrajectoryBuffer, embedded_redis_url
    from sinkflex.models import prepare_model
    from tests.fixtures.learner import TINY_GPT_OSS, learner_config, one_thread

    t0 = time.monotonic()
    smollm2 = Path(prepare_model("smollm2"))
    pki = write_pki(work / "pki")
    root = work / "learner" / "policy"
    (root / "v1").mkdir(parents=True, exist_ok=True)
    buf = TrajectoryBuffer(url=embedded_redis_url(), stream=f"authz:{uuid.uuid4().hex[:8]}")
    config = RolloutConfig(engine=EngineConfig(model=str(smollm2), kv_cache_gib=0.5, max_model_len=4096),
                           agent=AgentConfig(max_turns=2, max_new_tokens=16), policy_root=str(root))
    worker = RolloutWorker(config, env=LocalEnvClient(EnvServiceConfig(domains=("mock",), user_base_url=None)),
                           reward=LocalRewardClient(), buffer=buf)
    cfg = learner_config(work / "learner", TINY_GPT_OSS, buffer=dict(url=buf.url, stream=buf.stream, block_ms=100))
    try:
        with one_thread():
            runner = LearnerRunner(Learner(cfg, metrics=False), buf)
            loop = threading.Thread(target=runner.run, daemon=True)
            loop.start()
            try:
                r = run_authz(worker, runner, root, smollm2, pki)
            finally:
                runner.request_stop()
                loop.join(60)
    finally:
        worker.close()
        buf.delete()
        buf.close()
    r["authz_detail"]["seconds"] = round(time.monotonic() - t0, 1)
    return r


def _store(json_path: Path, updates: dict) -> None:
    import json

    data = json.loads(json_path.read_text()) if json_path.exists() else {}
    data.update(updates)
    json_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_poison(r: dict, md_path: Path, json_path: Path, command: str) -> None:
    """The `poison` section of docs/reliability.md / .json."""
    from benchmarks.reliability_inputs import _replace_sections

    p, d = r["poison"], r["poison_detail"]
    d = {**d, "command": command}
    _store(json_path, {"poison": p, "poison_detail": d})
    rows = "\n".join(f"| `{gid}` | {'yes' if not reason.startswith('NOT') else 'NO'} | {reason.replace('|', '/')} |"
                     for gid, reason in d["reasons"].items())
    md = f"""## Poison entries

Produced by `{command}` at commit {p.get('commit', '?')} ({d['seconds']:.0f} s; the same figures are in
[reliability.json](reliability.json) under `poison`, the reasons under `poison_detail`). The
campaign is `run_poison` in [`benchmarks/reliability_security.py`](../benchmarks/reliability_security.py);
`tests/test_poison.py` runs it too.

| injected | dead-lettered | learner kept training |
| --- | --- | --- |
| {p['injected']} | {p['dead_lettered']} | {'yes' if p['learner_kept_training'] else 'NO'} |

A real learner (the tests' tiny gpt-oss, CPU, one rank, one group per step) reads a real
Redis buffer (the embedded server) holding {d['good_groups']} good groups and {p['injected']}
poison ones, interleaved. It trained {d['learner_steps']} steps, on the {d['good_trained']} good
groups ({d['poison_trained']} poison groups trained; {d['unconsumed_after']} entries left
unacknowledged). Each poison entry and the reason it carries in the dead-letter stream:

| group | dead-lettered | reason |
| --- | --- | --- |
{rows}

How: the learner checks each group as it reads it (`learner_service.batch.validate_group`:
token ids inside the model's vocabulary, token ids / log-probs / loss mask of one length and
at least 2 tokens, mask values 0 or 1 and none on the first token, finite engine log-probs on
loss-mask tokens, no infinite reward — NaN marks an unscored rollout and is allowed); a group
that fails goes to `<stream>:dead` with the error as its reason, acknowledged, never trained,
and counted (`dead_lettered_groups` and `dead_lettered_groups_total` in the step metrics,
`sinkflex_buffer_dead_letters`). A dead-lettered group counts towards its step's
`batch.groups_per_step`: once the buffer has nothing more to deliver, the step trains on the
groups it has instead of waiting for ones that will never come (a synchronous run's driver
publishes exactly one step's groups).
Trajectories longer than `batch.max_seq_len` are cut (counted), and it now defaults to the
model's `max_position_embeddings`. A group that passes and still makes the step raise (here a
fault injected into `Learner.train_step` for `{RAISING}`) rolls the learner back to its latest
checkpoint and its unacknowledged entries are delivered again, each delivery counted by Redis
(XPENDING's delivery count: a restarted learner's XREADGROUP 0 and XAUTOCLAIM raise it too);
one delivered more than `buffer.max_deliveries` ({d['max_deliveries']}) times goes to the
dead-letter stream by the buffer's `read`: the step raised {d['step_raised']} times and was rolled
back {d['rolled_back']} times, then training went on. With several ranks the exception ends the
learner process; restarted, it resumes from its checkpoint and the same delivery count applies. A group read in the same
step as a raising one shares its delivery count: with `groups_per_step` > 1 it can be
dead-lettered with it (its reason says so).
"""
    _replace_sections(md_path, {"Poison entries": md})


def write_authz(r: dict, md_path: Path, json_path: Path, command: str) -> None:
    """The `authz` section of docs/reliability.md / .json."""
    from benchmarks.reliability_inputs import _replace_sections

    a, d = r["authz"], r["authz_detail"]
    d = {**d, "command": command}
    _store(json_path, {"authz": a, "authz_detail": d})
    rows = "\n".join(f"| {c['case']} | {c['identity']} | {c['status']} | {c['message'][:160].replace('|', '/')} |"
                     for c in d["cases"])
    md = f"""## Authorisation

Produced by `{command}` at commit {a.get('commit', '?')} ({d.get('seconds', 0):.0f} s; the same figures are in
[reliability.json](reliability.json) under `authz`, every case under `authz_detail`). The campaign
is `run_authz` in [`benchmarks/reliability_security.py`](../benchmarks/reliability_security.py);
`tests/test_authz.py` runs it too.

| tried | refused (PERMISSION_DENIED or INVALID_ARGUMENT) | nothing changed |
| --- | --- | --- |
| {a['tried']} | {a['refused']} | {'yes' if d['nothing_changed'] else 'NO'} |

The rollout service's servicer around a `RolloutWorker` with its vLLM engine loaded (SmolLM2,
CPU) and the learner service around a running tiny learner, each served on loopback twice: with
mutual TLS and with TLS without client certificates, every certificate from
`scripts/tls_dev_certs.py` (one per service; its common name is the identity). "Nothing
changed": the engine's policy version, the groups in the buffer, the learner's checkpoints
and step and pending checkpoint requests, before `{d['state_before']}` and after
`{d['state_after']}`.

| call | identity | status | message |
| --- | --- | --- | --- |
{rows}
"""
    _replace_sections(md_path, {"Authorisation": md})
