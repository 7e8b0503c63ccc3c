#!/usr/bin/env python
"""`sinkflex-service SERVICE [SERVICE FLAGS...]`: start one SinkFlex service in a container
with the configuration the embedded default would give it.

The embedded default (`sinkflex-rl train -c CONFIG`, sinkflex_rl/local.py) derives each
service's config from one experiment file with `sinkflex_rl.config.service_configs`,
writes it to a YAML file and starts `python -m <service> --config FILE`. In a container
(docker compose, Kubernetes) this script does the same for one service, taking from the
environment what the launcher would have chosen itself — the other services' addresses —
and then replaces itself (exec) with the service:

    env      python -m env_service     --config F [flags]
    reward   python -m reward_service  --config F [flags]
    rollout  python -m rollout_service --config F [flags]
    learner  sinkflex-learner          --config F [flags]   (torchrun, docker/learner-entrypoint.sh)
    train    sinkflex-rl train         -c F [flags]         (the experiment with `services:` filled in:
                                                             the driver connects, launches nothing)
    user-sim python -m vllm.entrypoints.openai.api_server --model M --seed S [flags]
                                                            (the experiment's models.user_simulator,
                                                             served frozen; the server `vllm serve` runs)

Two one-shot jobs prepare what the embedded default's launcher prepares itself (sinkflex_rl/local.py),
in the run folder, for the services above; they run in this process and exit 0 when done or when
there is nothing to do:

    tasks       the generated task set (`task.generate`) into <run dir>/tasks, once (a folder made
                with other settings is refused: sinkflex_rl.local.prepare_task_files); before env and
                reward start, which then read it (their task_files, and the driver's, include it)
    warm-start  the warm start's demonstrations (`warm_start.enabled`: golden actions of the train
                split played through the running env and reward services) into
                <run dir>/warm_start/demonstrations.pb; after env and reward, before the learner,
                which trains on them as policy version 1 (its warm_start.demonstrations). Skipped
                when the file exists or the learner has a checkpoint (a resumed run).

Environment:
    SINKFLEX_CONFIG          experiment YAML (default configs/retail.yaml)
    SINKFLEX_CONFIG_OVERRIDES  JSON object merged into the experiment before anything is derived,
                             e.g. {"rollout_service": {"engine": {"dtype": "bfloat16"}}}
    SINKFLEX_ENV_ADDRESS, SINKFLEX_REWARD_ADDRESS, SINKFLEX_ROLLOUT_ADDRESS,
    SINKFLEX_LEARNER_ADDRESS host:port of the services (those the service talks to)
    REDIS_URL                the trajectory buffer
    SINKFLEX_USER_BASE_URL   OpenAI-compatible base URL of the user simulator
    SINKFLEX_USER_MODEL      its litellm model name (default openai/user-sim)
    SINKFLEX_POLICY          policy model: a folder, a `sinkflex-rl models prepare` name, or a
                             Hugging Face id (default: the experiment's models.policy)
    SINKFLEX_USER_SIM_MODEL  user-simulator model (default: the experiment's models.user_simulator)
    SINKFLEX_RUN_DIR         run folder (default: the experiment's run.output_dir)
    SINKFLEX_CONFIG_DIR      where the derived configs are written (default /tmp/sinkflex)
    SINKFLEX_MAX_STALENESS   the experiment's rollout.max_staleness (0 synchronous, k >= 1
                             asynchronous rollouts, docs/async.md); learner_service.max_staleness and
                             rollout_service.weight_updates follow from it (sinkflex_rl/config.py)
    SINKFLEX_TASKS_PER_STEP  the experiment's task.tasks_per_step (groups per RL step; the
                             learner's batch.groups_per_step follows from it)
                             Both: empty = the experiment's (after the overrides); set in
                             SINKFLEX_CONFIG_OVERRIDES too: an error (set one).

`--dry-run` (first argument after SERVICE) prints the command and the config path as JSON
instead of starting the service.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

COMMANDS = {
    "env": [sys.executable, "-m", "env_service", "--config"],
    "reward": [sys.executable, "-m", "reward_service", "--config"],
    "rollout": [sys.executable, "-m", "rollout_service", "--config"],
    "learner": ["sinkflex-learner", "--config"],
    "train": ["sinkflex-rl", "train", "-c"],
}
#: every service this script starts: those above with a derived config, and the user simulator's
#: model server (`rollout_service.user_sim.user_sim_server_argv`)
SERVICES = (*COMMANDS, "user-sim")
#: one-shot jobs run in this process (main), not exec'd
JOBS = ("tasks", "warm-start")
SECTIONS = {"env": "env_service", "reward": "reward_service", "rollout": "rollout_service", "learner": "learner_service"}
#: Environment variables setting one experiment field each (compose's and the chart's values).
SHAPE_VARIABLES = {"SINKFLEX_MAX_STALENESS": ("rollout", "max_staleness"),
                   "SINKFLEX_TASKS_PER_STEP": ("task", "tasks_per_step")}
USAGE = f"usage: sinkflex-service {{{','.join([*SERVICES, *JOBS])}}} [--dry-run] [SERVICE FLAGS...]"


def resolve_policy(name_or_path: str) -> str:  # also the user-simulator model
    """A model folder as is; a `sinkflex-rl models prepare` name prepared (cached); else a hub id."""
    from sinkflex.models import resolve_model

    return resolve_model(name_or_path, allow_hub_id=True)


def derive(service: str, environ: dict[str, str]) -> tuple[list[str], Path | None]:
    """(command prefix, written config path or None) for `service`.

    For the learner, also sets `environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]` (unless set) to
    the experiment's `local.learner_stop_grace_s`: on SIGTERM torchrun gives the learner that
    long to finish its step and checkpoint before SIGKILL (torchrun's default is 30 s).
    Without a visible GPU (`sinkflex_rl.placement.visible_gpus`), also the CPU process settings
    the embedded default's launcher gives the same process (unless the environment sets them):
    the rollout engine's OpenMP cores (`local.engine_cpu_threads_bind`: VLLM_CPU_OMP_THREADS_BIND,
    VLLM_CPU_NUM_OF_RESERVED_CPU; vLLM's own default reserves a core, half of a 2-core machine),
    the user simulator's (`local.user_sim_cpu_threads_bind`), the learner's GLIBC_TUNABLES
    (`local.learner_glibc_tunables`).
    The user simulator's command carries `--dtype`: `local.user_sim_dtype`, auto resolved as the
    launcher resolves it (vLLM's auto with a visible GPU, else the engine's CPU rule,
    `rollout_service.engine.resolve_engine_dtype`).

    Raises:
        sinkflex.config.ConfigError: the experiment or a derived service config is invalid.
        ValueError: unknown service.
    """
    import yaml

    from sinkflex.config import validate_config
    from sinkflex_rl.config import TrainConfig, service_configs

    if service not in SERVICES:
        raise ValueError(f"unknown service {service!r}; {USAGE}")
    cfg, data, source = experiment(environ)
    addresses = {k: environ.get(f"SINKFLEX_{k.upper()}_ADDRESS") for k in ("env", "reward", "rollout", "learner")}
    redis_url = environ.get("REDIS_URL") or cfg.services.redis_url
    if service == "user-sim":
        model = environ.get("SINKFLEX_USER_SIM_MODEL") or cfg.models.user_simulator
        if not model:
            raise ValueError(f"{source}: models.user_simulator is not set (solo mode needs no user simulator)")
        model = resolve_policy(model)
        _cpu_settings(service, cfg, environ)
        from rollout_service.engine import resolve_engine_dtype
        from rollout_service.user_sim import user_sim_server_argv
        from sinkflex_rl.placement import visible_gpus

        dtype = resolve_engine_dtype(cfg.local.user_sim_dtype, cuda=bool(visible_gpus(environ)))
        return user_sim_server_argv(model, dtype, seed=cfg.run.seed, eager=False), None
    task_files, demonstrations = prepared_inputs(cfg)
    if service == "train":
        data["services"] = {**data["services"], **{f"{k}_address": v for k, v in addresses.items()}, "redis_url": redis_url}
        if cfg.task.generate is not None:  # generated by the `tasks` job: files the driver lists like any others
            data["task"] = {**data["task"], "generate": None, "task_files": task_files}
        out = validate_config(data, TrainConfig, source=f"{source} + environment")
    else:
        policy = environ.get("SINKFLEX_POLICY") or cfg.models.policy
        if service in ("rollout", "learner"):  # the services that load it
            policy = resolve_policy(policy)
        out = service_configs(cfg, policy, addresses, redis_url, environ.get("SINKFLEX_USER_BASE_URL"),
                              user_model=environ.get("SINKFLEX_USER_MODEL", "openai/user-sim"),
                              task_files=task_files, demonstrations=demonstrations)[SECTIONS[service]]
        if service == "learner":
            environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(int(cfg.local.learner_stop_grace_s)))
        _cpu_settings(service, cfg, environ)
    path = Path(environ.get("SINKFLEX_CONFIG_DIR", "/tmp/sinkflex")) / f"{service}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(out.model_dump(mode="json"), sort_keys=False))
    return [*COMMANDS[service], str(path)], path


def _cpu_settings(service: str, cfg, environ: dict[str, str]) -> None:
    """The launcher's CPU settings of `service` into `environ` (derive's docstring); nothing on GPUs."""
    from sinkflex_rl.placement import visible_gpus

    if service not in ("rollout", "learner", "user-sim") or visible_gpus(environ):
        return
    from sinkflex_rl.local import cpu_binds, engine_cpu_env, learner_cpu_env, user_sim_cpu_env

    if service == "rollout":
        settings = engine_cpu_env(*cpu_binds(cfg))
    elif service == "user-sim":  # this container is the user simulator's server
        settings = user_sim_cpu_env(cpu_binds(cfg, user_sim=True)[1])
    else:
        settings = learner_cpu_env(cfg.local, on_gpus=False, environ=environ)
    for key, value in settings.items():
        environ.setdefault(key, value)


def prepared_inputs(cfg) -> tuple[list[str], str | None]:
    """(task folders, demonstration file or None) of the experiment `cfg` in its run folder: task.task_files
    plus <run dir>/tasks with `task.generate` (the `tasks` job writes it), and
    <run dir>/warm_start/demonstrations.pb with `warm_start.enabled` (the `warm-start` job writes it) —
    where the embedded default's launcher puts them (sinkflex_rl.config.launch_inputs)."""
    from sinkflex_rl.config import launch_inputs

    inputs = launch_inputs(cfg)
    return inputs["task_files"], inputs["demonstrations"]


