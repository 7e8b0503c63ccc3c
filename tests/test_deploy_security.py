"""Security settings of the deployment: read-only root filesystems, gRPC TLS (chart and compose),
Redis passwords (docs/deploy.md, "Security")."""

from __future__ import annotations

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
    full,
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
            assert {k: env.get(k) for k in want} == want, (comp, c["name"])
            mount = [m for m in c["volumeMounts"] if m["name"] == "tls"]
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


def test_compose_redis_has_a_password(compose):
    redis = compose["services"]["redis"]
    assert "--requirepass" in redis["command"]
    assert ":${REDIS_PASSWORD:-sinkflex-local}@redis:6379" in compose["x-sinkflex-env"]["REDIS_URL"]


def test_compose_tls_overlay_covers_every_grpc_service(compose, compose_tls):
    grpc_services = {n for n in compose["services"] if n.removesuffix("-cpu") in (*GRPC, "train")}
    assert set(compose_tls["services"]) == grpc_services
    for name, svc in compose_tls["services"].items():
        assert svc["environment"]["SINKFLEX_TLS_CA_FILE"] == "/run/secrets/sinkflex-tls-ca", name
        assert set(svc["secrets"]) == {"sinkflex-tls-ca", "sinkflex-tls-cert", "sinkflex-tls-key"}
    files = {k: v["file"] for k, v in compose_tls["secrets"].items()}
    assert files["sinkflex-tls-key"] == "${SINKFLEX_TLS_DIR:-./tls}/tls.key"
