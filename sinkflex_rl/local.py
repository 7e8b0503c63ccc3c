"""Starts the services of the embedded default as local processes (or connects to running ones).

Order: embedded Redis (in this process, data under <run_dir>/redis so that a re-run
resumes the stream), the generated task set (`task.generate`, into <run_dir>/tasks), the
frozen user-simulator model server, env, reward, rollout (policy engine); then, with a
warm start, the demonstrations (golden actions played through the env and reward services,
sinkflex_rl/warm_start.py, into <run_dir>/warm_start/demonstrations.pb); then the learner
(torchrun), which trains on them first. The launcher restarts each of them (and the embedded
Redis) when it dies or freezes, up to local.max_restarts times (local.restart_services).
Each service config is written to
<run_dir>/configs/<service>.yaml — the exact configuration that ran — and passed with
`--config`.

With only `services.env_address` set (an env server that runs already, e.g. one plugged in
over gRPC from examples/), no env service and no user-simulator model are launched; the
reward service is launched only when something uses it (`TrainConfig.uses_local_reward_service`:
task.reward service without task.reward_address, or a warm start).

GPUs (`sinkflex_rl.placement.place`, from the `local` section and the visible devices): each
process gets its CUDA_VISIBLE_DEVICES (env and reward none), the learner one torchrun rank
per GPU of its share, the engine tensor parallelism over its share. With no GPU visible
(the embedded default) every command and environment is the CPU one.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from sinkflex.config import ConfigError, dump_yaml
from sinkflex.models import resolve_model
from sinkflex_rl.clients import Addresses
from sinkflex_rl.config import (
    LocalConfig,
    TrainConfig,
    demonstrations_path,
    service_configs,
)
from sinkflex_rl.launcher import (
    HEALTH,
    LocalLauncher,
    ManagedProcess,
    free_port,
    python_module,
)
from sinkflex_rl.placement import Placement, place, visible_gpus

log = logging.getLogger(__name__)

#: The launched processes load local folders only (models resolved above, `resolve_model`): no hub
#: call from them, whatever the CLI's own environment allows (`models.hub` downloads in the CLI).
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}



def _write(run_dir: Path, name: str, config) -> Path:
    path = run_dir / "configs" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_yaml(config.model_dump(mode="json")))
    return path


def _model(cfg: TrainConfig, field: str) -> str:
    """The local folder of models.<field> (`resolve_model`); a ConfigError naming the field, before anything starts."""
    try:
        return resolve_model(getattr(cfg.models, field), hub=cfg.models.hub)
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(f"models.{field}: {err}") from None


def placement_for(cfg: TrainConfig, visible: list[str] | None = None) -> Placement:
    """The GPU placement of `cfg`'s local processes on `visible` (default: `visible_gpus()`).

    Raises:
        ConfigError: the split does not fit (sinkflex_rl.placement), or rollout_service.engine.tensor_parallel_size
            disagrees with local.engine_gpus.
    """
    p = place(cfg.local, visible_gpus() if visible is None else visible, user_sim=cfg.launches_user_sim())
    tp = cfg.section("rollout_service").get("engine", {}).get("tensor_parallel_size")
    if p.on_gpus and tp is not None and tp != p.engine_tp:
        raise ConfigError(f"rollout_service.engine.tensor_parallel_size ({tp}) disagrees with local.engine_gpus "
                          f"({p.engine_tp}): set local.engine_gpus only")
    return p


def _on_gpus(config, placement: Placement):
    """The rollout service's config with the engine's share of the GPUs (unchanged on CPU)."""
    if not placement.on_gpus:
        return config
    engine = config.engine.model_copy(update={"tensor_parallel_size": placement.engine_tp,
                                              "gpu_memory_utilization": placement.gpu_memory_utilization})
    return config.model_copy(update={"engine": engine})


def launch_local(cfg: TrainConfig, launcher: LocalLauncher, visible: list[str] | None = None,
                 learner: bool = True) -> Addresses:
    """Starts every service for `cfg` under `launcher`; returns their addresses.

    Args:
        visible: the CUDA device ids to place the processes on (default: `visible_gpus()`).
        learner: start the learner (False: `sinkflex-rl eval`, the policy scored alone; no warm
            start; `Addresses.learner` "").
    """
    from sinkflex.buffer import embedded_redis_url

    check_env_domains(cfg)  # before anything starts: an unknown task.env would fail only once every engine loaded
    placement = placement_for(cfg, visible)  # before anything starts
    if placement.on_gpus:
        log.info("GPU placement: %s; learner --nproc_per_node=%d", placement.cuda_visible_devices, placement.learner_nproc)
    run_dir = cfg.run.dir()
    policy = _model(cfg, "policy")  # before the embedded Redis starts: a bad models.policy starts nothing
    redis_url = cfg.services.redis_url or os.environ.get("REDIS_URL") or embedded_redis_url(path=str(run_dir / "redis" / "buffer.db"))
    from sinkflex.buffer.embedded import embedded_redis_pid, restart_embedded_redis

    redis_pid = embedded_redis_pid(redis_url)
    if redis_pid:  # the embedded server runs in its own process: watched (and restarted) like a service
        launcher.watch("redis", redis_pid, restart=lambda: restart_embedded_redis(redis_url),
                       max_restarts=_max_restarts(cfg, "redis"))
    ports = {name: free_port() for name in ("env", "reward", "rollout", "learner", "user_sim")}
    addresses = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    env_running = cfg.services.env_only()
    if env_running:
        addresses["env"] = cfg.services.env_address
    if not cfg.uses_local_reward_service():
        addresses["reward"] = ""

    task_files = prepare_task_files(cfg)
    check_task_selection(cfg, task_files, train=learner)  # before anything starts: a typo'd split fails now
    specs = []
    user_base_url = None
    engine_bind, user_sim_bind = cpu_binds(cfg)
    if cfg.launches_user_sim():
        from rollout_service.engine import resolve_engine_dtype
        from rollout_service.user_sim import user_sim_server_argv

        user_model = _model(cfg, "user_simulator")
        user_base_url = f"http://127.0.0.1:{ports['user_sim']}/v1"
        gpu_args = []
        if placement.on_gpus:
            gpu_args = ["--tensor-parallel-size", str(placement.user_sim_tp)]
            if placement.gpu_memory_utilization is not None:
                gpu_args += ["--gpu-memory-utilization", str(placement.gpu_memory_utilization)]
        specs.append(ManagedProcess(
            "user_sim",
            [*user_sim_server_argv(user_model, resolve_engine_dtype(cfg.local.user_sim_dtype, cuda=placement.on_gpus),
                                   served_model_name="user-sim", host="127.0.0.1", port=ports["user_sim"],
                                   kv_cache_gib=cfg.local.user_sim_kv_cache_gib, seed=cfg.run.seed), *gpu_args],
            health=f"http:{user_base_url}/models",
            env={**({} if placement.on_gpus else user_sim_cpu_env(user_sim_bind)), **OFFLINE, **placement.env("user_sim")},
            nice=ENGINE_NICE if user_sim_bind == "all" and not placement.on_gpus else 0,
            max_restarts=_max_restarts(cfg, "user_sim"), ready_timeout_s=cfg.local.ready_timeout_s,
        ))
    demos = demonstrations_path(run_dir) if cfg.warm_start.enabled else None
    configs = service_configs(cfg, policy, addresses, redis_url, user_base_url, task_files=task_files,
                              demonstrations=str(demos) if demos else None)
    if "rollout_service" in configs:
        configs["rollout_service"] = _on_gpus(configs["rollout_service"], placement)
    paths = {name: _write(run_dir, name, c) for name, c in configs.items()}
    common_env = {"REDIS_URL": redis_url, **OFFLINE}
    for name, module, section, extra in [
        ("env", "env_service", "env_service", ["--no-metrics"]),
        ("reward", "reward_service", "reward_service", ["--no-metrics"]),
        ("rollout", "rollout_service", "rollout_service", ["--no-metrics"]),
    ]:
        if section not in paths:  # a running env server; no reward service needed
            continue
        env, nice = {**common_env, **placement.env(name)}, 0
        if name == "rollout" and not placement.on_gpus:
            env.update(engine_cpu_env(engine_bind, user_sim_bind=user_sim_bind))
            # on every core, the engine yields to what else runs at once (the warm start's
            # learner while the base model is validated), which would otherwise starve
            nice = ENGINE_NICE if engine_bind == "all" else 0
        specs.append(ManagedProcess(name, python_module(module, "--config", str(paths[section]), "--port", str(ports[name]), *extra),
                                    health=HEALTH[name], address=addresses[name], env=env, nice=nice,
                                    max_restarts=_max_restarts(cfg, name),
                                    ready_timeout_s=cfg.local.ready_timeout_s))
    # env, reward and the engine load in parallel (the engine is the slow one)
    launcher.start_all(specs, ready_timeout=cfg.local.ready_timeout_s)
    if not learner:
        return Addresses(env=addresses["env"], reward=addresses["reward"], rollout=addresses["rollout"], learner="")
    if demos is not None and not demos.exists() and not _learner_started(run_dir):
        write_demonstrations_for(cfg, policy, addresses, task_files, demos)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={placement.learner_nproc}"]
    learner = (ManagedProcess("learner", [*torchrun, "-m", "learner_service", "--config", str(paths["learner_service"]),
                                            "--port", str(ports["learner"]), "--no-metrics"],
                                health=HEALTH["learner"], address=addresses["learner"],
                                env={**common_env, **learner_cpu_env(cfg.local, placement.on_gpus), **placement.env("learner")},
                                stop_grace_s=cfg.local.learner_stop_grace_s, max_restarts=_max_restarts(cfg, "learner"),
                                ready_timeout_s=cfg.local.ready_timeout_s))
    launcher.start_all([learner], ready_timeout=cfg.local.ready_timeout_s)
    return Addresses(env=addresses["env"], reward=addresses["reward"], rollout=addresses["rollout"], learner=addresses["learner"])


def check_env_domains(cfg: TrainConfig) -> None:
    """The domains the local env service would serve (task.env, or env_service.domains) are
    τ²-Bench's (`env_service.catalog.check_domains`); nothing to check when an env server runs
    already (services.env_address).

    Raises:
        ConfigError: naming task.env, the domains τ²-Bench ships, and how to train on an env of one's own.
    """
    if cfg.env_service is None or cfg.services.env_only() or cfg.services.external():
        return
    from env_service.catalog import check_domains

    try:
        check_domains(cfg.env_service.domains)
    except ValueError as err:
        raise ConfigError(f"task.env: {err} (the local env service serves those); an env of your own runs as its "
                          "own server: set services.env_address (docs/plugins.md)") from None


def check_task_selection(cfg: TrainConfig, task_files: list[str], train: bool = True) -> None:
    """The splits and task ids the run names exist in the task set the local env service will serve
    (τ²-Bench's tasks of task.env plus `task_files`): task.train_split (unless task.task_ids
    pick the tasks) and task.task_ids when `train`, task.eval_split when validating (or `train`
    False: `sinkflex-rl eval`). Nothing to check when an env server runs already.

    Raises:
        ConfigError: naming the field, the missing split or ids, and the splits there are.
    """
    if cfg.env_service is None or cfg.services.env_only() or cfg.services.external():
        return
    from tau2_adapter.tasks import domain_tasks

    try:
        tasks = domain_tasks(cfg.task.env, task_files)
    except ValueError as err:
        raise ConfigError(f"task.task_files: {err}") from None
    t, splits = cfg.task, ", ".join(sorted(tasks.splits)) or "none"
    checks = []
    if train and (not t.task_ids or t.order == "stratified"):
        checks.append(("task.train_split", t.train_split))
    if not train or cfg.validation.every_steps:
        checks.append(("task.eval_split", t.eval_split))
    for field, split in checks:
        if split not in tasks.splits:
            raise ConfigError(f"{field}: env {t.env!r} has no split {split[:200]!r} (its splits: {splits[:1000]})")
    missing = [i for i in (t.task_ids or []) if i not in tasks.tasks] if train else []
    if missing:
        shown = ", ".join(repr(i[:100]) for i in missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise ConfigError(f"task.task_ids: env {t.env!r} has no task {shown}")


def _max_restarts(cfg: TrainConfig, name: str) -> int:
    """How often the launcher restarts process `name` in this run: local.max_restarts when it is one of
    local.restart_services, else 0 (its death or freeze ends the run)."""
    return cfg.local.max_restarts if name in cfg.local.restart_services else 0


#: niceness of a CPU rollout engine bound to every core (`local.engine_cpu_threads_bind` "all"),
#: its own and its session's autogroup's (`sinkflex_rl.launcher.renice_self`): in a synchronous run
#: nothing else computes while it generates, except the warm start's learner during the base
#: model's validation, which then keeps its share of the cores (measured: docs/usage.md)
ENGINE_NICE = 10


def learner_cpu_env(local: LocalConfig, on_gpus: bool, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The local CPU learner's GLIBC_TUNABLES (`LocalConfig.learner_glibc_tunables`): {} on GPUs,
    when it is None, or when the environment already sets GLIBC_TUNABLES (the user's wins)."""
    if on_gpus or local.learner_glibc_tunables is None or "GLIBC_TUNABLES" in environ:
        return {}
    return {"GLIBC_TUNABLES": local.learner_glibc_tunables}


