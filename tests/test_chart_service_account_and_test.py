"""charts/sinkflex: the serviceAccount block (every pod runs as it), the `helm test` hook Pod
that checks grpc.health.v1 of every service, and a values header that names the default
experiment's real model. Rendered by Helm's own Go code (helm-python-sdk)."""

from __future__ import annotations

import yaml

from tests.fixtures.deploy import CHART, HEALTH_SERVICES, PORTS, ROOT, by_kind, full, render_chart

POD_KINDS = ("Deployment", "StatefulSet", "Job")


def _pod_specs(manifests):
    out = {}
    for m in manifests:
        if m["kind"] in POD_KINDS:
            out[f"{m['kind']}/{m['metadata']['name']}"] = m["spec"]["template"]["spec"]
        elif m["kind"] == "Pod":
            out[f"Pod/{m['metadata']['name']}"] = m["spec"]
    return out


def test_every_pod_runs_as_the_release_service_account():
    manifests = render_chart({"serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/x"}}})
    (sa,) = by_kind(manifests, "ServiceAccount").values()
    assert sa["metadata"]["name"] == "sf-sinkflex"
    assert sa["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/x"}
    assert sa["automountServiceAccountToken"] is False
    specs = _pod_specs(manifests)
    assert {k.split("/")[1] for k in specs} >= {full(c) for c in ("env", "reward", "rollout", "learner", "user-sim", "redis",
                                                                   "train", "test-grpc-health")}
    assert {k: s.get("serviceAccountName") for k, s in specs.items()} == {k: "sf-sinkflex" for k in specs}


def test_an_existing_service_account_is_used_not_made():
    manifests = render_chart({"serviceAccount": {"create": False, "name": "ml-runner"}})
    assert by_kind(manifests, "ServiceAccount") == {}
    assert {s["serviceAccountName"] for s in _pod_specs(manifests).values()} == {"ml-runner"}
    manifests = render_chart({"serviceAccount": {"create": False}})
    assert {s["serviceAccountName"] for s in _pod_specs(manifests).values()} == {"default"}
    manifests = render_chart({"serviceAccount": {"name": "custom"}})
    assert list(by_kind(manifests, "ServiceAccount")) == ["custom"]


def test_helm_test_pod_checks_grpc_health_of_every_service():
    manifests = render_chart({"helmTest": {"timeoutSeconds": 120}})
    pod = by_kind(manifests, "Pod")[full("test-grpc-health")]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    services = by_kind(manifests, "Service")
    checks = {}
    for c in pod["spec"]["containers"]:
        assert c["command"] == ["python", "-m", "sinkflex.healthcheck"]
        address, flag, health, wait, seconds = c["args"]
        assert (flag, wait, seconds) == ("--service", "--wait", "120")
        host, port = address.split(":")
        grpc_port = {p["name"]: p["port"] for p in services[host]["spec"]["ports"]}["grpc"]  # a real Service, its gRPC port
        checks[c["name"]] = (host, int(port), health, grpc_port)
    assert checks == {name: (full(name), PORTS[name][0], HEALTH_SERVICES[name], PORTS[name][0]) for name in HEALTH_SERVICES}
    # the NetworkPolicy of each service lets the test Pod in (pods of the release)
    allowed = by_kind(manifests, "NetworkPolicy")[full("env")]["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert allowed.items() <= pod["metadata"]["labels"].items()
    assert by_kind(render_chart({"helmTest": {"enabled": False}}), "Pod") == {}


def test_values_header_names_the_default_experiments_model():
    values_text = (CHART / "values.yaml").read_text()
    header = values_text.split("\n\n")[0]
    default_cfg = yaml.safe_load(values_text)["trainingConfig"]
    models = yaml.safe_load((ROOT / default_cfg).read_text())["models"]
    assert models == {"policy": "smollm2", "user_simulator": "smollm2"}
    assert f"the experiment {default_cfg}" in header and "SmolLM2-135M-Instruct" in header
    assert "gpt-oss-20b as policy" not in header
