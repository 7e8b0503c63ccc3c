"""The Helm chart (charts/sinkflex): lint, render, Kubernetes schemas, and what the
rendered manifests must hold — GPU requests, gRPC probes, /dev/shm, wiring to Services.

Rendering is Helm's own (helm-python-sdk, offline); validation is against the Kubernetes
OpenAPI-derived JSON schemas of kubernetes-validate, in strict mode (unknown fields fail).
"""

from __future__ import annotations

import base64
import copy
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
from kubernetes_validate.utils import SchemaNotFoundError, latest_version

from tests.fixtures.deploy import (
    ALL_OPTIONAL_VALUES,
    CHART,
    DOCKER,
    HEALTH_SERVICES,
    MULTI_GPU_VALUES,
    NAMESPACE,
    PORTS,
    ROOT,
    by_kind,
    component,
    full,
    render_chart,
    strip,
    workloads,
)

GPU_COMPONENTS = {"rollout", "learner", "user-sim"}
#: The chart's minimum Kubernetes (Chart.yaml kubeVersion) and the newest schemas we have.
KUBE_VERSIONS = ["1.28.0", latest_version()]

# Minimal schemas of the custom resources the chart may render (no Kubernetes schema
# exists for them offline): the fields the operators require, with their types.
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): {
        "type": "object",
        "required": ["spec"],
        "properties": {"spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "properties": {
                "scaleTargetRef": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "pollingInterval": {"type": "integer"},
                "cooldownPeriod": {"type": "integer"},
                "triggers": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["type", "metadata"],
                    "properties": {"type": {"type": "string"}, "metadata": _STR_MAP,
                                   "authenticationRef": {"type": "object", "required": ["name"]}},
                }},
            },
        }},
    },
    ("keda.sh/v1alpha1", "TriggerAuthentication"): {
        "type": "object",
        "required": ["spec"],
        "properties": {"spec": {"type": "object", "properties": {"secretTargetRef": {"type": "array", "items": {
            "type": "object", "required": ["parameter", "name", "key"],
            "properties": {k: {"type": "string"} for k in ("parameter", "name", "key")},
        }}}}},
    },
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "type": "object",
        "required": ["spec"],
        "properties": {"spec": {
            "type": "object", "required": ["selector", "endpoints"],
            "properties": {"endpoints": {"type": "array", "minItems": 1, "items": {
                "type": "object", "properties": {"port": {"type": "string"}, "path": {"type": "string"}, "interval": {"type": "string"}},
            }}},
        }},
    },
}


def containers(workload: dict) -> list[dict]:
    return workload["spec"]["template"]["spec"]["containers"]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def workload_of(manifests, comp: str) -> dict:
    """The workload of a component (the learner's node-0 StatefulSet, not its workers)."""
    found = [w for w in workloads(manifests) if component(w) == comp and w["metadata"]["name"] == full(comp)]
    assert len(found) == 1, f"expected one {comp} workload, got {[w['metadata']['name'] for w in found]}"
    return found[0]


def arg_value(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} not in {args}"
    return args[args.index(flag) + 1]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


# --------------------------------------------------------------------------- lint and schemas

@pytest.mark.parametrize("values", [None, MULTI_GPU_VALUES, {**ALL_OPTIONAL_VALUES, **MULTI_GPU_VALUES}],
                         ids=["default", "multi-gpu-learner", "all-optional"])
def test_chart_lints_clean_in_strict_mode(values):
    import helm_python as helm

    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE, kube_version="v1.30.0")
    assert report["total_charts_linted"] == 1
    assert report["errors"] == []
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warnings and errors
    assert problems == []


@pytest.mark.parametrize("which", ["chart_default", "chart_multigpu", "chart_all_optional"])
def test_every_manifest_validates_against_kubernetes_schemas(which, request):
    manifests = request.getfixturevalue(which)
    checked_builtin = checked_crd = 0
    for m in manifests:
        doc = strip(m)
        key = (doc["apiVersion"], doc["kind"])
        if key in CRD_SCHEMAS:
            jsonschema.validate(doc, CRD_SCHEMAS[key])
            checked_crd += 1
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except SchemaNotFoundError:
                pytest.fail(f"no Kubernetes schema for {key} ({m['__template__']})")
            except kubernetes_validate.ValidationError as err:
                pytest.fail(f"{m['__template__']} {doc['kind']}/{doc['metadata']['name']} invalid for "
                            f"Kubernetes {version}: {'.'.join(map(str, err.path))}: {err.message}")
        checked_builtin += 1
    assert checked_builtin >= 20
    assert checked_crd == (4 if which == "chart_all_optional" else 0)  # 2 ScaledObjects, TriggerAuthentication, ServiceMonitor


