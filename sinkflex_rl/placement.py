"""GPU placement of the local launcher's processes (`place`): which CUDA devices each one sees.

A pure function of the `local` config section, the visible device ids and whether a
user-simulator model server is launched; `sinkflex_rl.local.launch_local` applies the result
(each process's CUDA_VISIBLE_DEVICES, torchrun's --nproc_per_node, vLLM's tensor parallel
size), and `TrainConfig` calls it at load time when `local.gpus` lists the devices.

Rules (README "On a GPU box"):

- CPU (no GPU visible and `local.gpus` unset, the embedded default): no placement; every
  process starts without a GPU setting (no CUDA_VISIBLE_DEVICES set, --nproc_per_node =
  local.learner_procs).
- `local.gpus: []`: GPUs are hidden from every process (CUDA_VISIBLE_DEVICES="") and the
  run is the CPU run.
- GPUs (the ids of `local.gpus`, default all visible ones, in that order): the rollout
  engine takes the first `local.engine_gpus` (vLLM tensor_parallel_size = that count), the
  user-simulator server (when one is launched) the next `local.user_sim_gpus`, the learner
  all the others (one torchrun rank per GPU). env and reward see no GPU ("").
- `local.share_gpus: true` (e.g. one GPU): the learner takes every GPU of the run and the
  vLLM processes take the first `engine_gpus` / `user_sim_gpus` of the same GPUs; each vLLM
  process then starts with gpu_memory_utilization `local.shared_gpu_memory_utilization`,
  so that its start-up check leaves room for the others (its KV cache is sized by
  kv_cache_gib either way).
- Refused (`ConfigError`, naming fields and numbers): more GPUs asked than the run has, an id
  of `local.gpus` that is not visible (or listed twice), a learner left with 0 GPUs, and a
  `local.learner_procs` set to something else than the learner's GPU count.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Mapping

from sinkflex.config import ConfigError

#: The processes that get a CUDA_VISIBLE_DEVICES once placement is on.
PROCESSES = ("env", "reward", "user_sim", "rollout", "learner")


@dataclass(frozen=True)
class Placement:
    """Where each local process runs.

    Attributes:
        cuda_visible_devices: {process name: CUDA_VISIBLE_DEVICES value}; empty on CPU (the
            launcher then sets nothing); "" hides every GPU from that process.
        learner_nproc: torchrun --nproc_per_node.
        engine_tp: the rollout engine's tensor_parallel_size (1 on CPU).
        user_sim_tp: the user-simulator server's tensor_parallel_size (0: none launched).
        gpu_memory_utilization: for the vLLM processes (None: vLLM's default), set with
            `local.share_gpus`.
    """

    cuda_visible_devices: dict[str, str] = field(default_factory=dict)
    learner_nproc: int = 1
    engine_tp: int = 1
    user_sim_tp: int = 0
    gpu_memory_utilization: float | None = None

    @property
    def on_gpus(self) -> bool:
        """GPUs are placed (False on CPU and with `local.gpus: []`)."""
        return any(self.cuda_visible_devices.values())

    def env(self, process: str) -> dict[str, str]:
        """The environment variables `process` gets ({} on CPU)."""
        if not self.cuda_visible_devices:
            return {}
        return {"CUDA_VISIBLE_DEVICES": self.cuda_visible_devices.get(process, "")}


def visible_gpus(environ: Mapping[str, str] | None = None, nvidia_smi: str | None = None) -> list[str]:
    """The CUDA device ids this machine shows the driver: CUDA_VISIBLE_DEVICES when set (its
    comma-separated ids; "" or "-1": none), else the indexes `nvidia-smi` lists, else none
    (no nvidia-smi on PATH, or it fails: no NVIDIA driver). Does not import torch."""
    environ = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in environ:
        ids = [i.strip() for i in environ["CUDA_VISIBLE_DEVICES"].split(",") if i.strip()]
        return [] if ids[:1] == ["-1"] else ids
    exe = nvidia_smi or shutil.which("nvidia-smi", path=environ.get("PATH"))
    if not exe:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def place(local, visible: list[str], user_sim: bool = False) -> Placement:
    """The placement of `local` (a `sinkflex_rl.config.LocalConfig`) on the `visible` device ids.

    Args:
        local: the `local` section (gpus, engine_gpus, user_sim_gpus, share_gpus,
            shared_gpu_memory_utilization, learner_procs; None: not set, derived here).
        visible: the device ids the machine shows (`visible_gpus`).
        user_sim: a user-simulator model server is launched locally.

    Raises:
        ConfigError: see the module docstring; the message names the fields and numbers.
    """
    visible = [str(v) for v in visible]
    if local.gpus is None:
        pool = visible
        where = f"{len(visible)} visible GPU(s) {visible}"
    else:
        pool = [str(g) for g in local.gpus]
        dup = sorted({g for g in pool if pool.count(g) > 1})
        if dup:
            raise ConfigError(f"local.gpus lists {dup} more than once: {pool}")
        missing = [g for g in pool if g not in visible]
        if missing:
            raise ConfigError(f"local.gpus asks for {len(pool)} GPU(s) {pool}, but {missing} not visible "
                              f"({len(visible)} visible: {visible}; CUDA_VISIBLE_DEVICES / nvidia-smi)")
        where = f"local.gpus {pool}"
    if not pool:
        if local.gpus is None:  # CPU: the embedded default, nothing changes
            return Placement(learner_nproc=local.learner_procs or 1)
        return Placement(cuda_visible_devices={p: "" for p in PROCESSES}, learner_nproc=local.learner_procs or 1)

    n, e = len(pool), local.engine_gpus
    u = local.user_sim_gpus if user_sim else 0
    asked = "local.engine_gpus " + str(e) + (f" + local.user_sim_gpus {u}" if user_sim else "")
    if local.share_gpus:
        if max(e, u) > n:
            raise ConfigError(f"{asked} with local.share_gpus: {max(e, u)} GPU(s) asked, but the run has {n} ({where})")
        engine, sim, learner = pool[:e], pool[:u], pool
    else:
        if e + u > n:
            raise ConfigError(f"{asked} = {e + u} GPU(s) asked, but the run has {n} ({where}); "
                              "lower them or set local.share_gpus: true")
        engine, sim, learner = pool[:e], pool[e:e + u], pool[e + u:]
        if not learner:
            raise ConfigError(f"the learner would get 0 GPUs: {where}, all taken by {asked}; lower local.engine_gpus"
                              + (" / local.user_sim_gpus" if user_sim else "")
                              + ", or let them share with local.share_gpus: true")
    if local.learner_procs is not None and local.learner_procs != len(learner):
        split = (f"{n} GPU(s) shared by all" if local.share_gpus
                 else f"{n} GPU(s) - {asked} = {len(learner)}")
        raise ConfigError(f"local.learner_procs ({local.learner_procs}) disagrees with the GPU split: {split} learner "
                          f"GPU(s) ({where}); set local.learner_procs: {len(learner)} or leave it out")
    devices = {"env": "", "reward": "", "rollout": ",".join(engine), "learner": ",".join(learner)}
    if user_sim:
        devices["user_sim"] = ",".join(sim)
    return Placement(cuda_visible_devices=devices, learner_nproc=len(learner), engine_tp=e, user_sim_tp=u,
                     gpu_memory_utilization=local.shared_gpu_memory_utilization if local.share_gpus else None)