def cpu_binds(cfg: TrainConfig, user_sim: bool | None = None) -> tuple[str, str | None]:
    """(the rollout engine's, the user simulator's or None) CPU core settings of a CPU run:
    `local.engine_cpu_threads_bind` (None: "all" synchronous, "auto" asynchronous) and, when a user
    simulator runs (`user_sim`; None: the run launches one, `TrainConfig.launches_user_sim`),
    `local.user_sim_cpu_threads_bind` (None: "all" synchronous, "last" asynchronous). The values
    `engine_cpu_env` and `user_sim_cpu_env` take."""
    synchronous = cfg.rollout.max_staleness == 0
    engine = cfg.local.engine_cpu_threads_bind or ("all" if synchronous else "auto")
    if not (cfg.launches_user_sim() if user_sim is None else user_sim):
        return engine, None
    return engine, cfg.local.user_sim_cpu_threads_bind or ("all" if synchronous else "last")


def _cores(cores: list[int] | None) -> list[int]:
    ids = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    if not ids:
        raise ValueError("no CPU cores to bind vLLM's OpenMP threads to: the core list is empty")
    return ids


def engine_cpu_env(bind: str, user_sim_bind: str | None = None, cores: list[int] | None = None) -> dict[str, str]:
    """The CPU rollout engine's OpenMP binding (`local.engine_cpu_threads_bind`) as vLLM's
    environment variables (vllm.utils.ompmultiprocessing reads them in the engine process).

    Args:
        bind: "all" (every core of `cores`, none reserved; without the last one when a local
            user simulator is bound there alone), "auto" (vLLM's default: no variable set), or a
            VLLM_CPU_OMP_THREADS_BIND value passed through.
        user_sim_bind: `local.user_sim_cpu_threads_bind` of a local user simulator that runs
            beside the engine, None when none does.
        cores: the CPU ids to use (default: this process's affinity, `os.sched_getaffinity`).

    Returns:
        {} for "auto"; else VLLM_CPU_OMP_THREADS_BIND (and VLLM_CPU_NUM_OF_RESERVED_CPU=0 for "all").

    Raises:
        ValueError: "all" with an empty `cores`.
    """
    if bind == "auto":
        return {}
    if bind != "all":
        return {"VLLM_CPU_OMP_THREADS_BIND": bind}
    ids = _cores(cores)
    if user_sim_bind == "last" and len(ids) > 1:
        ids = ids[:-1]
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(str(i) for i in ids), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def user_sim_cpu_env(bind: str, cores: list[int] | None = None) -> dict[str, str]:
    """The local user simulator's vLLM server's OpenMP binding (`local.user_sim_cpu_threads_bind`)
    as VLLM_CPU_OMP_THREADS_BIND.

    Args:
        bind: "all" (every core of `cores`, shared with the rollout engine), "last" (the last core
            of `cores` alone), or a VLLM_CPU_OMP_THREADS_BIND value passed through.
        cores: the CPU ids to use (default: this process's affinity, `os.sched_getaffinity`).

    Returns:
        {"VLLM_CPU_OMP_THREADS_BIND": <core list>}.

    Raises:
        ValueError: "all" or "last" with an empty `cores`.
    """
    if bind == "all":
        return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(str(i) for i in _cores(cores))}
    if bind == "last":
        return {"VLLM_CPU_OMP_THREADS_BIND": str(_cores(cores)[-1])}
    return {"VLLM_CPU_OMP_THREADS_BIND": bind}


