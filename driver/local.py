"""Starts the services of the embedded default as local processes (or connects to running ones).

Order: embedded Redis (in this process, data under <run_dir>/redis so that a re-run
resumes the stream), the frozen user-simulator model server, env, reward, rollout
(policy engine), learner (torchrun). Each service config is written to
<run_dir>/configs/<service>.yaml — the exact configuration that ran — and passed with
`--config`.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import yaml

from driver.launcher import LocalLauncher, ManagedProcess, free_port, python_module
from sinkflex.models import resolve_model
from driver.config import TrainConfig, service_configs
from driver.controller import Addresses

log = logging.getLogger(__name__)

HEALTH = {
    "env": "grpc:sinkflex.api.env.v1.EnvService",
    "reward": "grpc:sinkflex.api.reward.v1.RewardService",
    "rollout": "grpc:sinkflex.api.rollout.v1.RolloutService",
    "learner": "grpc:sinkflex.api.learner.v1.LearnerService",
}


def _write(run_dir: Path, name: str, config) -> Path:
    path = run_dir / "configs" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    return path


def launch_local(cfg: TrainConfig, launcher: LocalLauncher) -> Addresses:
    """Starts every service for `cfg` under `launcher`; returns their addresses."""
    from sinkflex.buffer import embedded_redis_url

    run_dir = cfg.run.dir()
    redis_url = cfg.services.redis_url or os.environ.get("REDIS_URL") or embedded_redis_url(path=str(run_dir / "redis" / "buffer.db"))
    policy = resolve_model(cfg.models.policy)
    ports = {name: free_port() for name in ("env", "reward", "rollout", "learner", "user_sim")}
    addresses = {name: f"127.0.0.1:{port}" for name, port in ports.items()}

    specs = []
    user_base_url = None
    if not cfg.task.solo_mode and cfg.models.user_simulator:
        user_model = resolve_model(cfg.models.user_simulator)
        user_base_url = f"http://127.0.0.1:{ports['user_sim']}/v1"
        specs.append(ManagedProcess(
            "user_sim",
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", user_model,
             "--served-model-name", "user-sim", "--host", "127.0.0.1", "--port", str(ports["user_sim"]),
             "--kv-cache-memory-bytes", str(int(cfg.local.user_sim_kv_cache_gib * (1 << 30))),
             "--enforce-eager", "--disable-log-stats", "--seed", str(cfg.run.seed)],
            health=f"http:{user_base_url}/models",
            # vLLM CPU binds its OpenMP threads to core 0 by default; the policy engine keeps
            # it, the user simulator takes the last core
            env={"VLLM_CPU_OMP_THREADS_BIND": str(max(0, (os.cpu_count() or 1) - 1))},
        ))
    configs = service_configs(cfg, policy, addresses, redis_url, user_base_url)
    paths = {name: _write(run_dir, name, c) for name, c in configs.items()}
    common_env = {"REDIS_URL": redis_url}
    for name, module, section, extra in [
        ("env", "env_service", "env_service", ["--metrics-port", "-1"]),
        ("reward", "reward_service", "reward_service", ["--no-metrics"]),
        ("rollout", "rollout_service", "rollout_service", []),
    ]:
        specs.append(ManagedProcess(name, python_module(module, "--config", str(paths[section]), "--port", str(ports[name]), *extra),
                                    health=HEALTH[name], address=addresses[name], env=common_env))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cfg.local.learner_procs}"]
    specs.append(ManagedProcess("learner", [*torchrun, "-m", "learner_service", "--config", str(paths["learner"]),
                                            "--port", str(ports["learner"]), "--metrics-port", "-1"],
                                health=HEALTH["learner"], address=addresses["learner"], env=common_env,
                                stop_grace_s=cfg.local.learner_stop_grace_s))
    # all at once: they load in parallel (the rollout engine and the learner are the slow ones)
    launcher.start_all(specs, ready_timeout=cfg.local.ready_timeout_s)
    return Addresses(env=addresses["env"], reward=addresses["reward"], rollout=addresses["rollout"], learner=addresses["learner"])


def connect(cfg: TrainConfig) -> Addresses:
    s = cfg.services
    return Addresses(env=s.env_address, reward=s.reward_address, rollout=s.rollout_address, learner=s.learner_address)