def test_schema_validation_catches_a_broken_manifest(chart_default):
    """The validator used above is live: a misspelt field and a wrong type are refused."""
    dep = strip(copy.deepcopy(by_kind(chart_default, "Deployment")[full("env")]))
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["prot"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, KUBE_VERSIONS[-1], strict=True)
    dep = strip(copy.deepcopy(by_kind(chart_default, "Deployment")[full("env")]))
    dep["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, KUBE_VERSIONS[-1], strict=True)


def test_default_objects(chart_default):
    kinds = {(m["kind"], m["metadata"]["name"]) for m in chart_default}
    for comp in ("env", "reward", "rollout", "user-sim"):
        assert ("Deployment", full(comp)) in kinds
        assert ("Service", full(comp)) in kinds
    assert ("StatefulSet", full("learner")) in kinds
    assert ("Service", full("learner-headless")) in kinds
    assert ("StatefulSet", full("redis")) in kinds
    assert ("Job", full("train")) in kinds
    assert ("PersistentVolumeClaim", full("shared")) in kinds
    assert {"ScaledObject", "ServiceMonitor", "TriggerAuthentication"}.isdisjoint(m["kind"] for m in chart_default)


# --------------------------------------------------------------------------- GPUs

@pytest.mark.parametrize("which", ["chart_default", "chart_multigpu"])
def test_gpu_requests_and_limits(which, request):
    manifests = request.getfixturevalue(which)
    multi = which == "chart_multigpu"
    expected = {"rollout": 1, "user-sim": 2 if multi else 1, "learner": 2 if multi else 1}
    for w in workloads(manifests):
        comp = component(w)
        for c in containers(w):
            res = c["resources"]
            if comp in GPU_COMPONENTS:
                assert res["requests"]["nvidia.com/gpu"] == expected[comp], (comp, res)
                assert res["limits"]["nvidia.com/gpu"] == expected[comp], (comp, res)
                assert "cpu" in res["requests"] and "memory" in res["requests"]
            else:
                assert "nvidia.com/gpu" not in res.get("requests", {}), comp
                assert "nvidia.com/gpu" not in res.get("limits", {}), comp
                assert "memory" in res["requests"], comp


def test_gpu_pods_land_on_gpu_nodes(chart_default):
    for w in workloads(chart_default):
        spec = pod_spec(w)
        tolerations = spec.get("tolerations", [])
        if component(w) in GPU_COMPONENTS:
            assert spec["nodeSelector"]["nvidia.com/gpu.present"] == "true"
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
        else:
            assert "nvidia.com/gpu.present" not in spec.get("nodeSelector", {})
            assert not any(t.get("key") == "nvidia.com/gpu" for t in tolerations)
    learner = workload_of(chart_default, "learner")
    term = pod_spec(learner)["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "learner"


def test_component_scheduling_values_merge_with_gpu_defaults():
    manifests = render_chart({"rollout": {
        "nodeSelector": {"node.kubernetes.io/instance-type": "p5.48xlarge"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "rl", "effect": "NoSchedule"}],
    }})
    spec = pod_spec(workload_of(manifests, "rollout"))
    assert spec["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge", "nvidia.com/gpu.present": "true"}
    assert [t["key"] for t in spec["tolerations"]] == ["nvidia.com/gpu", "dedicated"]


def test_multi_gpu_learner_is_a_two_node_torchrun_job(chart_multigpu):
    sets = by_kind(chart_multigpu, "StatefulSet")
    master, worker = sets[full("learner")], sets[full("learner-worker")]
    headless = by_kind(chart_multigpu, "Service")[full("learner-headless")]
    front = by_kind(chart_multigpu, "Service")[full("learner")]
    assert (master["spec"]["replicas"], worker["spec"]["replicas"]) == (1, 1)  # 2 nodes
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    ranks = {}
    for sts in (master, worker):
        assert sts["spec"]["podManagementPolicy"] == "Parallel"
        assert sts["spec"]["serviceName"] == headless["metadata"]["name"]
        assert headless["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
        (c,) = containers(sts)
        assert c["command"] == ["sinkflex-service", "learner"]
        env = env_of(c)
        assert env["NNODES"]["value"] == "2"
        assert env["NPROC_PER_NODE"]["value"] == "2"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
        assert env["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
        ranks[sts["metadata"]["name"]] = int(env["NODE_RANK_OFFSET"]["value"])  # + the pod's ordinal
        assert env["MASTER_ADDR"]["value"] == f"{full('learner')}-0.{full('learner-headless')}.{NAMESPACE}.svc"
        rdzv = int(env["MASTER_PORT"]["value"])
        assert {"name": "rendezvous", "port": rdzv, "targetPort": "rendezvous", "protocol": "TCP"} in headless["spec"]["ports"]
    assert ranks == {full("learner"): 0, full("learner-worker"): 1}  # node ranks 0 and 1
    # the controllers' selectors do not overlap
    assert master["spec"]["selector"]["matchLabels"]["sinkflex.io/learner-role"] == "master"
    assert worker["spec"]["selector"]["matchLabels"]["sinkflex.io/learner-role"] == "worker"
    # gRPC (and its probes) only on node 0, global rank 0, which the Service selects
    assert front["spec"]["selector"]["sinkflex.io/learner-role"] == "master"
    assert "readinessProbe" in containers(master)[0]
    assert not {"readinessProbe", "livenessProbe", "startupProbe"} & set(containers(worker)[0])
    # the user-simulator engine: tensor parallel 2 over its 2 GPUs
    (sim,) = containers(workload_of(chart_multigpu, "user-sim"))
    assert arg_value(sim["args"], "--tensor-parallel-size") == "2"
    assert sim["resources"]["limits"]["nvidia.com/gpu"] == 2


def test_bad_gpu_layouts_are_refused():
    from helm_python import HelmRenderError

    with pytest.raises(HelmRenderError, match=r"userSim.tensorParallelSize \(3\) must divide userSim.gpus \(2\)"):
        render_chart({"userSim": {"gpus": 2, "tensorParallelSize": 3}})
    with pytest.raises(HelmRenderError, match=r"learner.nodes \(0\) and learner.gpusPerNode \(1\) must be >= 1"):
        render_chart({"learner": {"nodes": 0}})


# --------------------------------------------------------------------------- probes and shm

def test_native_grpc_probes_on_every_service(chart_default):
    seen = set()
    for w in workloads(chart_default):
        comp = component(w)
        if comp not in HEALTH_SERVICES:
            continue
        (c,) = containers(w)
        grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
        assert grpc_port == PORTS[comp][0]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert set(c[probe]) & {"exec", "httpGet", "tcpSocket"} == set(), (comp, probe)
            assert c[probe]["grpc"]["port"] == grpc_port, (comp, probe)
        assert c["readinessProbe"]["grpc"]["service"] == HEALTH_SERVICES[comp]
        assert c["startupProbe"]["grpc"]["service"] == HEALTH_SERVICES[comp]
        # startup allows model loading: periodSeconds * failureThreshold >= the configured budget
        sp = c["startupProbe"]
        assert sp["periodSeconds"] * sp["failureThreshold"] >= (1800 if comp in ("rollout", "learner") else 300)
        seen.add(comp)
    assert seen == set(HEALTH_SERVICES)


@pytest.mark.parametrize("which", ["chart_default", "chart_multigpu"])
def test_dev_shm_in_memory_for_nccl_and_vllm(which, request):
    manifests = request.getfixturevalue(which)
    for comp in GPU_COMPONENTS:
        spec = pod_spec(workload_of(manifests, comp))
        (c,) = spec["containers"]
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        assert volume["emptyDir"]["medium"] == "Memory", comp
        assert re.fullmatch(r"\d+Gi", volume["emptyDir"]["sizeLimit"]), comp


# --------------------------------------------------------------------------- wiring

_ADDRESS = re.compile(r"^(?:[a-z]+://(?:[^@/]*@)?)?([a-z0-9][a-z0-9.-]*):(\d+)(?:/.*)?$")


def _resolve(value: str, env: dict[str, dict]) -> str:
    """Kubernetes' $(VAR) expansion with literal env values (secrets stay as placeholders)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: env[m.group(1)].get("value", f"<{m.group(1)}>") if m.group(1) in env else m.group(0), value)


def _addresses(container: dict) -> list[tuple[str, str, int]]:
    """(where, host, port) of every host:port the container is configured with."""
    env = env_of(container)
    found = []
    for name, e in env.items():
        if "value" in e:
            m = _ADDRESS.match(_resolve(e["value"], env))
            if m:
                found.append((f"env {name}", m.group(1), int(m.group(2))))
    if "MASTER_ADDR" in env:  # torchrun's rendezvous, host and port apart
        found.append(("env MASTER_ADDR:MASTER_PORT", env["MASTER_ADDR"]["value"], int(env["MASTER_PORT"]["value"])))
    for a in container.get("args", []):
        m = _ADDRESS.match(_resolve(a, env))
        if m and not a.startswith("-"):
            found.append((f"arg {a}", m.group(1), int(m.group(2))))
    return found


@pytest.mark.parametrize("which", ["chart_default", "chart_multigpu", "chart_all_optional"])
def test_every_address_in_the_wiring_is_a_service_port(which, request):
    manifests = request.getfixturevalue(which)
    services = by_kind(manifests, "Service")
    pods = {w["metadata"]["name"]: w for w in workloads(manifests)}
    wired = set()
    for w in workloads(manifests):
        for c in containers(w) + pod_spec(w).get("initContainers", []):
            for where, host, port in _addresses(c):
                if host in ("0.0.0.0", "127.0.0.1"):
                    continue
                # a Service name, or <pod>.<headless service>.<namespace>.svc of a StatefulSet pod
                parts = host.split(".")
                if len(parts) >= 4 and parts[-1] == "svc":
                    pod, svc_name, ns = parts[0], parts[1], parts[2]
                    assert ns == NAMESPACE, where
                    sts = pods[pod.rsplit("-", 1)[0]]
                    assert sts["kind"] == "StatefulSet" and sts["spec"]["serviceName"] == svc_name, where
                else:
                    svc_name = host
                assert svc_name in services, f"{w['metadata']['name']} {where}: no Service {svc_name}"
                svc = services[svc_name]
                svc_port = next((p for p in svc["spec"]["ports"] if p["port"] == port), None)
                assert svc_port is not None, f"{w['metadata']['name']} {where}: Service {svc_name} has no port {port}"
                # the Service's selector picks pods whose container has the target port
                targets = [t for t in workloads(manifests)
                           if svc["spec"]["selector"].items() <= {
                               **t["spec"]["template"]["metadata"]["labels"],
                               **({"statefulset.kubernetes.io/pod-name": f"{t['metadata']['name']}-0"} if t["kind"] == "StatefulSet" else {}),
                           }.items()]
                assert targets, f"Service {svc_name} selects no pod"
                for t in targets:
                    names = {p["name"]: p["containerPort"] for tc in containers(t) for p in tc.get("ports", [])}
                    target = svc_port["targetPort"]
                    assert (target in names) if isinstance(target, str) else (target in names.values()), (svc_name, target)
                wired.add(svc_name)
    expected = {full(c) for c in ("env", "reward", "rollout", "learner", "redis", "user-sim", "learner-headless")}
    assert expected <= wired, f"never wired: {expected - wired}"


def test_service_ports_follow_the_project_table(chart_default):
    services = by_kind(chart_default, "Service")
    for comp, (grpc_port, metrics_port) in PORTS.items():
        ports = {p["name"]: p["port"] for p in services[full(comp)]["spec"]["ports"]}
        assert ports == {"grpc": grpc_port, "metrics": metrics_port}
        assert services[full(comp)]["metadata"]["labels"]["sinkflex.io/metrics"] == "true"
        (c,) = containers(workload_of(chart_default, comp))
        assert arg_value(c["args"], "--port") == str(grpc_port)
        assert arg_value(c["args"], "--metrics-port") == str(metrics_port)
        assert arg_value(c["args"], "--host") == "0.0.0.0"
        assert env_of(c)["SINKFLEX_GRPC_PORT"]["value"] == str(grpc_port)


# --------------------------------------------------------------------------- Redis, secrets

def test_redis_persistence_and_auth(chart_default):
    from sinkflex.buffer.acl import acl_rules, password_hash

    sts = by_kind(chart_default, "StatefulSet")[full("redis")]
    secret = by_kind(chart_default, "Secret")[full("redis")]
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    for key in ("redis-password", "producer-password", "consumer-password", "reader-password"):
        assert len(data[key]) == 32 and data[key].isalnum(), key
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "8Gi"
    (c,) = containers(sts)
    assert {"name": "data", "mountPath": "/data"} in c["volumeMounts"]
    assert c["args"][c["args"].index("--appendonly") + 1] == "yes"
    assert c["args"][c["args"].index("--maxmemory") + 1] == "3gb"
    assert c["args"][c["args"].index("--maxmemory-policy") + 1] == "noeviction"
    assert c["args"][c["args"].index("--aclfile") + 1] == "/etc/redis/users.acl"
    assert "--requirepass" not in c["args"] and not any(data[k] in " ".join(c["args"]) for k in data)  # no password on a command line
    # the ACL file: the admin (default) user and one user per role, with sinkflex.buffer.acl's rules, hashes only
    acl = data["users.acl"].splitlines()
    assert acl[0] == f"user default on {password_hash(data['redis-password'])} ~* &* +@all"
    for line, role in zip(acl[1:], ("producer", "consumer", "reader")):
        rules = [r for r in acl_rules(role, "sinkflex:groups", 7) if r != "reset"]
        assert line == f"user {role} {' '.join(rules)} {password_hash(data[role + '-password'])}"
    assert not any(data[k] in data["users.acl"] for k in data if k != "users.acl")
    # each Redis client logs in as its role with the password from a mounted file, never in the URL
    for comp, role in (("rollout", "producer"), ("learner", "consumer"), ("train", "reader")):
        w = workload_of(chart_default, comp)
        (cc,) = containers(w)
        env = env_of(cc)
        assert env["REDIS_USERNAME"]["value"] == role and "REDIS_PASSWORD" not in env
        assert env["REDIS_PASSWORD_FILE"]["value"] == "/etc/sinkflex/redis/password"
        assert env["REDIS_URL"]["value"] == f"redis://{full('redis')}:6379/0"
        volumes = {v["name"]: v for v in pod_spec(w)["volumes"]}
        assert volumes["redis-auth"]["secret"]["items"] == [{"key": f"{role}-password", "path": "password"}]
        assert {"name": "redis-auth", "mountPath": "/etc/sinkflex/redis", "readOnly": True} in cc["volumeMounts"]


def test_existing_secrets_and_external_redis():
    manifests = render_chart({
        "redis": {"enabled": False, "externalUrl": "redis://redis.example.internal:6379/0",
                  "auth": {"existingSecret": "my-redis", "existingSecretKey": "pw"}},
        "modelEndpoints": {"existingSecret": "my-keys"},
    })
    assert by_kind(manifests, "Secret") == {}
    assert full("redis") not in by_kind(manifests, "StatefulSet")
    (c,) = containers(workload_of(manifests, "rollout"))
    env = env_of(c)
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "my-redis", "key": "pw"}
    assert env["REDIS_URL"]["value"] == "redis://redis.example.internal:6379/0"
    (e,) = containers(workload_of(manifests, "env"))
    assert env_of(e)["USER_SIM_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "my-keys", "key": "user-sim-api-key"}


def test_model_endpoint_keys_come_from_the_secret(chart_all_optional):
    secret = by_kind(chart_all_optional, "Secret")[full("model-endpoints")]
    keys = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert keys == {"user-sim-api-key": "EMPTY", "hf-token": "hf_test_token"}
    (env_c,) = containers(workload_of(chart_all_optional, "env"))
    assert arg_value(env_c["args"], "--user-api-key") == "$(USER_SIM_API_KEY)"
    assert env_of(env_c)["USER_SIM_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == full("model-endpoints")
    (sim,) = containers(workload_of(chart_all_optional, "user-sim"))
    assert arg_value(sim["args"], "--api-key") == "$(USER_SIM_API_KEY)"
    (rew,) = containers(workload_of(chart_all_optional, "reward"))
    assert env_of(rew)["SINKFLEX_JUDGE_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": full("model-endpoints"), "key": "judge-api-key", "optional": True}
    judged = render_chart({"modelEndpoints": {"judgeApiKey": "sk-judge"}})
    secret = by_kind(judged, "Secret")[full("model-endpoints")]
    assert base64.b64decode(secret["data"]["judge-api-key"]).decode() == "sk-judge"
    for comp in ("rollout", "learner", "user-sim"):
        (c,) = containers(workload_of(chart_all_optional, comp))
        assert env_of(c)["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": full("model-endpoints"), "key": "hf-token", "optional": True}
    # no key is written into any pod spec in clear
    for w in workloads(chart_all_optional):
        assert "hf_test_token" not in str(w)


def test_user_simulator_wiring(chart_default):
    (env_c,) = containers(workload_of(chart_default, "env"))
    (sim,) = containers(workload_of(chart_default, "user-sim"))
    assert sim["command"] == ["sinkflex-service", "user-sim"]
    served = arg_value(sim["args"], "--served-model-name")
    env = env_of(env_c)
    assert env["SINKFLEX_USER_MODEL"]["value"] == f"openai/{served}"
    port = arg_value(sim["args"], "--port")
    assert env["SINKFLEX_USER_BASE_URL"]["value"] == f"http://{full('user-sim')}:{port}/v1"
    assert env_of(sim)["SINKFLEX_USER_SIM_MODEL"]["value"] == ""  # the experiment's models.user_simulator
    external = render_chart({"userSim": {"enabled": False, "externalBaseUrl": "https://llm.example/v1", "externalModel": "openai/gpt-4.1"}})
    env = env_of(containers(workload_of(external, "env"))[0])
    assert env["SINKFLEX_USER_BASE_URL"]["value"] == "https://llm.example/v1"
    assert env["SINKFLEX_USER_MODEL"]["value"] == "openai/gpt-4.1"
    assert full("user-sim") not in by_kind(external, "Deployment")
    from helm_python import HelmRenderError

    with pytest.raises(HelmRenderError, match="userSim.externalBaseUrl is required"):
        render_chart({"userSim": {"enabled": False}})


# --------------------------------------------------------------------------- availability, security, network

def test_pod_disruption_budgets_cover_every_long_running_component(chart_default):
    pdbs = by_kind(chart_default, "PodDisruptionBudget")
    for w in workloads(chart_default):
        if w["kind"] == "Job":
            continue
        labels = w["spec"]["template"]["metadata"]["labels"]
        matching = [p for p in pdbs.values() if p["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert len(matching) == 1, w["metadata"]["name"]
    assert pdbs[full("learner")]["spec"]["maxUnavailable"] == 0  # one evicted node stops the job
    assert pdbs[full("reward")]["spec"]["maxUnavailable"] == 1


def test_driver_waits_for_every_service(chart_default):
    job = workload_of(chart_default, "train")
    waits = pod_spec(job)["initContainers"]
    assert [w["name"] for w in waits] == ["wait-env", "wait-reward", "wait-rollout", "wait-learner"]
    for w, comp in zip(waits, ("env", "reward", "rollout", "learner")):
        assert w["command"] == ["python", "-m", "sinkflex.healthcheck"]
        assert w["args"] == [f"{full(comp)}:{PORTS[comp][0]}", "--service", HEALTH_SERVICES[comp], "--wait", "7200"]


def test_pods_run_as_non_root(chart_default):
    for w in workloads(chart_default):
        spec = pod_spec(w)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        for c in spec["containers"] + spec.get("initContainers", []):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_network_policies(chart_default):
    policies = by_kind(chart_default, "NetworkPolicy")
    for w in workloads(chart_default):
        if w["kind"] == "Job":
            continue
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert any(p["spec"]["podSelector"]["matchLabels"].items() <= labels.items() for p in policies.values()), w["metadata"]["name"]
    redis_from = {f["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                  for f in policies[full("redis")]["spec"]["ingress"][0]["from"]}
    assert redis_from == {"rollout", "learner", "train"}
    assert policies[full("redis")]["spec"]["ingress"][0]["ports"] == [{"port": 6379, "protocol": "TCP"}]
    learner_rules = policies[full("learner")]["spec"]["ingress"]
    peer_rule = [r for r in learner_rules if "ports" not in r]  # NCCL: every port between learner pods
    assert peer_rule[0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "learner"
    for comp, (grpc_port, metrics_port) in PORTS.items():
        ports = [p["port"] for r in policies[full(comp)]["spec"]["ingress"] for p in r.get("ports", [])]
        assert grpc_port in ports and metrics_port in ports, comp


# --------------------------------------------------------------------------- optional: KEDA, ServiceMonitor

def test_keda_scaled_objects_on_redis_stream_lag(chart_all_optional):
    from sinkflex.buffer import TrajectoryBuffer

    defaults = inspect.signature(TrajectoryBuffer).parameters
    scaled = by_kind(chart_all_optional, "ScaledObject")
    deployments = by_kind(chart_all_optional, "Deployment")
    services = by_kind(chart_all_optional, "Service")
    (auth,) = by_kind(chart_all_optional, "TriggerAuthentication").values()
    assert set(scaled) == {full("rollout"), full("env")}
    for so in scaled.values():
        target = so["spec"]["scaleTargetRef"]
        assert target["kind"] == "Deployment" and target["name"] in deployments
        assert "replicas" not in deployments[target["name"]]["spec"]  # KEDA owns the count
        (trigger,) = so["spec"]["triggers"]
        meta = trigger["metadata"]
        assert trigger["type"] == "redis-streams"
        assert meta["stream"] == defaults["stream"].default
        assert meta["consumerGroup"] == defaults["consumer_group"].default
        host, port = meta["address"].split(":")
        assert int(port) in [p["port"] for p in services[host]["spec"]["ports"]]
        assert int(meta["lagCount"]) > 0
        assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
    (ref,) = auth["spec"]["secretTargetRef"]
    assert ref == {"parameter": "password", "name": full("redis"), "key": "redis-password"}


def test_service_monitor_scrapes_every_metrics_port(chart_all_optional):
    (sm,) = by_kind(chart_all_optional, "ServiceMonitor").values()
    selector = sm["spec"]["selector"]["matchLabels"]
    selected = [s for s in by_kind(chart_all_optional, "Service").values()
                if selector.items() <= s["metadata"]["labels"].items()]
    assert sorted(s["metadata"]["name"] for s in selected) == sorted(full(c) for c in PORTS)
    assert sm["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "30s"}]
    for s in selected:
        assert "metrics" in [p["name"] for p in s["spec"]["ports"]]


def test_gpt_oss_20b_values_render_valid_manifests():
    """charts/sinkflex/values-gpt-oss-20b.yaml (docs/deploy.md): 8-GPU learner, 1-GPU engines."""
    import yaml

    values = yaml.safe_load((CHART / "values-gpt-oss-20b.yaml").read_text())
    manifests = render_chart(values)
    for m in manifests:
        kubernetes_validate.validate(strip(m), KUBE_VERSIONS[-1], strict=True)
    (learner,) = containers(workload_of(manifests, "learner"))
    assert learner["resources"]["requests"]["nvidia.com/gpu"] == 8
    assert env_of(learner)["NPROC_PER_NODE"]["value"] == "8"
    rollout = workload_of(manifests, "rollout")
    assert rollout["spec"]["replicas"] == 1
    assert containers(rollout)[0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    for w in workloads(manifests):
        if w["kind"] != "StatefulSet" or component(w) != "redis":
            for c in containers(w):
                if component(w) != "redis":
                    assert env_of(c)["SINKFLEX_CONFIG"]["value"] == "configs/gpt-oss-20b.yaml", w["metadata"]["name"]


def test_every_sinkflex_container_derives_its_config_from_the_experiment():
    manifests = render_chart({"trainingConfig": "configs/demo.yaml", "policyModel": "/models/my-policy",
                              "configOverrides": {"run": {"steps": 7}}})
    seen = set()
    for w in workloads(manifests):
        comp = component(w)
        if comp == "redis":
            continue
        (c,) = containers(w)
        assert c["command"] == ["sinkflex-service", comp], comp
        env = env_of(c)
        assert env["SINKFLEX_CONFIG"]["value"] == "configs/demo.yaml"
        assert env["SINKFLEX_CONFIG_OVERRIDES"]["value"] == '{"run":{"steps":7}}'
        assert env["SINKFLEX_POLICY"]["value"] == "/models/my-policy"
        assert env["SINKFLEX_RUN_DIR"]["value"] == "/data/run"
        seen.add(comp)
    assert seen == {"env", "reward", "rollout", "learner", "user-sim", "train"}
    # the run folder and the models are on the shared volume for learner, rollout and driver
    for comp in ("rollout", "learner", "train"):
        mounts = {m["mountPath"]: m for m in containers(workload_of(manifests, comp))[0]["volumeMounts"]}
        assert mounts["/data"]["name"] == "shared" and mounts["/models"]["name"] == "shared"


def test_learner_has_time_to_checkpoint_on_sigterm(chart_multigpu):
    """torchrun waits local.learner_stop_grace_s (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, set by
    sinkflex-service from the experiment) before SIGKILL; the pod must wait longer."""
    from sinkflex_rl.config import LocalConfig

    grace = LocalConfig().learner_stop_grace_s
    for name in (full("learner"), full("learner-worker")):
        sts = by_kind(chart_multigpu, "StatefulSet")[name]
        assert pod_spec(sts)["terminationGracePeriodSeconds"] > grace


# --------------------------------------------------------------------------- run preparation (compose's one-shot jobs)

#: The experiment settings compose passes its one-shot jobs (x-sinkflex-env), by name.
_EXPERIMENT_ENV = ("SINKFLEX_CONFIG", "SINKFLEX_CONFIG_OVERRIDES", "SINKFLEX_MAX_STALENESS", "SINKFLEX_TASKS_PER_STEP",
                   "SINKFLEX_RUN_DIR", "SINKFLEX_POLICY", "SINKFLEX_ENV_ADDRESS", "SINKFLEX_REWARD_ADDRESS")
_DEMO_VALUES = {"trainingConfig": "configs/demo.yaml", "configOverrides": {"run": {"steps": 7}}, "tasksPerStep": 4,
                "policyModel": "/models/my-policy"}


def _init(workload: dict) -> dict[str, dict]:
    return {c["name"]: c for c in pod_spec(workload).get("initContainers", [])}


def _mounts(container: dict) -> dict[str, dict]:
    return {m["mountPath"]: m for m in container.get("volumeMounts", [])}


def test_env_and_reward_pods_generate_the_tasks_into_their_own_data_first():
    """compose's `tasks` job (env image, `sinkflex-service tasks`, before env and reward) as the
    first init container of every env and reward pod, writing into the pod's own emptyDir that
    the service then mounts read-only at /data; the pods mount no shared claim."""
    manifests = render_chart(_DEMO_VALUES)
    for comp in ("env", "reward"):
        w = workload_of(manifests, comp)
        spec = pod_spec(w)
        assert [c["name"] for c in spec["initContainers"]] == ["tasks"], comp
        tasks = spec["initContainers"][0]
        (main,) = spec["containers"]
        assert tasks["command"] == ["sinkflex-service", "tasks"] and "args" not in tasks
        assert tasks["image"] == "sinkflex/env:0.1.0", comp  # compose's: the env image
        env, main_env = env_of(tasks), env_of(main)
        for name in _EXPERIMENT_ENV:  # the settings the service itself derives from
            assert env[name] == main_env[name], (comp, name)
        assert env["SINKFLEX_CONFIG"]["value"] == "configs/demo.yaml"
        assert env["SINKFLEX_CONFIG_OVERRIDES"]["value"] == '{"run":{"steps":7}}'
        assert env["SINKFLEX_TASKS_PER_STEP"]["value"] == "4"
        assert env["SINKFLEX_RUN_DIR"]["value"] == "/data/run"
        assert tasks["resources"] == {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
        assert tasks["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                            "readOnlyRootFilesystem": True}
        volumes = {v["name"]: v for v in spec["volumes"]}
        written, read = _mounts(tasks)["/data"], _mounts(main)["/data"]
        assert written == {"name": "data", "mountPath": "/data"}  # writable for the job
        assert read == {"name": "data", "mountPath": "/data", "readOnly": True}  # read-only for the service
        assert volumes["data"] == {"name": "data", "emptyDir": {}}
        assert {"/tmp", "/home/sinkflex"} <= set(_mounts(tasks))  # its read-only root's writable paths
        assert not any("persistentVolumeClaim" in v for v in volumes.values()), comp


def test_learner_node0_prepares_the_run_before_it_starts(chart_multigpu):
    """compose's order (sinkflex_rl/local.py's): tasks, then env and reward SERVING, then the
    warm start, then the learner; on node 0's pod only, on the shared volume."""
    sets = by_kind(chart_multigpu, "StatefulSet")
    master, worker = sets[full("learner")], sets[full("learner-worker")]
    init = _init(master)
    assert list(init) == ["tasks", "wait-env", "wait-reward", "warm-start"]
    assert "initContainers" not in pod_spec(worker)  # workers wait in torchrun's rendezvous
    (learner,) = containers(master)
    tasks, warm = init["tasks"], init["warm-start"]
    # tasks: onto the shared volume the learner, its warm start and the driver read
    assert tasks["command"] == ["sinkflex-service", "tasks"] and tasks["image"] == "sinkflex/env:0.1.0"
    assert _mounts(tasks)["/data"] == {"name": "shared", "mountPath": "/data", "subPath": "data"} == _mounts(learner)["/data"]
    # the waits: env's and reward's gRPC health, as the driver's
    for comp in ("env", "reward"):
        wait = init[f"wait-{comp}"]
        assert wait["command"] == ["python", "-m", "sinkflex.healthcheck"]
        assert wait["args"] == [f"{full(comp)}:{PORTS[comp][0]}", "--service", HEALTH_SERVICES[comp], "--wait", "1800"]
    # warm-start: the learner image, no GPU, the learner's run folder, models and experiment
    assert warm["command"] == ["sinkflex-service", "warm-start"] and "args" not in warm
    assert warm["image"] == learner["image"] == "sinkflex/learner:0.1.0"
    assert warm["resources"] == {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}
    for c in init.values():
        assert "nvidia.com/gpu" not in str(c["resources"]), c["name"]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
    for path in ("/data", "/models"):
        assert _mounts(warm)[path] == _mounts(learner)[path], path
    env, learner_env = env_of(warm), env_of(learner)
    for name in (*_EXPERIMENT_ENV, "HF_HOME", "HF_TOKEN"):
        assert env[name] == learner_env[name], name
    assert env["SINKFLEX_ENV_ADDRESS"]["value"] == f"{full('env')}:{PORTS['env'][0]}"
    assert env["SINKFLEX_REWARD_ADDRESS"]["value"] == f"{full('reward')}:{PORTS['reward'][0]}"
    assert not any(k.startswith("REDIS") for k in env)  # it never touches the buffer
    # the driver, which reads the shared tasks, starts after the learner reports SERVING
    assert [c["name"] for c in pod_spec(workload_of(chart_multigpu, "train"))["initContainers"]][-1] == "wait-learner"


def test_the_chart_runs_composes_one_shot_jobs_as_compose_runs_them(compose, chart_default):
    """Same entry point and every SINKFLEX_* setting compose gives `tasks` and `warm-start`
    (the warm start also the Hugging Face cache where the learner has it)."""
    init = {**_init(workload_of(chart_default, "env")), **_init(workload_of(chart_default, "learner"))}
    for job in ("tasks", "warm-start"):
        svc = compose["services"][job]
        assert init[job]["command"] == svc["entrypoint"] and svc["command"] == [] and "args" not in init[job]
        wanted = {k for k in svc["environment"] if k.startswith("SINKFLEX_")}
        if job == "warm-start":
            wanted.add("HF_HOME")
        assert wanted - set(env_of(init[job])) == set(), job
        assert env_of(init[job])["SINKFLEX_RUN_DIR"]["value"] == svc["environment"]["SINKFLEX_RUN_DIR"] == "/data/run"


def test_run_preparation_can_be_turned_off():
    no_tasks = render_chart({"tasks": {"enabled": False}})
    for comp in ("env", "reward"):
        spec = pod_spec(workload_of(no_tasks, comp))
        assert "initContainers" not in spec
        assert "data" not in {v["name"] for v in spec["volumes"]}
        assert "/data" not in _mounts(spec["containers"][0])
    assert list(_init(workload_of(no_tasks, "learner"))) == ["wait-env", "wait-reward", "warm-start"]
    no_warm = render_chart({"warmStart": {"enabled": False}})
    assert list(_init(workload_of(no_warm, "learner"))) == ["tasks"]
    assert list(_init(workload_of(no_warm, "env"))) == ["tasks"]
    neither = render_chart({"tasks": {"enabled": False}, "warmStart": {"enabled": False}})
    assert "initContainers" not in pod_spec(workload_of(neither, "learner"))
    # nothing left to mount in env with a writable root, no TLS and no tasks
    bare = render_chart({"tasks": {"enabled": False}, "readOnlyRootFilesystem": False})
    assert "volumes" not in pod_spec(workload_of(bare, "env"))


def test_tasks_init_containers_write_the_same_folder_in_every_pod(tmp_path):
    """Why env and reward may generate their own copy: what each pod's `tasks` init container
    runs (its command and environment as rendered, /data a folder of its own here) writes
    byte-identical task folders in env's, reward's and the learner's pods, and env's service
    config then lists its own copy."""
    import yaml

    manifests = render_chart(_DEMO_VALUES)
    folders = []
    for comp in ("env", "reward", "learner"):
        tasks = _init(workload_of(manifests, comp))["tasks"]
        data = tmp_path / comp / "data"
        environ = {k: v["value"].replace("/data", str(data)) for k, v in env_of(tasks).items() if "value" in v}
        run = [sys.executable, str(DOCKER / "sinkflex_service.py"), *tasks["command"][1:]]
        base = {k: v for k, v in os.environ.items() if not k.startswith("SINKFLEX_")}
        proc = subprocess.run(run, env={**base, **environ}, cwd=ROOT, capture_output=True, text=True, timeout=120,
                              check=False)
        assert proc.returncode == 0, proc.stderr
        folder = data / "run" / "tasks"
        assert proc.stdout.strip() == f"tasks: {folder} ready (256 train + 64 test)"
        folders.append(folder)
        if comp == "env":  # what the env service then reads
            main = {k: v["value"].replace("/data", str(data)) for k, v in env_of(containers(workload_of(manifests, comp))[0]).items()
                    if "value" in v}
            dry = subprocess.run([sys.executable, str(DOCKER / "sinkflex_service.py"), "env", "--dry-run"],
                                 env={**base, **main, "SINKFLEX_CONFIG_DIR": str(tmp_path / "derived")}, cwd=ROOT,
                                 capture_output=True, text=True, timeout=120, check=False)
            assert dry.returncode == 0, dry.stderr
            derived = yaml.safe_load(Path(json.loads(dry.stdout)["config"]).read_text())
            assert derived["task_files"] == {"mock": [str(folder)]}
    names = sorted(p.name for p in folders[0].iterdir())
    assert names == ["generate.json", "split_tasks.json", "tasks.json"]
    for other in folders[1:]:
        assert sorted(p.name for p in other.iterdir()) == names
        for name in names:
            assert (other / name).read_bytes() == (folders[0] / name).read_bytes(), (other, name)
    assert len(json.loads((folders[0] / "tasks.json").read_text())) == 320
