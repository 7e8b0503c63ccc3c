"""Least privilege over real loopback gRPC with per-service certificates (scripts/tls_dev_certs.py):
the allow-lists of `sinkflex.authz` on the rollout service (around the session's vLLM engine) and
the learner service (tiny CPU learner), UpdateWeights' policy-root and published-version checks
(`rollout_service.engine.check_policy_location`), and plaintext on loopback working as before."""

from __future__ import annotations

import uuid
from pathlib import Path

import grpc
import pytest

from benchmarks.reliability_security import run_authz, write_pki
from rollout_service.engine import check_policy_location
from sinkflex.authz import DEFAULT_RULES, PUBLISH, UPDATE_WEIGHTS, Policy
from sinkflex.errors import ServiceError

pytestmark = pytest.mark.timeout(600)


class _Ctx:
    def __init__(self, cn: bytes | None):
        self.cn = cn

    def auth_context(self):
        return {"x509_common_name": [self.cn]} if self.cn else {}


def test_policy_allows_listed_identities_only_and_nothing_is_checked_without_tls():
    p = Policy(enforce=True)
    assert p.denial(_Ctx(b"learner"), UPDATE_WEIGHTS) is None and p.denial(_Ctx(b"driver"), UPDATE_WEIGHTS) is None
    why = p.denial(_Ctx(b"reward"), UPDATE_WEIGHTS)
    assert "driver, learner only" in why and "'reward'" in why
    assert "no client certificate" in p.denial(_Ctx(None), PUBLISH)
    assert p.denial(_Ctx(b"learner"), PUBLISH) is not None and p.denial(_Ctx(b"driver"), PUBLISH) is None
    with pytest.raises(ServiceError) as err:
        p.check(_Ctx(b"env"), UPDATE_WEIGHTS)
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert all(Policy(enforce=False).denial(_Ctx(None), a) is None for a in DEFAULT_RULES)


def _published(root: Path, v: int) -> Path:
    d = root / f"v{v}"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"x")
    return d


def test_check_policy_location(tmp_path):
    root = tmp_path / "policy"
    v2 = _published(root, 2)
    assert check_policy_location(2, str(v2), root) == v2.resolve()
    assert check_policy_location(2, str(root / "v1" / ".." / "v2"), root) == v2.resolve()
    outside = _published(tmp_path / "elsewhere", 3)
    for version, location in [(3, outside), (3, root / "v2"), (2, root), (3, root / "v2" / ".." / ".." / "elsewhere" / "v3")]:
        with pytest.raises(ServiceError) as err:
            check_policy_location(version, str(location), root)
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED, (version, location)
    (root / "v3").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ServiceError) as err:
        check_policy_location(3, str(root / "v3"), root)
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED and "outside the policy root" in err.value.message
    for version in (4, 0, -1):
        with pytest.raises(ServiceError) as err:
            check_policy_location(version, str(root / f"v{version}"), root)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    (root / "v5").mkdir()  # a folder without weights is not a published version
    with pytest.raises(ServiceError, match="was not published"):
        check_policy_location(5, str(root / "v5"), root)
    assert check_policy_location(3, str(outside), None) == outside  # no root configured: any loadable folder


def test_unauthorised_calls_of_every_protected_method_are_refused_and_change_nothing(tmp_path, rollout_stack, smollm2_dir):
    import threading

    from learner_service.loop import LearnerRunner
    from learner_service.trainer import Learner
    from sinkflex.buffer import TrajectoryBuffer, embedded_redis_url
    from tests.fixtures.learner import TINY_GPT_OSS, learner_config, one_thread

    pki = write_pki(tmp_path / "pki")
    root = tmp_path / "learner" / "policy"
    (root / "v1").mkdir(parents=True)
    buf = TrajectoryBuffer(url=embedded_redis_url(), stream=f"test-authz:{uuid.uuid4().hex[:8]}")
    cfg = learner_config(tmp_path / "learner", TINY_GPT_OSS, buffer=dict(url=buf.url, stream=buf.stream, block_ms=100))
    with one_thread():
        runner = LearnerRunner(Learner(cfg, metrics=False), buf)
        loop = threading.Thread(target=runner.run, daemon=True)
        loop.start()
        try:
            r = run_authz(rollout_stack.worker, runner, root, Path(smollm2_dir), pki)
        finally:
            runner.request_stop()
            loop.join(30)
            buf.delete()
            buf.close()
    a, d = r["authz"], r["authz_detail"]
    assert a["tried"] >= 20 and a["refused"] == a["tried"], [c for c in d["cases"] if not c["refused"]]
    assert d["nothing_changed"], (d["state_before"], d["state_after"])
    assert {c["method"] for c in d["cases"]} == {"UpdateWeights", "Checkpoint", "Rollout"}
    assert all(c["status"] == "PERMISSION_DENIED" for c in d["cases"] if c["identity"] in ("(none)", "reward", "env"))
