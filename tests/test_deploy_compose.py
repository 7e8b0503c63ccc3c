"""docker-compose.yml: the compose specification's JSON schema, GPU reservations,
profiles, ports and wiring — and that it agrees with the Helm chart and the configs.

No Docker engine here: the file is validated against the compose-spec schema vendored by
check-jsonschema, and its wiring is checked the way compose resolves it (service names
and network aliases on the project network, `${VAR:-default}` interpolation).
"""

from __future__ import annotations

import copy
import json
import re
from importlib import resources

import jsonschema
import pytest

from tests.fixtures.deploy import (
    PORTS,
    ROOT,
    by_kind,
    full,
    interpolate_defaults,
    workloads,
)

GPU_SERVICES = {"user-sim", "rollout", "learner"}
CPU_TWINS = {"user-sim-cpu": "user-sim", "rollout-cpu": "rollout", "learner-cpu": "learner", "train-cpu": "train",
             "warm-start-cpu": "warm-start"}
SHARED = {"redis", "env", "reward", "tasks"}
#: one-shot jobs: the generated tasks (shared), the warm start's demonstrations (per stack, no GPU)
JOBS = {"tasks", "warm-start", "warm-start-cpu"}


@pytest.fixture(scope="module")
def compose_schema() -> dict:
    ref = resources.files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json")
    return json.loads(ref.read_text())


def _interpolated(node):
    if isinstance(node, str):
        return interpolate_defaults(node)
    if isinstance(node, list):
        return [_interpolated(x) for x in node]
    if isinstance(node, dict):
        return {k: _interpolated(v) for k, v in node.items()}
    return node


def active(compose: dict, profiles: set[str]) -> dict[str, dict]:
    """Services compose enables with `profiles` active (no `profiles:` = always)."""
    return {n: s for n, s in compose["services"].items() if not s.get("profiles") or set(s["profiles"]) & profiles}


def started(compose: dict, targets: list[str], profiles: set[str]) -> dict[str, dict]:
    """Services `docker compose [--profile P] up TARGETS` starts: the targets and their depends_on, transitively."""
    enabled = active(compose, profiles)
    todo, out = list(targets), {}
    while todo:
        name = todo.pop()
        assert name in enabled, f"{name} is not enabled with profiles {profiles}"
        if name not in out:
            out[name] = enabled[name]
            todo.extend(enabled[name].get("depends_on", {}))
    return out


def listen_port(name: str, svc: dict) -> int:
    cmd = [interpolate_defaults(c) for c in svc.get("command", [])]
    if "--port" in cmd:
        return int(cmd[cmd.index("--port") + 1])
    if interpolate_defaults(svc["image"]).startswith("redis"):
        return 6379
    raise AssertionError(f"{name}: no --port in its command")


def hostnames(name: str, svc: dict) -> set[str]:
    aliases = (svc.get("networks") or {}).get("default", {}) or {}
    return {name, *aliases.get("aliases", [])}


# --------------------------------------------------------------------------- schema

def test_compose_validates_against_the_compose_spec(compose, compose_schema):
    validator = jsonschema.Draft202012Validator(compose_schema)
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(compose)]
    assert errors == []
    # and with every ${VAR:-default} replaced by its default (what `docker compose config` sees)
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(_interpolated(compose))]
    assert errors == []