def experiment(environ: dict[str, str]):
    """(TrainConfig, its data as a dict, source name): $SINKFLEX_CONFIG with SINKFLEX_CONFIG_OVERRIDES,
    the SHAPE_VARIABLES and SINKFLEX_RUN_DIR applied.

    Raises:
        sinkflex.config.ConfigError: the experiment is invalid.
        ValueError: a bad SINKFLEX_CONFIG_OVERRIDES or shape variable.
    """
    from sinkflex.config import merge_dicts, validate_config
    from sinkflex_rl.config import TrainConfig, load_train_config

    source = environ.get("SINKFLEX_CONFIG", "configs/retail.yaml")
    cfg = load_train_config(source)
    data = cfg.model_dump(mode="json")
    overrides = environ.get("SINKFLEX_CONFIG_OVERRIDES", "").strip()
    if overrides:
        try:
            patch = json.loads(overrides)
        except json.JSONDecodeError as err:
            raise ValueError(f"SINKFLEX_CONFIG_OVERRIDES is not JSON: {err}") from None
        if not isinstance(patch, dict):
            raise ValueError("SINKFLEX_CONFIG_OVERRIDES must be a JSON object")
        data = merge_dicts(data, patch)
        cfg = validate_config(data, TrainConfig, source=f"{source} + SINKFLEX_CONFIG_OVERRIDES")
    else:
        patch = {}
    shape = {}
    for var, (section, key) in SHAPE_VARIABLES.items():
        raw = environ.get(var, "").strip()
        if not raw:
            continue
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{var} must be an integer (the experiment's {section}.{key}), got {raw!r}") from None
        if isinstance(patch.get(section), dict) and key in patch[section]:
            raise ValueError(f"{var} and SINKFLEX_CONFIG_OVERRIDES' {section}.{key} both set {section}.{key}: set one")
        shape.setdefault(section, {})[key] = value
    if shape:  # the derived fields (learner_service.max_staleness, weight_updates, groups_per_step) follow
        data = merge_dicts(data, shape)
        cfg = validate_config(data, TrainConfig, source=f"{source} + {', '.join(v for v in SHAPE_VARIABLES if environ.get(v, '').strip())}")
    if environ.get("SINKFLEX_RUN_DIR"):
        data["run"]["output_dir"] = environ["SINKFLEX_RUN_DIR"]
        cfg = validate_config(data, TrainConfig, source=source)
    return cfg, data, source


def run_job(job: str, environ: dict[str, str]) -> str:
    """Runs the one-shot job `job` (JOBS) for the experiment of `environ`; returns what it did, one line.

    Raises:
        sinkflex.config.ConfigError: the experiment is invalid, or <run dir>/tasks holds tasks
            generated with other settings.
        ValueError: unknown job; warm-start without SINKFLEX_ENV_ADDRESS / SINKFLEX_REWARD_ADDRESS.
        RuntimeError: no demonstration reached reward 1.0.
        sinkflex.errors.ServiceError (or grpc.RpcError): env or reward did not answer.
    """
    from sinkflex_rl.local import (
        _learner_started,
        prepare_task_files,
        write_demonstrations_for,
    )

    if job not in JOBS:
        raise ValueError(f"unknown job {job!r}; {USAGE}")
    cfg, _, _ = experiment(environ)
    if job == "tasks":
        if cfg.task.generate is None:
            return "tasks: task.generate is not set, nothing to generate"
        files = prepare_task_files(cfg)  # generates once; checks the stamp of a folder made before
        return f"tasks: {files[-1]} ready ({cfg.task.generate.train} train + {cfg.task.generate.test} test)"
    task_files, demonstrations = prepared_inputs(cfg)
    if demonstrations is None:
        return "warm-start: warm_start.enabled is false, no demonstrations"
    out = Path(demonstrations)
    if out.exists():
        return f"warm-start: {out} exists"
    if _learner_started(cfg.run.dir()):
        return f"warm-start: the learner has a checkpoint in {cfg.run.dir() / 'learner'} (a resumed run), nothing to write"
    addresses = {k: environ.get(f"SINKFLEX_{k.upper()}_ADDRESS") or "" for k in ("env", "reward")}
    missing = [f"SINKFLEX_{k.upper()}_ADDRESS" for k, v in addresses.items() if not v]
    if missing:
        raise ValueError(f"warm-start plays the golden actions through the env and reward services: set {', '.join(missing)}")
    policy = resolve_policy(environ.get("SINKFLEX_POLICY") or cfg.models.policy)  # its tokenizer
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")  # the learner never reads a half-written file
    write_demonstrations_for(cfg, policy, addresses, task_files, partial)
    os.replace(partial, out)
    return f"warm-start: demonstrations written to {out}"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__ if argv else USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    service, rest = argv[0], argv[1:]
    dry_run = bool(rest) and rest[0] == "--dry-run"
    if dry_run:
        rest = rest[1:]
    from sinkflex.config import ConfigError

    environ = dict(os.environ)
    if service in JOBS:
        if rest or dry_run:
            print(f"sinkflex-service {service}: a one-shot job takes no flags (got {' '.join(argv[1:])})", file=sys.stderr)
            return 2
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        try:
            print(run_job(service, environ), flush=True)
        except (ConfigError, ValueError) as err:
            print(f"sinkflex-service {service}: {err}", file=sys.stderr)
            return 2
        return 0
    try:
        command, path = derive(service, environ)
    except (ConfigError, ValueError) as err:
        print(f"sinkflex-service: {err}", file=sys.stderr)
        return 2
    argv_out = [*command, *rest]
    if dry_run:
        print(json.dumps({"argv": argv_out, "config": str(path) if path else None}))
        return 0
    sys.stdout.flush()
    os.execvpe(argv_out[0], argv_out, environ)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
