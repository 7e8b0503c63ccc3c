"""`python scripts/compose_tls_check.py [--out FILE]`: bring up part of the compose stack with the TLS overlay and
the Redis users, check who gets in, tear it down.

Needs podman, podman-compose (`--compose`, default /opt/pcvenv/bin/podman-compose: docs/deploy.md, "Without a
registry") and the images of scripts/build_images.sh (localhost/sinkflex/*). Bounded: every wait has a
deadline, and the project (`-p sfcheck`, its own volumes) is taken down with `down -v` whatever happens.

1. A throw-away CA and one certificate per identity (scripts/tls_dev_certs.py) and the Redis ACL file and
   passwords (scripts/redis_acl.py) in a temporary folder, given to compose as SINKFLEX_TLS_DIR and
   SINKFLEX_REDIS_AUTH_DIR.
2. `podman-compose -f docker-compose.yml -f docker-compose.tls.yml --profile cpu up -d --no-deps` redis, env,
   reward, rollout-cpu, one after the other, each once the previous one's health check passes (`podman
   healthcheck run`: podman without systemd runs none by itself).
3. The checks (each recorded with what it got): the secrets each container sees; redis-server's command
   line holds no password; Redis refuses a client without a password, the producer reading and the consumer
   adding a group (NOPERM) and answers the admin with `appendfsync always`; a gRPC health check through mTLS
   with the driver's certificate is SERVING, and refused in plaintext and without a client certificate;
   UpdateWeights as reward (wrong identity), as driver from a folder outside the policy root and for a
   version never published, and Rollout with publish as learner are refused (PERMISSION_DENIED /
   INVALID_ARGUMENT) and the engine's policy version stays 0.

Writes FILE (JSON: every check with `ok`, the timings, the commit) and exits 1 when a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROJECT = "sfcheck"
SERVICES = [("redis", 120), ("env", 300), ("reward", 300), ("rollout-cpu", 900)]


def _run(argv: list[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, **kw)


def _container(service: str) -> str:
    out = _run(["podman", "ps", "-a", "--filter", f"label=com.docker.compose.project={PROJECT}",
                "--filter", f"label=com.docker.compose.service={service}", "--format", "{{.Names}}"]).stdout.split()
    return out[0] if out else ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compose", default="/opt/pcvenv/bin/podman-compose")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "compose_tls_check.json")
    a = p.parse_args(argv)
    import importlib.util

    import grpc

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    write_acl = load("redis_acl").write_acl
    certs = load("tls_dev_certs")
    IDENTITIES, NAMES, write_certs = certs.IDENTITIES, certs.NAMES, certs.write_certs
    from sinkflex.api.learner.v1 import learner_pb2  # noqa: F401 - the stubs' imports
    from sinkflex.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
    from sinkflex.serving import make_channel
    from sinkflex.tls import TLSConfig

    work = Path(tempfile.mkdtemp(prefix="sfcheck-"))
    write_certs(work / "tls", NAMES, days=1)
    redis_image = os.environ.get("REDIS_IMAGE", "localhost/sinkflex/redis:7-bookworm")
    # Debian 12's redis-server (scripts/build_images.sh's image) is 7.0: no CLIENT SETINFO in its ACL rules
    passwords = write_acl(work / "redis-auth", redis_minor=0 if redis_image.endswith(":7-bookworm") else 4)
    env = {**os.environ, "SINKFLEX_TLS_DIR": str(work / "tls"), "SINKFLEX_REDIS_AUTH_DIR": str(work / "redis-auth"),
           "REDIS_IMAGE": redis_image}
    pc = [a.compose, "-p", PROJECT, "-f", str(ROOT / "docker-compose.yml"), "-f", str(ROOT / "docker-compose.tls.yml"),
          "--profile", "cpu"]
    checks: list[dict] = []
    timings: dict[str, float] = {}

    def check(name: str, ok: bool, got) -> None:
        checks.append({"check": name, "ok": bool(ok), "got": got})
        print(f"{'ok ' if ok else 'FAIL'} {name}: {got}", flush=True)

    t0 = time.monotonic()
    try:
        for service, limit in SERVICES:
            r = _run([*pc, "up", "-d", "--no-deps", service], timeout=300, env=env, cwd=ROOT)
            if r.returncode != 0:
                check(f"{service} starts", False, (r.stdout + r.stderr)[-1500:])
                raise SystemExit(1)
            name, deadline = _container(service), time.monotonic() + limit
            healthy = False
            while time.monotonic() < deadline:
                if _run(["podman", "healthcheck", "run", name], timeout=60).returncode == 0:
                    healthy = True
                    break
                time.sleep(5)
            timings[service] = round(time.monotonic() - t0, 1)
            logs = "" if healthy else _run(["podman", "logs", "--tail", "30", name]).stdout[-1500:]
            check(f"{service} healthy (its own health check, TLS for the gRPC services)", healthy,
                  f"after {timings[service]} s" if healthy else logs)
            if not healthy:
                raise SystemExit(1)

        # the secrets each container sees: its own pair and the CA, its own Redis password
        want = {"env": {"sinkflex-tls-ca", "sinkflex-tls-env-crt", "sinkflex-tls-env-key"},
                "reward": {"sinkflex-tls-ca", "sinkflex-tls-reward-crt", "sinkflex-tls-reward-key"},
                "rollout-cpu": {"sinkflex-tls-ca", "sinkflex-tls-rollout-crt", "sinkflex-tls-rollout-key",
                                "redis-producer-password"},
                "redis": {"redis-users-acl", "redis-admin-password"}}
        for service, names in want.items():
            got = set(_run(["podman", "exec", _container(service), "ls", "/run/secrets"]).stdout.split())
            check(f"{service} sees only its own secrets", got == names, sorted(got))

        redis = _container("redis")
        args = _run(["podman", "exec", redis, "cat", "/proc/1/cmdline"]).stdout.replace("\0", " ")
        check("redis-server's command line holds no password", not any(pw in args for pw in passwords.values())
              and "requirepass" not in args, args.strip())

        def cli(*lines: str) -> str:
            return _run(["podman", "exec", "-i", redis, "redis-cli"], input="\n".join(lines) + "\n").stdout.strip()

        got = cli("PING")
        check("Redis without a password: refused", "NOAUTH" in got, got)
        got = cli(f"AUTH producer {passwords['producer']}", "XREADGROUP GROUP learner c STREAMS sinkflex:groups >")
        check("Redis producer reading entries: refused", "NOPERM" in got, got)
        got = cli(f"AUTH consumer {passwords['consumer']}", "XADD sinkflex:groups * group x")
        check("Redis consumer adding a group: refused", "NOPERM" in got, got)
        got = cli(f"AUTH reader {passwords['reader']}", "FLUSHALL")
        check("Redis reader FLUSHALL: refused", "NOPERM" in got, got)
        got = cli(f"AUTH {passwords['admin']}", "CONFIG GET appendfsync")
        check("Redis appendfsync", got.split() == ["OK", "appendfsync", "always"], got)

        def tls(identity: str | None, ca: bool = True) -> TLSConfig:
            d = work / "tls"
            if not ca:
                return TLSConfig()
            if identity is None:
                return TLSConfig(ca_file=str(d / "ca.crt"))
            return TLSConfig(ca_file=str(d / "ca.crt"), cert_file=str(d / f"{identity}.crt"), key_file=str(d / f"{identity}.key"))

        hc = [sys.executable, "-m", "sinkflex.healthcheck", "127.0.0.1:50051", "--timeout", "5"]
        clean = {k: v for k, v in os.environ.items() if not k.startswith("SINKFLEX_TLS")}
        d = work / "tls"
        r = _run([*hc, "--tls-ca", str(d / "ca.crt"), "--tls-cert", str(d / "driver.crt"), "--tls-key", str(d / "driver.key")], env=clean)
        check("env health through mTLS as driver, from the host", r.returncode == 0, (r.stdout + r.stderr).strip()[-300:])
        r = _run(hc, env=clean)
        check("env health in plaintext: refused", r.returncode != 0, (r.stdout + r.stderr).strip()[-300:])
        r = _run([*hc, "--tls-ca", str(d / "ca.crt")], env=clean)
        check("env health without a client certificate: refused", r.returncode != 0, (r.stdout + r.stderr).strip()[-300:])

        def call(identity: str, method: str, req) -> tuple[str, str]:
            with make_channel("localhost:50053", tls=tls(identity)) as ch:
                stub = rollout_pb2_grpc.RolloutServiceStub(ch)
                try:
                    if method == "Rollout":
                        list(stub.Rollout(req, timeout=30))
                    else:
                        getattr(stub, method)(req, timeout=30)
                    return "OK", ""
                except grpc.RpcError as err:
                    return err.code().name, (err.details() or "")[:200]

        root = "/data/run/learner/policy"
        cases = [
            ("UpdateWeights as reward (wrong identity)", "reward", "UpdateWeights",
             rollout_pb2.UpdateWeightsRequest(policy_version=1, location=f"{root}/v1"), {"PERMISSION_DENIED"}),
            ("UpdateWeights as driver from outside the policy root", "driver", "UpdateWeights",
             rollout_pb2.UpdateWeightsRequest(policy_version=1, location="/tmp"), {"PERMISSION_DENIED"}),
            ("UpdateWeights as learner for a version never published", "learner", "UpdateWeights",
             rollout_pb2.UpdateWeightsRequest(policy_version=7, location=f"{root}/v7"), {"INVALID_ARGUMENT"}),
            ("Rollout with publish as learner (wrong identity)", "learner", "Rollout",
             rollout_pb2.RolloutRequest(env="mock", task_ids=["create_task_1"], group_size=1, publish=True), {"PERMISSION_DENIED"}),
        ]
        for name, identity, method, req, codes in cases:
            code, message = call(identity, method, req)
            check(name + ": refused", code in codes, f"{code} {message}")
        with make_channel("localhost:50053", tls=tls("driver")) as ch:
            st = rollout_pb2_grpc.RolloutServiceStub(ch).Status(rollout_pb2.StatusRequest(), timeout=30)
        check("the engine's policy version is unchanged (0)", st.policy_version == 0, st.policy_version)
    except SystemExit:
        pass
    except Exception as err:  # noqa: BLE001 - recorded, then the stack is taken down
        check("the check ran to its end", False, f"{type(err).__name__}: {err}"[:500])
    finally:
        down = _run([*pc, "down", "-v"], timeout=300, env=env, cwd=ROOT)
        timings["total"] = round(time.monotonic() - t0, 1)
        commit = _run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]).stdout.strip()
        result = {"command": "python scripts/compose_tls_check.py", "commit": commit,
                  "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "timings_s": timings,
                  "down_rc": down.returncode, "checks": checks, "identities": IDENTITIES,
                  "passed": sum(c["ok"] for c in checks), "tried": len(checks)}
        a.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"{result['passed']}/{result['tried']} checks passed; wrote {a.out}", flush=True)
    return 0 if checks and all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