def test_schema_catches_a_broken_gpu_reservation(compose, compose_schema):
    broken = copy.deepcopy(compose)
    del broken["services"]["rollout"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"]
    with pytest.raises(jsonschema.ValidationError, match="capabilities"):
        jsonschema.validate(broken, compose_schema)
    broken = copy.deepcopy(compose)
    broken["services"]["env"]["healthcheck"]["retry"] = 3  # misspelt key
    with pytest.raises(jsonschema.ValidationError, match="retry"):
        jsonschema.validate(broken, compose_schema)


# --------------------------------------------------------------------------- profiles and GPUs

def test_default_stack_is_the_gpu_stack_and_cpu_profile_has_twins(compose):
    default = active(compose, set())
    assert set(default) == SHARED | GPU_SERVICES | {"train", "warm-start"}
    for name in SHARED | GPU_SERVICES | {"train", "warm-start"}:
        assert "profiles" not in compose["services"][name], name
    for twin in CPU_TWINS:
        assert compose["services"][twin]["profiles"] == ["cpu"]
    # `docker compose --profile cpu up train-cpu` starts the CPU stack and nothing that needs a GPU
    cpu_run = started(compose, ["train-cpu"], {"cpu"})
    assert set(cpu_run) == SHARED | set(CPU_TWINS)
    gpu_run = started(compose, ["train"], set())
    assert set(gpu_run) == SHARED | GPU_SERVICES | {"train", "warm-start"}


def test_one_shot_jobs_prepare_the_run_folder_before_the_services_that_read_it(compose):
    """tasks before env and reward, warm-start after them and before the learner (sinkflex_rl/local.py's order)."""
    s = compose["services"]
    done = {"condition": "service_completed_successfully"}
    healthy = {"condition": "service_healthy"}
    for name in JOBS:
        job = s[name]
        assert job["restart"] == "no" and job["healthcheck"] == {"disable": True}, name
        assert job["entrypoint"][:1] == ["sinkflex-service"] and job["command"] == [], name
        assert any(v.startswith("data:/data") and not v.endswith(":ro") for v in job["volumes"]), name
        assert job["read_only"] is True and job["cap_drop"] == ["ALL"], name
    assert s["tasks"]["entrypoint"] == ["sinkflex-service", "tasks"]
    for name in ("env", "reward"):
        assert s[name]["depends_on"]["tasks"] == done
        assert s[name]["volumes"] == ["data:/data:ro"]  # they read the generated tasks, write nothing there
    for job, learner in (("warm-start", "learner"), ("warm-start-cpu", "learner-cpu")):
        assert s[job]["entrypoint"] == ["sinkflex-service", "warm-start"]
        assert s[job]["depends_on"] == {"env": healthy, "reward": healthy}
        assert s[job]["image"] == s[learner]["image"]  # the policy's tokenizer is prepared there
        assert s[learner]["depends_on"][job] == done


def test_gpu_reservations(compose):
    for name, svc in compose["services"].items():
        devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        if name in GPU_SERVICES:
            (dev,) = devices
            assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"], name
            assert re.fullmatch(r"\$\{[A-Z_]+_GPUS:-[0-9,]+\}", dev["device_ids"][0]), name
        else:
            assert devices == [], f"{name} reserves a GPU"
    # the three GPU services get different GPUs by default
    ids = [interpolate_defaults(compose["services"][n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"][0])
           for n in sorted(GPU_SERVICES)]
    assert len(set(ids)) == 3
    # NCCL and vLLM workers need shared memory
    assert compose["services"]["learner"]["ipc"] == "host"
    assert compose["services"]["rollout"]["ipc"] == "host"


# --------------------------------------------------------------------------- ports and wiring

@pytest.mark.parametrize("name", ["env", "reward", "rollout", "learner", "rollout-cpu", "learner-cpu"])
def test_service_ports_follow_the_project_table_and_the_chart(name, compose, chart_default):
    svc = compose["services"][name]
    comp = CPU_TWINS.get(name, name)
    grpc_port, metrics_port = PORTS[comp]
    cmd = [interpolate_defaults(c) for c in svc["command"]]
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
    assert int(cmd[cmd.index("--port") + 1]) == grpc_port
    assert int(cmd[cmd.index("--metrics-port") + 1]) == metrics_port
    if "ports" in svc:
        ports = [interpolate_defaults(p) for p in svc["ports"]]
        assert f"127.0.0.1:{grpc_port}:{grpc_port}" in ports and f"127.0.0.1:{metrics_port}:{metrics_port}" in ports
    # the chart's Service for the same component exposes the same ports
    chart_ports = {p["name"]: p["port"] for p in by_kind(chart_default, "Service")[full(comp)]["spec"]["ports"]}
    assert chart_ports == {"grpc": grpc_port, "metrics": metrics_port}


_HOSTPORT = re.compile(r"(?:[a-z]+://(?:[^@/]*@)?)?([a-z][a-z0-9-]*):(\d+)(?:/\S*)?$")


@pytest.mark.parametrize("targets,profiles", [(["train"], set()), (["train-cpu"], {"cpu"})], ids=["gpu", "cpu"])
def test_every_address_resolves_to_a_started_service_and_its_port(targets, profiles, compose):
    run = started(compose, targets, profiles)
    # user-sim is not a depends_on of env (env loads without it), so add the stack's model server
    run.update({n: s for n, s in active(compose, profiles).items()
                if "user-sim" in hostnames(n, s) and (n in CPU_TWINS) == bool(profiles)})
    names = {h: (n, s) for n, s in run.items() for h in hostnames(n, s)}
    checked = 0
    for name, svc in run.items():
        values = [interpolate_defaults(c) for c in svc.get("command", [])]
        values += [interpolate_defaults(str(v)) for v in (svc.get("environment") or {}).values()]
        for value in values:
            m = _HOSTPORT.fullmatch(value)
            if not m or m.group(1) in ("localhost",):
                continue
            host, port = m.group(1), int(m.group(2))
            assert host in names, f"{name}: {value!r} names no started service or alias"
            target_name, target = names[host]
            assert port == listen_port(target_name, target), f"{name}: {value!r} but {target_name} listens elsewhere"
            checked += 1
    assert checked >= 8


def test_depends_on_waits_for_health(compose):
    for name, svc in compose["services"].items():
        for dep, cond in svc.get("depends_on", {}).items():
            if dep in JOBS:  # a one-shot job: waited for until it exits 0
                assert cond == {"condition": "service_completed_successfully"}, (name, dep)
                continue
            assert cond == {"condition": "service_healthy"}, (name, dep)
            assert "healthcheck" in compose["services"][dep], f"{name} waits on {dep}, which has no healthcheck"
            # a service never waits on one of another profile
            assert compose["services"][dep].get("profiles", []) in ([], svc.get("profiles", [])), (name, dep)


def test_healthchecks_probe_the_grpc_port_the_service_listens_on(compose):
    for name, svc in compose["services"].items():
        if name in ("redis", "train", "train-cpu") or "user-sim" in name or name in JOBS:
            continue
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD-SHELL" and "python -m sinkflex.healthcheck" in test[1], name
        assert "$${SINKFLEX_GRPC_PORT}" in test[1], name
        dockerfile = ROOT / svc["build"]["dockerfile"] if "build" in svc else None
        assert dockerfile and dockerfile.is_file(), name
        image_port = re.search(r"SINKFLEX_GRPC_PORT=(\d+)", dockerfile.read_text()).group(1)
        assert int(image_port) == listen_port(name, svc), f"{name}: image checks {image_port}"


def test_images_are_built_here_and_shared_with_the_chart(compose, chart_default):
    built = {s["image"]: s["build"] for s in compose["services"].values() if "build" in s}
    for name, svc in compose["services"].items():
        image = svc["image"]
        if name == "redis":
            continue
        assert image in built, f"{name} uses {image}, which no service builds"
        assert (ROOT / built[image]["dockerfile"]).is_file()
    chart_repos = {c["image"].rsplit(":", 1)[0] for w in workloads(chart_default)
                   for c in w["spec"]["template"]["spec"]["containers"]}
    compose_repos = {i.rsplit(":", 1)[0] for i in built}
    assert chart_repos - {"redis"} == compose_repos
    # Redis: the registry image unless REDIS_IMAGE names another (scripts/build_images.sh's)
    assert compose["services"]["redis"]["image"] == "${REDIS_IMAGE:-redis:7.4-alpine}"
    assert any(c["image"] == "redis:7.4-alpine" for w in workloads(chart_default) for c in w["spec"]["template"]["spec"]["containers"])


def test_same_experiment_models_and_user_simulator_as_the_chart(compose, chart_default):
    """compose and the chart start every service from the same experiment, the same way."""
    import yaml

    values = yaml.safe_load((ROOT / "charts" / "sinkflex" / "values.yaml").read_text())
    chart_env = {}
    for w in workloads(chart_default):
        for c in w["spec"]["template"]["spec"]["containers"]:
            chart_env[w["metadata"]["labels"]["app.kubernetes.io/component"]] = {
                e["name"]: e.get("value") for e in c.get("env", [])}
    for name, svc in compose["services"].items():
        if name == "redis":
            continue
        comp = CPU_TWINS.get(name, name)
        env = {k: interpolate_defaults(str(v)) for k, v in svc["environment"].items()}
        # the same entry point: sinkflex-service <component> (the image's ENTRYPOINT or the override)
        entry = svc.get("entrypoint") or _image_entrypoint(svc)
        assert entry == ["sinkflex-service", comp], name
        if name in JOBS:  # compose's one-shot jobs have no chart twin yet (docs/deploy.md): same experiment, run folder
            assert env["SINKFLEX_CONFIG"] == values["trainingConfig"] and env["SINKFLEX_RUN_DIR"] == "/data/run", name
            continue
        assert env["SINKFLEX_CONFIG"] == values["trainingConfig"] == chart_env[comp]["SINKFLEX_CONFIG"], name
        assert env["SINKFLEX_POLICY"] == values["policyModel"] == chart_env[comp]["SINKFLEX_POLICY"] == "", name
        assert env["SINKFLEX_RUN_DIR"] == chart_env[comp]["SINKFLEX_RUN_DIR"] == "/data/run", name
        assert env["SINKFLEX_USER_MODEL"] == f"openai/{values['userSim']['servedModelName']}" == chart_env[comp]["SINKFLEX_USER_MODEL"]
    for sim in ("user-sim", "user-sim-cpu"):
        cmd = compose["services"][sim]["command"]
        assert cmd[cmd.index("--served-model-name") + 1] == values["userSim"]["servedModelName"]


def _image_entrypoint(svc: dict) -> list[str]:
    from tests.fixtures.deploy import dockerfile_instructions, exec_form

    path = ROOT / svc["build"]["dockerfile"]
    (entry,) = [a for i, a in dockerfile_instructions(path) if i == "ENTRYPOINT"]
    return exec_form(entry)


def test_training_config_paths_exist(compose):
    """Every config the deployment runs (compose's default, the chart's) is in configs/."""
    import yaml

    values = yaml.safe_load((ROOT / "charts" / "sinkflex" / "values.yaml").read_text())
    referenced = [(values["trainingConfig"], "charts/sinkflex/values.yaml trainingConfig")]
    for name, svc in compose["services"].items():
        if "SINKFLEX_CONFIG" in (svc.get("environment") or {}):
            referenced.append((interpolate_defaults(svc["environment"]["SINKFLEX_CONFIG"]), f"docker-compose.yml {name}"))
    for dockerfile in sorted((ROOT / "docker").glob("*.Dockerfile")):
        for cfg in re.findall(r"SINKFLEX_CONFIG=(\S+)", dockerfile.read_text()):
            referenced.append((cfg, f"{dockerfile.relative_to(ROOT)} ENV"))
    for example in sorted((ROOT / "charts" / "sinkflex").glob("values-*.yaml")):
        cfg = (yaml.safe_load(example.read_text()) or {}).get("trainingConfig")
        if cfg:
            referenced.append((cfg, str(example.relative_to(ROOT))))
    assert len(referenced) >= 12
    missing = sorted({(p, where.split(" ")[0]) for p, where in referenced if not (ROOT / p).is_file()})
    assert not missing, "configs referenced by the deployment do not exist yet: " + ", ".join(
        f"{p} (from {w})" for p, w in missing)


def test_learner_has_time_to_checkpoint_on_stop(compose):
    from sinkflex_rl.config import LocalConfig

    grace = LocalConfig().learner_stop_grace_s
    for name in ("learner", "learner-cpu"):
        period = compose["services"][name]["stop_grace_period"]
        assert period.endswith("s") and int(period[:-1]) > grace, name


# --------------------------------------------------------------------------- least privilege

def test_every_service_drops_all_capabilities_and_privilege_escalation(compose):
    for name, svc in compose["services"].items():
        assert svc.get("cap_drop") == ["ALL"], name
        assert "no-new-privileges:true" in svc.get("security_opt", []), name
        assert not svc.get("cap_add") and not svc.get("privileged"), name
    # Redis starts as its own user: the registry image's entrypoint would need SETUID/SETGID
    # to drop from root, and every capability is dropped
    assert compose["services"]["redis"]["user"] == "999:999"


def test_published_ports_bind_to_loopback_unless_the_user_opts_in(compose):
    published = 0
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            assert port.startswith("${PUBLISH_ADDRESS:-127.0.0.1}:"), (name, port)
            host, _, _ = interpolate_defaults(port).split(":")
            assert host == "127.0.0.1", (name, port)
            published += 1
    assert published >= 9