def prepare_task_files(cfg: TrainConfig) -> list[str]:
    """task.task_files, plus the generated task set (`task.generate`) written to <run_dir>/tasks once."""
    files = list(cfg.task.task_files)
    g = cfg.task.generate
    if g is not None:
        import json

        out = cfg.run.dir() / "tasks"
        stamp = out / "generate.json"  # what generated them: a re-run with other settings must not reuse them
        want = {"domain": cfg.task.env,  # a solo set's stamp has no kind
                **g.model_dump(mode="json", exclude={"kind"} if g.kind == "solo" else None)}
        if (out / "tasks.json").is_file():
            try:
                have = json.loads(stamp.read_text(encoding="utf-8")) if stamp.is_file() else None
            except (ValueError, OSError):  # cut short when the run was killed writing it
                have = f"an unreadable {stamp.name}"
            if have != want:
                raise ConfigError(f"{out} holds tasks generated with {have}, but task.generate is now {want}: "
                                  "delete the folder or choose another run.output_dir")
        else:
            from tau2_adapter.generate import generate_mock_tasks, write_task_dir
            from tau2_adapter.generate_dual import generate_dual_tasks

            generate = generate_dual_tasks if g.kind == "dual" else generate_mock_tasks
            write_task_dir(generate(train=g.train, test=g.test, seed=g.seed), out)
            stamp.write_text(json.dumps(want, sort_keys=True) + "\n")
            log.info("generated %d train + %d test %s tasks into %s", g.train, g.test, cfg.task.env, out)
        files.append(str(out))
    return files


