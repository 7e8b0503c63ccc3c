"""Every command, flag and config the deployment runs exists in the project.

- `sinkflex-service` (docker/sinkflex_service.py), the entry point of every image, derives
  each service's config from the experiment file the way the embedded default's launcher
  does; its output is loaded back with each service's own config model.
- Every flag passed by the Dockerfiles (CMD), docker-compose.yml (command) and the chart
  (args) is one that the real command lists in its `--help` (argparse or typer), or, for the
  user simulator, one of vLLM's own server arguments.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rollout_service.engine import resolve_engine_dtype

from tests.fixtures.deploy import (
    COMPOSE,
    DOCKER,
    ROOT,
    cli_flags,
    cli_help,
    deploy_environ,
    dockerfile_instructions,
    exec_form,
    flags_used,
    render_chart,
    vllm_serve_flags,
    workloads,
)

#: `sinkflex-service X` runs this command (whose --help lists the flags it takes).
SERVICE_CLI = {
    "env": "env_service",
    "reward": "reward_service",
    "rollout": "rollout_service",
    "learner": "learner_service",
    "train": "sinkflex-rl train",
}


# --------------------------------------------------------------------------- sinkflex-service

def test_service_configs_are_the_launchers_with_the_deployment_addresses(script, experiment, tmp_path):
    from sinkflex_rl.config import TrainConfig
    from env_service.config import EnvServiceConfig
    from learner_service.config import LearnerConfig
    from reward_service.config import RewardServiceConfig
    from rollout_service.config import RolloutConfig
    from sinkflex.config import load_config

    environ = deploy_environ(experiment, tmp_path)
    policy = environ["SINKFLEX_POLICY"]
    argv, path = script.derive("env", environ)
    assert argv == [sys.executable, "-m", "env_service", "--config", str(path)]
    env = load_config(path, EnvServiceConfig)
    assert env.domains == ("retail",)
    assert (env.user_base_url, env.user_model) == ("http://sf-user-sim:8000/v1", "openai/user-sim")

    argv, path = script.derive("reward", environ)
    assert argv[1:4] == ["-m", "reward_service", "--config"]
    load_config(path, RewardServiceConfig)

    argv, path = script.derive("rollout", environ)
    assert argv[1:4] == ["-m", "rollout_service", "--config"]
    rollout = load_config(path, RolloutConfig)
    assert (rollout.env_address, rollout.reward_address) == ("sf-env:50051", "sf-reward:50052")
    assert rollout.redis_url == "redis://:pw@sf-redis:6379/0"
    assert rollout.engine.model == policy
    assert (rollout.agent.temperature, rollout.agent.max_turns) == (0.9, 6)

    argv, path = script.derive("learner", environ)
    assert argv == ["sinkflex-learner", "--config", str(path)]
    # torchrun waits the experiment's learner_stop_grace_s for the checkpoint on SIGTERM
    assert environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "600"
    learner = load_config(path, LearnerConfig)
    assert learner.rollout_address == "sf-rollout:50053"
    assert learner.buffer.url == "redis://:pw@sf-redis:6379/0"
    assert learner.model.path == policy
    assert learner.run_dir == "/data/run/learner"
    assert (learner.grpo.temperature, learner.batch.groups_per_step) == (0.9, 2)

    argv, path = script.derive("train", environ)
    assert argv == ["sinkflex-rl", "train", "-c", str(path)]
    train = load_config(path, TrainConfig)
    assert train.services.external()
    assert (train.services.env_address, train.services.learner_address) == ("sf-env:50051", "sf-learner:50054")
    assert train.run.output_dir == "/data/run" and train.rollout.group_size == 4

    argv, path = script.derive("user-sim", environ)
    # the engine's dtype rule (vLLM CPU's own default is bf16 on every CPU, emulated where it is slow)
    assert argv == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", policy,
                    "--dtype", resolve_engine_dtype("auto"), "--seed", "0"]
    assert resolve_engine_dtype("auto") in ("bfloat16", "float32")  # no GPU here
    assert path is None
    # without a GPU, the launcher's cores (local.user_sim_cpu_threads_bind): every core, or the last one alone
    import os

    cores = sorted(os.sched_getaffinity(0))
    unset = {k: v for k, v in environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}  # what derive set above
    cpu = {**unset, "CUDA_VISIBLE_DEVICES": ""}
    script.derive("user-sim", cpu)
    assert cpu["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, cores))
    last = {**unset, "CUDA_VISIBLE_DEVICES": "",
            "SINKFLEX_CONFIG_OVERRIDES": json.dumps({"local": {"user_sim_cpu_threads_bind": "last"}})}
    script.derive("user-sim", last)
    assert last["VLLM_CPU_OMP_THREADS_BIND"] == str(cores[-1])


def test_overrides_and_errors(script, experiment, tmp_path):
    from learner_service.config import LearnerConfig
    from sinkflex.config import ConfigError, load_config

    environ = deploy_environ(experiment, tmp_path, SINKFLEX_CONFIG_OVERRIDES=json.dumps(
        {"run": {"steps": 9}, "learner_service": {"optim": {"lr": 3e-6}}}))
    _, path = script.derive("learner", environ)
    learner = load_config(path, LearnerConfig)
    assert learner.optim.lr == 3e-6 and learner.optim.total_steps == 9
    with pytest.raises(ValueError, match="SINKFLEX_CONFIG_OVERRIDES is not JSON"):
        script.derive("learner", {**environ, "SINKFLEX_CONFIG_OVERRIDES": "{run: 1"})
    with pytest.raises(ConfigError, match="run.steps"):
        script.derive("learner", {**environ, "SINKFLEX_CONFIG_OVERRIDES": '{"run": {"steps": 0}}'})
    with pytest.raises(ConfigError, match="missing: learner_address"):
        script.derive("train", {k: v for k, v in environ.items() if k != "SINKFLEX_LEARNER_ADDRESS"})
    with pytest.raises(ValueError, match="unknown service 'gateway'"):
        script.derive("gateway", environ)
    with pytest.raises(ConfigError, match="config file not found"):
        script.derive("env", {**environ, "SINKFLEX_CONFIG": str(tmp_path / "nope.yaml")})


def test_dry_run_cli_and_light_images_start_without_torch(experiment, tmp_path):
    """The env and reward images have no torch, transformers or vLLM: their start-up path
    never imports them (the modules are made unimportable in the child)."""
    environ = deploy_environ(experiment, tmp_path)
    code = ("import sys, runpy\n"
            "for m in ('torch', 'transformers', 'vllm', 'gguf', 'accelerate'): sys.modules[m] = None\n"
            f"sys.argv = [{str(DOCKER / 'sinkflex_service.py')!r}] + sys.argv[1:]\n"
            f"runpy.run_path({str(DOCKER / 'sinkflex_service.py')!r}, run_name='__main__')\n")
    for service, module in (("env", "env_service"), ("reward", "reward_service")):
        proc = subprocess.run([sys.executable, "-c", code, service, "--dry-run", "--port", "50051"],
                              capture_output=True, text=True, env={**environ, "PATH": "/usr/bin:/bin"}, timeout=120, cwd=ROOT, check=False)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out["argv"][1:3] == ["-m", module] and out["argv"][-2:] == ["--port", "50051"]
        assert Path(out["config"]).is_file()
    bad = subprocess.run([sys.executable, str(DOCKER / "sinkflex_service.py"), "env"], capture_output=True, text=True,
                         env={**environ, "SINKFLEX_CONFIG": "missing.yaml"}, timeout=120, cwd=ROOT, check=False)
    assert bad.returncode == 2 and "config file not found: missing.yaml" in bad.stderr


def referenced_experiments() -> list[str]:
    values = yaml.safe_load((ROOT / "charts" / "sinkflex" / "values.yaml").read_text())
    found = {values["trainingConfig"]}
    for example in (ROOT / "charts" / "sinkflex").glob("values-*.yaml"):
        found.add(yaml.safe_load(example.read_text()).get("trainingConfig") or values["trainingConfig"])
    return sorted(found)


@pytest.mark.parametrize("config", referenced_experiments())
def test_the_deployments_experiments_derive_every_service(config, script, tmp_path):
    path = ROOT / config
    if not path.is_file():
        pytest.fail(f"{config} is referenced by the deployment but does not exist yet")
    environ = deploy_environ(path, tmp_path)
    environ["SINKFLEX_CONFIG"] = config
    for service in ("env", "reward", "rollout", "learner", "train", "user-sim"):
        argv, _ = script.derive(service, environ)
        assert argv


# --------------------------------------------------------------------------- flags

def _dockerfile_usages() -> list[tuple[str, str, list[str]]]:
    out = []
    for dockerfile in sorted(DOCKER.glob("*.Dockerfile")):
        ins = dockerfile_instructions(dockerfile)
        entry = exec_form(next(a for i, a in ins if i == "ENTRYPOINT"))
        cmd = exec_form(next(a for i, a in ins if i == "CMD"))
        out.append((f"{dockerfile.name} CMD", entry[1], cmd))
    return out


def _compose_usages() -> list[tuple[str, str, list[str]]]:
    compose = yaml.safe_load(COMPOSE.read_text())
    out = []
    for name, svc in compose["services"].items():
        if name == "redis":
            continue
        entry = svc.get("entrypoint")
        if entry is None:
            ins = dockerfile_instructions(ROOT / svc["build"]["dockerfile"])
            entry = exec_form(next(a for i, a in ins if i == "ENTRYPOINT"))
        assert entry[0] == "sinkflex-service", name
        out.append((f"docker-compose.yml {name}", entry[1], list(svc.get("command", []))))
    return out


def _chart_usages() -> list[tuple[str, str, list[str]]]:
    values = yaml.safe_load((ROOT / "charts" / "sinkflex" / "values-gpt-oss-20b.yaml").read_text())
    out = []
    for manifests, label in ((render_chart(), "chart"), (render_chart(values), "chart gpt-oss-20b")):
        for w in workloads(manifests):
            spec = w["spec"]["template"]["spec"]
            for c in spec["containers"] + spec.get("initContainers", []):  # init: the one-shot jobs
                if c.get("command", [""])[0] == "sinkflex-service":
                    out.append((f"{label} {w['metadata']['name']}", c["command"][1], c.get("args", [])))
    return out


@pytest.fixture(scope="module")
def usages(all_cli_help) -> list[tuple[str, str, list[str]]]:
    return _dockerfile_usages() + _compose_usages() + _chart_usages()


def test_usages_cover_every_component(usages):
    assert {u[1] for u in usages} == {"env", "reward", "rollout", "learner", "train", "user-sim", "tasks", "warm-start"}
    # the one-shot jobs take no flags (sinkflex-service refuses any)
    assert all(args == [] for _, comp, args in usages if comp in ("tasks", "warm-start"))
    assert {u[0].split(" ")[0] for u in usages} >= {"env.Dockerfile", "docker-compose.yml", "chart"}
    # the chart runs both one-shot jobs too (init containers), with the same command as compose
    assert {u[1] for u in usages if u[0].startswith("chart ")} >= {"tasks", "warm-start"}


@pytest.mark.parametrize("component", ["env", "reward", "rollout", "learner", "train"])
def test_every_flag_is_one_the_service_takes(component, usages):
    known = cli_flags(SERVICE_CLI[component])
    assert "--config" in known or "-c" in known  # sinkflex-service passes the derived config
    unknown = sorted({(where, f) for where, comp, args in usages if comp == component
                      for f in flags_used(args) if f not in known})
    assert not unknown, f"`{SERVICE_CLI[component]}` does not take: " + "; ".join(f"{f} ({w})" for w, f in unknown)


def test_user_simulator_flags_are_vllm_server_arguments(usages):
    known = vllm_serve_flags()
    assert {"--model", "--served-model-name", "--port", "--tensor-parallel-size"} <= known
    unknown = sorted({(where, f) for where, comp, args in usages if comp == "user-sim"
                      for f in flags_used(args) if f not in known})
    assert not unknown, unknown
    # the module sinkflex-service user-sim runs (located without importing vLLM)
    vllm_dir = Path(importlib.util.find_spec("vllm").origin).parent
    assert (vllm_dir / "entrypoints" / "openai" / "api_server.py").is_file()


def test_build_time_commands_exist(all_cli_help):
    """`sinkflex-rl models prepare smollm2` (CPU images) and the healthcheck module."""
    runs = " ".join(a for d in DOCKER.glob("*.Dockerfile") for i, a in dockerfile_instructions(d) if i == "RUN")
    assert "sinkflex-rl models prepare smollm2" in runs
    code, text = cli_help("sinkflex-rl models prepare")
    assert code == 0 and "smollm2" in text, text
    from sinkflex.models import KNOWN_MODELS

    assert "smollm2" in KNOWN_MODELS
    known = cli_flags("sinkflex.healthcheck")
    assert {"--service", "--timeout", "--wait"} <= known
    # the chart's init containers that wait for services (the driver's, the warm start's); the
    # others run sinkflex-service's one-shot jobs (_chart_usages, test_usages_cover_every_component)
    for w in workloads(render_chart()):
        for c in w["spec"]["template"]["spec"].get("initContainers", []):
            if c["command"][0] == "sinkflex-service":
                continue
            assert c["command"] == ["python", "-m", "sinkflex.healthcheck"]
            assert set(flags_used(c["args"])) <= known, c["args"]
    assert re.search(r"\bsinkflex-rl\b", (ROOT / "pyproject.toml").read_text())  # the console script


def test_the_reward_image_entry_point_serves_grpc_health_and_metrics(tmp_path):
    """What the reward container runs — `sinkflex-service reward --host H --port P
    --metrics-port M` on the experiment its image names — started for real: the service
    reports SERVING to `python -m sinkflex.healthcheck` (the image's HEALTHCHECK) and serves
    Prometheus metrics; SIGTERM stops it."""
    import signal
    import socket
    import urllib.request

    from sinkflex_rl.launcher import free_port

    port, metrics_port = free_port(), free_port()
    image_config = re.search(r"SINKFLEX_CONFIG=(\S+)", (DOCKER / "reward.Dockerfile").read_text()).group(1)
    config = image_config if (ROOT / image_config).is_file() else "configs/demo.yaml"
    env = {**{k: v for k, v in __import__("os").environ.items() if not k.startswith("SINKFLEX_")},
           "SINKFLEX_CONFIG": config, "SINKFLEX_CONFIG_DIR": str(tmp_path), "SINKFLEX_GRPC_PORT": str(port)}
    proc = subprocess.Popen([sys.executable, str(DOCKER / "sinkflex_service.py"), "reward", "--host", "127.0.0.1",
                             "--port", str(port), "--metrics-port", str(metrics_port)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        health = subprocess.run([sys.executable, "-m", "sinkflex.healthcheck", f"127.0.0.1:{port}",
                                 "--service", "sinkflex.api.reward.v1.RewardService", "--wait", "240"],
                                capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
        assert health.returncode == 0, health.stderr + (proc.stdout.read() if proc.poll() is not None else "")
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        assert 'grpc_server_handled_total{grpc_code="OK",grpc_method="Check",grpc_service="grpc.health.v1.Health"' in text
        assert 'sinkflex_service="reward"' in text
        assert (tmp_path / "reward.yaml").is_file()  # the derived config it was started with
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode in (0, -signal.SIGTERM), out[-3000:]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


# --------------------------------------------------------------------------- one-shot jobs (compose: tasks, warm-start)

def test_jobs_prepare_the_demo_recipe_for_running_services(script, tmp_path):
    """configs/demo.yaml on running services: the `tasks` job generates the task set into the run
    folder (in the env image: no torch, transformers or vLLM), env, reward and the driver read it
    from there, the learner trains on the warm start's demonstrations file, and the driver keeps
    the warm start (it validates the base model and waits for version 1)."""
    from env_service.config import EnvServiceConfig
    from learner_service.config import LearnerConfig
    from reward_service.config import RewardServiceConfig
    from sinkflex.config import ConfigError, load_config
    from sinkflex_rl.config import TrainConfig

    run = tmp_path / "run"
    environ = {**deploy_environ(ROOT / "configs" / "demo.yaml", tmp_path), "SINKFLEX_RUN_DIR": str(run)}
    code = ("import sys, runpy\n"
            "for m in ('torch', 'transformers', 'vllm', 'gguf', 'accelerate'): sys.modules[m] = None\n"
            f"sys.argv = [{str(DOCKER / 'sinkflex_service.py')!r}] + sys.argv[1:]\n"
            f"runpy.run_path({str(DOCKER / 'sinkflex_service.py')!r}, run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", code, "tasks"], capture_output=True, text=True,
                          env={**environ, "PATH": "/usr/bin:/bin"}, timeout=300, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"tasks: {run / 'tasks'} ready (256 train + 64 test)"
    splits = json.loads((run / "tasks" / "split_tasks.json").read_text())
    assert (len(splits["train"]), len(splits["test"])) == (256, 64)
    assert json.loads((run / "tasks" / "generate.json").read_text())["domain"] == "mock"
    # a second run finds them (and checks their stamp): nothing written again
    assert script.run_job("tasks", dict(environ)) == f"tasks: {run / 'tasks'} ready (256 train + 64 test)"

    _, path = script.derive("env", dict(environ))
    assert load_config(path, EnvServiceConfig).task_files == {"mock": [str(run / "tasks")]}
    _, path = script.derive("reward", dict(environ))
    assert load_config(path, RewardServiceConfig).task_files == {"mock": [str(run / "tasks")]}
    _, path = script.derive("learner", dict(environ))
    learner = load_config(path, LearnerConfig)
    assert learner.warm_start.demonstrations == str(run / "warm_start" / "demonstrations.pb")
    assert (learner.warm_start.epochs, learner.warm_start.lr, learner.warm_start.batch_size) == (1, 2.0e-4, 8)
    _, path = script.derive("train", dict(environ))
    train = load_config(path, TrainConfig)
    assert train.services.external() and train.warm_start.enabled
    assert train.task.generate is None and train.task.task_files == [str(run / "tasks")]
    assert (train.task.train_split, train.task.eval_split, train.validation.every_steps) == ("train", "test", 4)

    # without a GPU, the CPU settings the local launcher gives the same processes (sinkflex_rl/local.py)
    import os

    from sinkflex_rl.config import LEARNER_GLIBC_TUNABLES

    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    cpu = {**environ, "CUDA_VISIBLE_DEVICES": ""}
    script.derive("rollout", cpu)
    assert (cpu["VLLM_CPU_OMP_THREADS_BIND"], cpu["VLLM_CPU_NUM_OF_RESERVED_CPU"]) == (cores, "0")  # solo: every core
    script.derive("learner", cpu)
    assert cpu["GLIBC_TUNABLES"] == LEARNER_GLIBC_TUNABLES
    gpu = {**environ, "CUDA_VISIBLE_DEVICES": "0"}
    script.derive("rollout", gpu)
    script.derive("learner", gpu)
    assert not {"VLLM_CPU_OMP_THREADS_BIND", "GLIBC_TUNABLES"} & set(gpu)
    mine = {**environ, "CUDA_VISIBLE_DEVICES": "", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    script.derive("rollout", mine)
    assert mine["VLLM_CPU_OMP_THREADS_BIND"] == "0"  # the environment's own setting wins

    # warm-start: needs the env and reward addresses; skipped once written or when off
    with pytest.raises(ValueError, match="set SINKFLEX_ENV_ADDRESS, SINKFLEX_REWARD_ADDRESS"):
        script.run_job("warm-start", {k: v for k, v in environ.items() if k not in ("SINKFLEX_ENV_ADDRESS", "SINKFLEX_REWARD_ADDRESS")})
    demos = run / "warm_start" / "demonstrations.pb"
    demos.parent.mkdir(parents=True)
    demos.write_bytes(b"")
    assert script.run_job("warm-start", dict(environ)) == f"warm-start: {demos} exists"
    off = {**environ, "SINKFLEX_CONFIG_OVERRIDES": json.dumps({"warm_start": {"enabled": False}})}
    assert script.run_job("warm-start", off) == "warm-start: warm_start.enabled is false, no demonstrations"
    _, path = script.derive("learner", dict(off))
    assert load_config(path, LearnerConfig).warm_start.demonstrations is None

    # tasks generated with other settings are refused, as the local launcher refuses them
    other = {**environ, "SINKFLEX_CONFIG_OVERRIDES": json.dumps({"task": {"generate": {"train": 8, "test": 4, "seed": 0}}})}
    with pytest.raises(ConfigError, match="holds tasks generated with"):
        script.run_job("tasks", other)
    with pytest.raises(ValueError, match="unknown job 'gateway'"):
        script.run_job("gateway", dict(environ))
    flags = subprocess.run([sys.executable, str(DOCKER / "sinkflex_service.py"), "tasks", "--port", "1"], capture_output=True,
                           text=True, env=environ, timeout=120, cwd=ROOT, check=False)
    assert flags.returncode == 2 and "a one-shot job takes no flags (got --port 1)" in flags.stderr