def _learner_started(run_dir: Path) -> bool:
    """A learner checkpoint exists (a resumed run: the warm start, if any, is done)."""
    return any((run_dir / "learner" / "checkpoints").glob("step_*"))


def write_demonstrations_for(cfg: TrainConfig, policy: str, addresses: dict[str, str], task_files: list[str],
                             out: Path) -> None:
    """Builds the warm start's demonstrations through the running env and reward services."""

    from transformers import AutoTokenizer

    from env_service.client import GrpcEnvClient
    from learner_service.sft import write_demonstrations
    from reward_service.client import GrpcRewardClient
    from sinkflex_rl.config import warm_start_task_ids
    from sinkflex_rl.warm_start import build_demonstrations
    from tau2_adapter.generate_dual import PREFIX as DUAL_PREFIX
    from tau2_adapter.generate_dual import golden_agent_turns
    from tau2_adapter.tasks import domain_tasks, golden_actions

    t = cfg.task
    task_set = domain_tasks(t.env, task_files)
    ids = warm_start_task_ids(cfg, t.task_ids or task_set.splits.get(t.train_split, []))
    if not ids:
        raise ValueError(f"warm start: no tasks in split {t.train_split!r} of env {t.env!r}")
    tokenizer = AutoTokenizer.from_pretrained(policy)
    rs = cfg.rollout
    with GrpcEnvClient(addresses["env"]) as env, GrpcRewardClient(addresses["reward"]) as reward:
        demos = build_demonstrations(env, reward, tokenizer, t.env, {i: golden_actions(task_set.tasks[i]) for i in ids},
                                     solo_mode=t.solo_mode, max_turns=rs.max_turns, max_context_tokens=rs.max_context_tokens,
                                     env_max_steps=0, dialogues={i: golden_agent_turns(task_set.tasks[i]) for i in ids
                                                                 if i.startswith(DUAL_PREFIX)})
    if not demos.groups:
        raise RuntimeError(f"warm start: none of the {len(ids)} demonstrations reached reward 1.0 "
                           f"(first failures: {list(demos.dropped[:5])})")
    n = write_demonstrations(out, demos.groups)
    log.info("warm start: %d demonstrations written to %s (%d dropped below reward 1.0)", n, out, len(demos.dropped))


#: How long `wait_for_running_services` waits for services that run elsewhere to be SERVING at the
#: start (a compose stack's engine may still be loading): what a run waits for a peer that restarts.
RUNNING_SERVICES_WAIT_S = 1800.0


def wait_for_running_services(cfg: TrainConfig, timeout_s: float = RUNNING_SERVICES_WAIT_S, note_every_s: float = 60.0) -> None:
    """Waits until each service the run connects to rather than launches (services.*_address: all
    of them, or only the env) answers its gRPC health check SERVING, saying which one it waits for
    (at once, then every `note_every_s` seconds).

    Raises:
        ConfigError: one is not SERVING within `timeout_s` seconds, naming its field, its address and
            its last answer (a wrong host or port used to make the run wait without a word).
    """
    import time

    from sinkflex.serving import make_channel, wait_for_serving
    from sinkflex_rl.launcher import HEALTH

    s = cfg.services
    names = ["env", "reward", "rollout", "learner"] if s.external() else ["env"] if s.env_only() else []
    deadline = time.monotonic() + timeout_s
    for name in names:
        field, address = f"services.{name}_address", getattr(s, f"{name}_address")
        channel = make_channel(address)
        try:
            waited = False
            while True:
                left = deadline - time.monotonic()
                try:
                    wait_for_serving(channel, HEALTH[name].partition(":")[2], timeout=max(0.5, min(note_every_s, left)))
                    break
                except TimeoutError as err:
                    if time.monotonic() >= deadline:
                        raise ConfigError(f"{field}: nothing SERVING the {name} service at {address} within "
                                          f"{timeout_s:g} s ({str(err)[:300]}); is it running, on that host and port?") from None
                    log.warning("waiting for the %s service at %s (%s) to be SERVING: %s", name, address, field, str(err)[:200])
                    waited = True
            if waited:
                log.info("the %s service at %s is SERVING", name, address)
        finally:
            channel.close()


def external_addresses(cfg: TrainConfig) -> Addresses:
    """The addresses of services that run already (services.*, all set: `ServicesConfig.external`);
    `sinkflex_rl.clients.connect` makes the clients."""
    s = cfg.services
    return Addresses(env=s.env_address, reward=s.reward_address, rollout=s.rollout_address, learner=s.learner_address)
