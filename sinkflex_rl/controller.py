"""The training controller: drives rollouts, waits for the learner, validates, reports.

Before RL, with a warm start (`warm_start.enabled`): validate the base model (policy
version 0) while the learner trains on the demonstrations, wait until the rollout engine
serves the warm-start policy (version 1), validate it. Then one RL step of the loop
(rollout.max_staleness 0: on-policy, synchronous, as in the paper's VERL-style dataflow):

    wait until version v is done                              # never sample with stale weights
    tasks  = the next `tasks_per_step` tasks of the train split (seeded shuffle,
             optionally stratified by task purpose: task.order; cycled)
    groups = RolloutService.Rollout(tasks, G, publish=True)   # scored groups → Redis stream
    wait until version v + 1 is done                          # the learner consumed them,
                                                              # took a GRPO step, checkpointed,
                                                              # wrote policy/v{v+1}, UpdateWeights
    every N steps: Rollout(eval tasks, trials, publish=False) → mean@1 ± CI, pass^k

A version is *done* when the learner's PolicyVersion names it (published only after its
checkpoint is durable) and the rollout engine's Status serves it (`wait_for_version`). The
rollout service pins every request to one version in synchronous mode (its weight_updates:
between_requests), so every turn of every trajectory of step s is sampled by version
v0 + s − 1, and the learner (max_staleness 0) trains nothing older than its own version.

Asynchronous mode (rollout.max_staleness k ≥ 1, docs/async.md): a producer thread issues the
Rollout requests, one at a time, and starts step s's as soon as step s − 1 − k is finished
(its version done and its validation, if any, written) — up to k + 1 steps of rollouts ahead
of the learner, k versions of lag at most — while the main thread waits for each version in
turn and writes its record. Weight updates land between turns (per-turn versions record
it); the learner drops any group older than its version − k. Validation requests are pinned to
one version in both modes; the version they report is the one that sampled them.

Each train record holds the learner's metrics for that version (staleness_mean / _max,
dropped_stale_groups, learner_idle_fraction, ...) and the controller's: rollout_s,
rollout_wait_s (how long the step's rollouts waited for their gate), step_s (since the
previous version was done), wall_s (since the loop started) and engine_idle_fraction (the
share of the step's wall time with no generation in flight on the rollout engine).

Validation reports the env's reward as routed for training (task.reward: τ²-Bench's own
checker for τ²-Bench domains), never a shaped one: mean@1 = the mean over
tasks of each task's mean reward over its trials, with a Student-t 95 % interval over
tasks; pass^k for k = 1..trials. An unscored trial (reward NaN: its evaluation raised) is
left out of both, never counted as 0, and counted (`unscored`, also in train records and
per task in the validation file); each validation's per-task rewards are written to
<run dir>/validation/<label>.json so that two validations can be compared paired over the
same tasks (`paired_difference`).

Before anything else (`check_reward`): when task.env is scored by a reward service
(task.reward: service), that service must know the env and every train and eval task; if it
does not, training fails at start with a ConfigError naming the env and the service's
address, instead of learning from zeros. With task.reward: env the env's own terminal reward
is the reward, and no reward service is asked.

The controller owns no model and no tensor: it talks to the services through their clients
only (`sinkflex_rl.clients.connect`: gRPC to local processes or a cluster, or in-process objects in
tests), and every failure it handles is a `sinkflex.errors.ServiceError`. The learner is the
source of truth for the policy version; a re-run resumes from the learner's checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import random
import threading
import time
from collections import defaultdict
from pathlib import Path

from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_fixed
from tqdm.auto import tqdm

from sinkflex.api.common.v1 import common_pb2
from sinkflex.api.learner.v1 import learner_pb2
from sinkflex.api.rollout.v1 import rollout_pb2
from sinkflex.config import ConfigError
from sinkflex.errors import ServiceError
from sinkflex.reporting import (
    MetricsWriter,
    mean_ci,
    paired_ci,
    pass_hat_k,
    read_metrics,
)
from sinkflex.retry import poll_until
from sinkflex_rl.clients import Addresses, ServiceClients
from sinkflex_rl.config import TrainConfig, launch_inputs, warm_start_task_ids

__all__ = ["Addresses", "Controller", "ServiceClients", "paired_difference", "per_purpose", "read_validations",
           "stratified_order", "validation_dir"]  # Addresses, ServiceClients: from sinkflex_rl.clients

log = logging.getLogger(__name__)

#: How long the engine may serve a version the learner does not name yet (its UpdateWeights
#: returns before the learner's PolicyVersion names the version) before the run stops.
UNPUBLISHED_GRACE_S = 60.0

#: Deadlines (seconds) of the controller's calls: Status / PolicyVersion polls, and an UpdateWeights
#: after a resume (a Rollout stream gets run.step_timeout_s).
POLL_TIMEOUT_S = 30.0
UPDATE_WEIGHTS_TIMEOUT_S = 600.0


def recovered_train_records(driver: list[dict], learner: list[dict], v0: int, done_steps: int) -> list[tuple[int, dict]]:
    """(step, record) for each RL step 1..`done_steps` that has no "train" record in `driver`
    (the driver's metrics.jsonl records): the learner's "train" record of policy version
    `v0` + step (its last one, if the step was re-done after a crash), less kind/step/time,
    with `recovered` 1; just `recovered` 1 where the learner has none either.
    """
    have = {int(r["step"]) for r in driver if r["kind"] == "train"}
    by_version = {int(r["policy_version"]): r for r in learner
                  if r["kind"] == "train" and r.get("policy_version") is not None}
    out = []
    for s in range(1, done_steps + 1):
        if s not in have:
            record = {k: v for k, v in by_version.get(v0 + s, {}).items() if k not in ("kind", "step", "time")}
            out.append((s, {**record, "recovered": 1}))
    return out


def user_turn_counts(trajectories) -> dict[str, float]:
    """User-simulator turns of `trajectories` (common_pb2.Trajectory, metric `user_turns` from
    `rollout_service.episode.Episode.metrics`): {"user_turns_mean": turns per trajectory,
    "episodes_without_user_turns": trajectories with none}. In solo mode every episode has none;
    in dual control each one starts with the user's first message."""
    turns = [t.metrics.get("user_turns", 0.0) for t in trajectories]
    return {"user_turns_mean": sum(turns) / len(turns) if turns else math.nan,
            "episodes_without_user_turns": float(sum(n == 0 for n in turns))}


class Controller:
    """Runs the training loop of `cfg` against the services behind `clients`.

    Args:
        cfg: the experiment.
        clients: the services' clients (`sinkflex_rl.clients.connect`, from addresses or in-process
            objects); `clients.reward` is the reward service that scores task.env (when
            task.reward_address is set: the one there). The controller closes them (`close`).
        alive_check: called while waiting; raises if a launched process died.
    """

    def __init__(self, cfg: TrainConfig, clients: ServiceClients, alive_check=lambda: None):
        self.cfg = cfg
        self.alive_check = alive_check
        self.clients = clients
        self.env = clients.env
        self.rollout = clients.rollout
        self.learner = clients.learner
        self.metrics = MetricsWriter(cfg.run.dir())
        self._metrics_lock = threading.Lock()  # the producer thread writes trajectory records
        self.groups_published = 0
        #: groups whose rollout was in flight when a fault cut it off (`abandon_in_flight`): rolled out again
        self.groups_retried = 0
        self._in_flight = 0  # groups of the Rollout request now in flight (training data)
        self._producer: threading.Thread | None = None
        #: policy version RL starts from: 1 after a warm start (its published policy), else 0
        self.v0 = 1 if cfg.warm_start.enabled else 0
        self._eval_purpose: dict[str, str] = {}  # eval task id -> purpose (filled by eval_tasks)
        #: the policy's name in τ²-Bench results files (agent_info.llm)
        self.policy_name = cfg.models.policy

    def close(self) -> None:
        self.metrics.close()
        self.clients.close()

    def reconnect(self, clients: ServiceClients) -> None:
        """Talks to the services through `clients` from now on (after an in-run restart,
        `sinkflex_rl.launcher.run_recovering`); the old clients are closed."""
        self.clients.close()  # the abandoned producer's calls fail at once: it ends before the swap
        if self._producer is not None:
            self._producer.join(timeout=120.0)
        self.clients, self.env, self.rollout, self.learner = clients, clients.env, clients.rollout, clients.learner

    def abandon_in_flight(self) -> int:
        """Counts the groups of the training Rollout request that was in flight when a fault cut it
        off into `groups_retried` (the step is rolled out again when `run` goes on; any of them the
        rollout service had published already are trained or dropped as stale and counted by the
        learner); returns how many."""
        n, self._in_flight = self._in_flight, 0
        self.groups_retried += n
        return n

    # -- tasks ---------------------------------------------------------------------------
    def _task_infos(self, field: str, split: str) -> list:
        """The env's tasks of `split`; an env or split it does not know (NOT_FOUND) is a ConfigError
        naming `field` (task.train_split / task.eval_split), not a traceback once every service loaded."""
        try:
            return list(self.env.task_infos(self.cfg.task.env, split))
        except Exception as err:  # ServiceError in-process, grpc.RpcError over gRPC
            code = getattr(err, "code", None)
            code = code() if callable(code) else code
            if getattr(code, "name", None) != "NOT_FOUND":
                raise
            details = err.details() if callable(getattr(err, "details", None)) else getattr(err, "message", str(err))
            raise ConfigError(f"{field}: split {split!r} of env {self.cfg.task.env!r}: the env service says: "
                              f"{str(details)[:500]}") from None

    def train_tasks(self) -> list[str]:
        """The train tasks in RL order (task.order): a seeded shuffle, optionally stratified; with
        task.warm_start_tasks_last the warm start's demonstrated tasks (`warm_start_task_ids`)
        follow all the others. `step_tasks` cycles through it in blocks of task.tasks_per_step."""
        t = self.cfg.task
        listed: dict[str, str] = {}
        if not t.task_ids or t.order == "stratified":
            listed = {x.task_id: x.description for x in self._task_infos("task.train_split", t.train_split)}
        ids = list(t.task_ids or listed)
        if not ids:
            raise ValueError(f"no tasks in split {t.train_split!r} of env {t.env!r}")
        demonstrated = set(warm_start_task_ids(self.cfg, ids)) if t.warm_start_tasks_last else set()
        random.Random(self.cfg.run.seed).shuffle(ids)
        parts = [[i for i in ids if i not in demonstrated], [i for i in ids if i in demonstrated]]
        if t.order == "stratified":
            parts = [stratified_order(part, {i: listed.get(i, "") for i in part}) for part in parts]
        return parts[0] + parts[1]

    def eval_tasks(self) -> list[str]:
        """The first validation.num_tasks tasks of the eval split (all when 0); remembers each one's
        description (τ²-Bench's ``Task.description.purpose``) for the per-purpose breakdown."""
        t, v = self.cfg.task, self.cfg.validation
        listed = self._task_infos("task.eval_split", t.eval_split)
        self._eval_purpose = {x.task_id: x.description for x in listed}
        ids = [x.task_id for x in listed]
        return ids[: v.num_tasks] if v.num_tasks else ids

    def step_tasks(self, step: int, pool: list[str]) -> list[str]:
        n = self.cfg.task.tasks_per_step
        return [pool[(step * n + i) % len(pool)] for i in range(n)]

    # -- services ------------------------------------------------------------------------
    def check_reward(self, task_ids: list[str]) -> None:
        """Fails unless the reward service that scores task.env (`clients.reward`) knows it and every
        task in `task_ids`; with task.reward env nothing is asked.

        Raises:
            ConfigError: naming the env, the task(s) and the reward service's address (or that
                none is connected).
        """
        if self.cfg.task.reward == "env":
            return
        from reward_service.client import unknown_message, unknown_tasks

        env, client = self.cfg.task.env, self.clients.reward
        if client is None:
            raise ConfigError(f"env {env!r} is scored by a reward service (task.reward: service), but no reward "
                              "service is connected")
        address = getattr(client, "address", "in-process")
        try:
            unknown = unknown_tasks(client, env, list(dict.fromkeys(task_ids)), self.cfg.task.solo_mode)
        except ServiceError as err:
            raise ConfigError(f"env {env!r} is scored by the reward service at {address}, which did not answer "
                              f"({err.code.name}: {err.message})") from None
        if unknown:
            raise ConfigError(unknown_message(env, address, unknown))

    def learner_status(self) -> learner_pb2.StatusResponse:
        return self.learner.status(timeout=POLL_TIMEOUT_S)

    def sync_rollout_weights(self) -> None:
        """After a resume: make sure the rollout engine serves the learner's latest policy."""
        latest = self.learner.policy_version(timeout=POLL_TIMEOUT_S)
        engine = self.rollout.status(timeout=POLL_TIMEOUT_S)
        if latest.policy_version > engine.policy_version and latest.location:
            log.info("rollout engine at v%d, learner at v%d: loading %s", engine.policy_version, latest.policy_version, latest.location)
            self.rollout.update_weights(latest.policy_version, latest.location, timeout=UPDATE_WEIGHTS_TIMEOUT_S)

    def wait_for_engine(self, version: int) -> None:
        """Blocks until the rollout engine serves policy `version` (the learner's UpdateWeights landed),
        or a later version the learner has published.

        Raises:
            RuntimeError: the engine serves a version the learner never published.
            TimeoutError: not served within run.step_timeout_s.
        """
        served = [-1]
        unpublished_since: list[float] = []

        def serves() -> bool:
            self.alive_check()
            try:
                served[0] = self.rollout.status(timeout=POLL_TIMEOUT_S).policy_version
            except ServiceError as err:
                if not err.retryable:
                    raise
                served[0] = -1
            if served[0] <= version:
                return served[0] == version
            published = self.published_version()  # a later version is fine only if the learner published it
            if served[0] <= published:
                return True
            # the learner names a version once its UpdateWeights has returned: a moment after the engine serves it
            unpublished_since.append(time.monotonic())
            if published >= 0 and unpublished_since[-1] - unpublished_since[0] > UNPUBLISHED_GRACE_S:
                raise RuntimeError(f"the rollout engine serves policy version {served[0]}, which the learner never "
                                   f"published (it is at v{published}): something else loaded weights into the "
                                   "engine; refusing to train on them (docs/reliability.md, Security)")
            return False

        if not poll_until(serves, self.cfg.run.step_timeout_s, every_s=0.5):
            raise TimeoutError(f"the rollout engine did not serve policy version {version} within "
                               f"{self.cfg.run.step_timeout_s:.0f}s (serves v{served[0]})")

    def run_rollouts(self, task_ids: list[str], group_size: int, temperature: float, publish: bool, desc: str,
                     seed: int | None = None) -> list[common_pb2.TrajectoryGroup]:
        """One Rollout request; `seed` (default run.seed) seeds every episode's sampling (the rollout
        service derives one stream per task and sample from it)."""
        r = self.cfg.rollout
        request = rollout_pb2.RolloutRequest(
            env=self.cfg.task.env,
            task_ids=task_ids,
            group_size=group_size,
            sampling=common_pb2.SamplingParams(temperature=temperature, top_p=r.top_p, top_k=r.top_k,
                                               max_new_tokens=r.max_new_tokens,
                                               seed=self.cfg.run.seed if seed is None else seed),
            max_turns=r.max_turns,
            max_context_tokens=r.max_context_tokens,
            publish=publish,
            solo_mode=self.cfg.task.solo_mode,
        )
        groups = []
        with tqdm(total=len(task_ids), desc=desc, unit="group", leave=False) as bar:
            for group in self.rollout.rollout(request, timeout=self.cfg.run.step_timeout_s):
                groups.append(group)
                bar.update(1)
        if len(groups) != len(task_ids):
            raise RuntimeError(f"{desc}: asked for {len(task_ids)} groups, got {len(groups)}")
        return groups

    def published_version(self) -> int:
        """The learner's latest published (durable) policy version; -1 while it has none or does not answer."""
        try:
            return self.learner.policy_version(timeout=POLL_TIMEOUT_S).policy_version
        except ServiceError as err:
            # UNAVAILABLE: nothing published yet (warm start) or restarting; a busy learner may answer late;
            # a dead one is caught by alive_check
            if not err.retryable:
                raise
            return -1

    def wait_for_version(self, version: int) -> learner_pb2.StatusResponse:
        """Blocks until policy `version` is done: durable (the learner's PolicyVersion names it,
        which it does only after the version's checkpoint and folder are written) and served by
        the rollout engine. Returns the learner's Status then.

        Raises:
            TimeoutError: not done within run.step_timeout_s (the message says where it is).
        """
        published = [-1]

        def durable() -> bool:  # version 0 is the initial model: the engine starts with it, nothing is published
            if version <= 0:
                return True
            published[0] = self.published_version()
            if published[0] >= version:
                return True
            self.alive_check()
            return False

        if not poll_until(durable, self.cfg.run.step_timeout_s, every_s=0.5):
            try:
                st = self.learner_status()
                where = f"at v{st.policy_version}, {st.groups_trained} groups trained, v{published[0]} published"
            except ServiceError as err:
                where = f"Status: {err.code.name}"
            raise TimeoutError(f"learner did not publish policy version {version} within "
                               f"{self.cfg.run.step_timeout_s:.0f}s ({where})")
        self.wait_for_engine(version)
        # a busy learner may answer Status late: asked again (the liveness check between tries)
        for attempt in Retrying(stop=stop_after_delay(self.cfg.run.step_timeout_s), wait=wait_fixed(0.5),
                                retry=retry_if_exception(lambda e: isinstance(e, ServiceError) and e.retryable),
                                before_sleep=lambda _: self.alive_check(), reraise=True):
            with attempt:
                return self.learner_status()
        raise AssertionError("unreachable")

    def engine_usage(self) -> tuple[float, float]:
        """(busy, uptime) seconds of the rollout engine (its Status metrics)."""
        m = self.rollout.status(timeout=POLL_TIMEOUT_S).metrics
        return m.get("engine_busy_seconds", 0.0), m.get("engine_uptime_seconds", 0.0)

    # -- the loop ------------------------------------------------------------------------
    def validate(self, label: str, version: int) -> dict[str, float]:
        """Validation of the policy the engine serves (`version`) on the eval split; `label` names it
        ("base", "warm_start", "step N", "eval"); the base model takes `validation.base_trials`
        samples of the first `validation.base_num_tasks` tasks when those are set. Writes a "val" record at step = `version` (with
        `rl_step` = version − v0: −1 for the base model under a warm start, 0 for the policy RL
        starts from), <run dir>/validation/<label>.json and, for a τ²-Bench domain, the
        trajectories as τ²-Bench's results file <run dir>/validation/tau2/<label>.json
        (`write_tau2_results`)."""
        v = self.cfg.validation
        base = label == "base"
        trials = v.base_trials if base and v.base_trials else v.trials
        tasks = self.eval_tasks()
        if base and v.base_num_tasks:
            tasks = tasks[: v.base_num_tasks]
        started = time.time()
        groups = self.run_rollouts(tasks, trials, v.temperature, publish=False, desc=f"validation ({label}, v{version})")
        sampled = {turn.policy_version for g in groups for t in g.trajectories for turn in t.turns}
        if sampled and sampled != {version}:  # a request is pinned to one version: a later one was served
            actual = max(sampled)
            log.warning("validation %r asked for policy version %d, sampled by %s", label, version, sorted(sampled))
            if len(sampled) == 1 and label.startswith("step ") and actual > self.v0:
                label, version = f"step {actual - self.v0}", actual
        per_task_rewards, unscored = scored_trials(groups)
        record = {**validation_scores(per_task_rewards, trials), "tasks": len(tasks), "trials": trials,
                  **user_turn_counts([t for g in groups for t in g.trajectories]),
                  "unscored": float(sum(unscored.values())), "policy_version": version, "rl_step": version - self.v0}
        m, lo, hi = record["mean_at_1"], record["ci_low"], record["ci_high"]
        if unscored:
            log.warning("validation (%s): %d trial(s) unscored (their evaluation raised), left out of mean@1: %s",
                        label, sum(unscored.values()), dict(sorted(unscored.items())[:10]))
        with self._metrics_lock:
            self.metrics.write("val", version, record)
        name = label.replace(" ", "_")
        out = validation_dir(self.cfg.run.dir()) / f"{name}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        results = self.write_tau2_results(groups, tau2_results_dir(self.cfg.run.dir()) / f"{name}.json", started)
        out.write_text(json.dumps({"after": label, **record, "sampled_policy_versions": sorted(sampled),
                                   "per_purpose": per_purpose(per_task_rewards, self._eval_purpose),
                                   "per_task": dict(per_task_rewards), "unscored_per_task": unscored,
                                   "tau2_results": str(results) if results else None}, indent=1))
        log.info("validation (%s, v%d): mean@1 %.3f [%.3f, %.3f] on %d tasks x %d trials", label, version, m, lo, hi,
                 len(tasks), trials)
        return record

    def write_tau2_results(self, groups, path: Path, started: float) -> Path | None:
        """The groups of one validation as τ²-Bench's results file at `path`
        (`tau2_adapter.results.write_results`: `tau2 view --file <path>` opens it). None, with a log
        line, when task.env is not a τ²-Bench domain or its tasks are not τ²-Bench's."""
        from tau2_adapter.results import write_results

        cfg = self.cfg
        try:
            return write_results(path, groups, cfg.task.env, task_files=launch_inputs(cfg)["task_files"],
                                 agent_llm=self.policy_name, user_llm=None if cfg.task.solo_mode else cfg.models.user_simulator,
                                 max_steps=cfg.rollout.max_turns, seed=cfg.run.seed, started=started)
        except (KeyError, ValueError) as err:  # an env plugged in over gRPC: its tasks are not τ²-Bench's
            log.info("no τ²-Bench results file for env %r (%s: %s)", cfg.task.env, type(err).__name__, err)
            return None

    def warm_start(self, version: int) -> int:
        """Validates the base model and the warm-start policy (as far as not done yet); returns the version."""
        val = self.cfg.validation.every_steps > 0
        done = {p.stem for p in validation_dir(self.cfg.run.dir()).glob("*.json")}
        if version == 0:
            if val and "base" not in done:
                self.validate("base", 0)  # the learner trains on the demonstrations meanwhile
            version = self.wait_for_version(self.v0).policy_version
        self.wait_for_engine(self.v0)
        if val and "warm_start" not in done:
            self.validate("warm_start", self.v0)
        return version

    def run(self) -> int:
        """Trains until the learner's policy version reaches `v0 + run.steps`. Returns that version."""
        cfg = self.cfg
        pool = self.train_tasks()
        val_every = cfg.validation.every_steps
        self.check_reward(pool + (self.eval_tasks() if val_every else []))  # before anything else: never a silent 0
        status = self.learner_status()
        version = status.policy_version
        if version > 0:
            log.info("resuming at policy version %d (%d groups trained)", version, status.groups_trained)
            self.sync_rollout_weights()
        if cfg.warm_start.enabled:
            version = self.warm_start(version)
        elif val_every and version == 0:
            self.validate("base", 0)
        start = version - self.v0
        self._recover_train_records(start)
        if start < cfg.run.steps:
            self._train_loop(start, pool)
        elif val_every and cfg.run.steps > 0:
            self._validate_last_step()
        return self.learner_status().policy_version

    def _validate_last_step(self) -> None:
        """Every step trained already (a resumed or in-run recovered run): validate the last step
        unless its validation was written — it is lost when a service dies while it runs (the
        recovery restarts `run`, which finds nothing left to train)."""
        steps = self.cfg.run.steps
        if (validation_dir(self.cfg.run.dir()) / f"step_{steps}.json").is_file():
            return
        log.info("validation of step %d not written (interrupted): running it", steps)
        self.wait_for_engine(self.v0 + steps)
        self.validate(f"step {steps}", self.v0 + steps)

    def _recover_train_records(self, done_steps: int) -> list[int]:
        """Writes the train record of every RL step the learner finished but the driver did not
        record (the run stopped after the learner published the version and before the driver
        saw it served, e.g. a dead vLLM engine): one record per policy version, from the
        learner's own record of that step (<run dir>/learner/metrics.jsonl), marked
        `recovered` 1. Returns the steps written.
        """

        run_dir = self.cfg.run.dir()
        recovered = recovered_train_records(read_metrics(run_dir), read_metrics(run_dir / "learner"), self.v0, done_steps)
        for s, record in recovered:
            with self._metrics_lock:
                self.metrics.write("train", s, record)
        missing = [s for s, _ in recovered]
        if not missing:
            return []
        log.info("train records of steps %s written from the learner's (the run stopped before the driver recorded them)",
                 missing)
        return missing

    def _train_loop(self, start: int, pool: list[str]) -> None:
        """RL steps `start`..run.steps-1 (0-based): a producer thread rolls out, this thread
        waits for each version, writes its record and validates (module docstring)."""
        cfg = self.cfg
        k = cfg.rollout.max_staleness
        val_every = cfg.validation.every_steps
        done = threading.Condition()
        finished = [start]  # steps < finished[0] are done (version published + served, validated)
        stop = threading.Event()
        produced: queue.Queue = queue.Queue()

        def produce() -> None:
            try:
                for step in range(start, cfg.run.steps):
                    t_gate = time.time()
                    with done:  # at most k + 1 steps of rollouts ahead of the finished ones
                        while finished[0] < step - k and not stop.is_set():
                            done.wait(0.5)
                    if stop.is_set():
                        return
                    version = self.v0 + max(step - k, start)
                    self.wait_for_version(version)  # never sample with weights older than that
                    if stop.is_set():
                        return
                    t0 = time.time()
                    # a fresh sampling seed per step; validations all use run.seed (common random numbers
                    # across policy versions: the paired differences compare like with like)
                    tasks = self.step_tasks(step, pool)
                    self._in_flight = len(tasks)
                    groups = self.run_rollouts(tasks, cfg.rollout.group_size, cfg.rollout.temperature,
                                               publish=True, desc=f"rollouts step {step + 1} (>= v{version})",
                                               seed=cfg.run.seed * 100_003 + step + 1)
                    if stop.is_set():
                        return
                    self._in_flight = 0
                    self.groups_published += len(groups)
                    with self._metrics_lock:
                        for g in groups:
                            for t in g.trajectories:
                                if math.isnan(t.reward):  # its evaluation raised: no score, the reason in the log
                                    log.warning("step %d: trajectory %s of task %s unscored: %s", step + 1,
                                                t.trajectory_id, g.task_id, t.reward_breakdown.info[:500])
                                self.metrics.write("trajectory", step + 1, {
                                    "reward": t.reward, "tokens": len(t.token_ids), "turns": len(t.turns),
                                    "user_turns": int(t.metrics.get("user_turns", 0.0)),
                                    "policy_version": t.policy_version,
                                    "policy_version_last": max((x.policy_version for x in t.turns), default=t.policy_version),
                                    "unscored": float(math.isnan(t.reward))})
                    produced.put((step, groups, time.time() - t0, t0 - t_gate))
            except BaseException as err:  # noqa: BLE001 - handed to the main thread
                produced.put(err)

        producer = self._producer = threading.Thread(target=produce, name="rollout-producer", daemon=True)
        t_loop = t_prev = time.time()
        busy_prev, up_prev = self.engine_usage()
        producer.start()
        try:
            with tqdm(total=cfg.run.steps, initial=start, desc="train", unit="step") as bar:
                for step in range(start, cfg.run.steps):
                    item = self._next_produced(produced, producer)
                    got, groups, t_roll, t_wait = item
                    assert got == step, (got, step)
                    trajs = [t for g in groups for t in g.trajectories]
                    failed = [t for t in trajs if t.termination_reason == common_pb2.TERMINATION_REASON_INFRASTRUCTURE_ERROR]
                    if failed:
                        log.warning("%d of %d rollouts failed for infrastructure reasons (engine, env or reward service)",
                                    len(failed), len(trajs))
                    if len(failed) == len(trajs):
                        raise RuntimeError(f"every rollout of step {step + 1} failed for infrastructure reasons "
                                           f"(see {self.cfg.run.dir() / 'logs'}/rollout.log); stopping")
                    status = self.wait_for_version(self.v0 + step + 1)
                    now = time.time()
                    busy, up = self.engine_usage()
                    rewards = [t.reward for t in trajs if not math.isnan(t.reward)]  # NaN: unscored
                    m = sum(rewards) / len(rewards) if rewards else math.nan
                    std = (sum((r - m) ** 2 for r in rewards) / len(rewards)) ** 0.5 if rewards else math.nan
                    record = {"reward_mean": m, "reward_std": std, "unscored": float(len(trajs) - len(rewards)),
                              "groups": len(groups), **user_turn_counts(trajs), "rollout_s": t_roll,
                              "rollout_wait_s": t_wait, "infrastructure_errors": len(failed),
                              "step_s": now - t_prev, "wall_s": now - t_loop, "groups_trained": status.groups_trained,
                              "max_staleness": k,
                              "engine_idle_fraction": 1.0 - (busy - busy_prev) / (up - up_prev) if up > up_prev else 0.0}
                    t_prev, busy_prev, up_prev = now, busy, up
                    learner_metrics = dict(status.metrics)
                    if learner_metrics.get("policy_version") == self.v0 + step + 1:
                        record.update({key: v for key, v in learner_metrics.items() if key not in record})
                    else:  # async: the learner took its next step before this Status: its record is in learner/
                        log.info("learner metrics of v%d not in Status (it is at v%s)", self.v0 + step + 1,
                                 learner_metrics.get("policy_version"))
                    with self._metrics_lock:
                        self.metrics.write("train", step + 1, record)
                    bar.set_postfix(reward=f"{m:.3f}", loss=f"{status.metrics.get('loss', float('nan')):.4g}")
                    bar.update(1)
                    if val_every and ((step + 1) % val_every == 0 or step + 1 == cfg.run.steps):
                        self.validate(f"step {step + 1}", self.v0 + step + 1)
                    with done:
                        finished[0] = step + 1
                        done.notify_all()
        finally:
            stop.set()
            with done:
                done.notify_all()

    def _next_produced(self, produced: queue.Queue, producer: threading.Thread):
        """The producer's next step (waiting for it), or its exception raised here."""
        while True:
            self.alive_check()
            try:
                item = produced.get(timeout=1.0)
            except queue.Empty:
                if not producer.is_alive() and produced.empty():
                    raise RuntimeError("the rollout producer stopped") from None
                continue
            if isinstance(item, BaseException):
                raise item
            return item


def validation_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "validation"


def tau2_results_dir(run_dir: str | Path) -> Path:
    """Where each validation's trajectories are written as τ²-Bench results files
    (`tau2 view --dir <this>`); a folder of its own, so that validation/*.json stays the summaries."""
    return validation_dir(run_dir) / "tau2"


def scored_trials(groups) -> tuple[dict[str, list[float]], dict[str, int]]:
    """(task id -> the rewards of its scored trials, task id -> its number of unscored trials).

    An unscored trial (reward NaN: its evaluation raised, reward_service.scoring) is no
    evidence about the policy: it is left out of the rewards, not counted as 0, and counted
    on its own. A task whose every trial is unscored has no rewards entry."""
    rewards: dict[str, list[float]] = defaultdict(list)
    unscored: dict[str, int] = defaultdict(int)
    for g in groups:
        for t in g.trajectories:
            if math.isnan(t.reward):
                unscored[g.task_id] += 1
            else:
                rewards[g.task_id].append(float(t.reward))
    return dict(rewards), dict(unscored)


def validation_scores(per_task_rewards: dict[str, list[float]], trials: int) -> dict[str, float]:
    """mean@1 (mean over tasks of the per-task mean, with its 95% CI) and pass^k for k = 1..trials
    (τ²-Bench's success: reward 1.0), over the scored trials only.

    pass^k is over the tasks with at least k scored trials; NaN where no task has (and
    mean@1 is NaN without any scored trial)."""
    task_means = [sum(r) / len(r) for r in per_task_rewards.values() if r]
    m, lo, hi = mean_ci(task_means) if task_means else (math.nan, math.nan, math.nan)
    out = {"mean_at_1": m, "ci_low": lo, "ci_high": hi, "scored_tasks": float(len(task_means))}
    for k in range(1, trials + 1):
        ok = {task: [r >= 1.0 - 1e-6 for r in rs] for task, rs in per_task_rewards.items() if len(rs) >= k}
        out[f"pass_hat_{k}"] = pass_hat_k(ok, k) if ok else math.nan
    return out


def per_purpose(per_task_rewards: dict[str, list[float]], purpose: dict[str, str]) -> dict[str, dict[str, float]]:
    """Validation rewards by task purpose (τ²-Bench ``Task.description.purpose``; "" when none).

    Args:
        per_task_rewards: task id -> the rewards of its trials.
        purpose: task id -> purpose; tasks not in it count under "".

    Returns:
        {purpose: {"tasks": n, "mean_at_1": mean of the per-task means, "ci_low", "ci_high": its
        95 % Student-t interval over tasks (`mean_ci`)}}, purposes sorted.
    """
    by: dict[str, list[float]] = defaultdict(list)
    for task_id, rewards in per_task_rewards.items():
        if rewards:
            by[purpose.get(task_id, "")].append(sum(rewards) / len(rewards))
    out = {}
    for p, means in sorted(by.items()):
        m, lo, hi = mean_ci(means)
        out[p] = {"tasks": len(means), "mean_at_1": m, "ci_low": lo, "ci_high": hi}
    return out


def stratified_order(ids: list[str], stratum: dict[str, str]) -> list[str]:
    """``ids`` dealt round-robin across strata, keeping each stratum's order of ``ids``.

    Strata are taken in the order their first member appears in ``ids``; each round takes
    the next task of every stratum not yet exhausted. So any ``k`` consecutive tasks hold
    ``k // S`` or more of each of the S strata while every stratum has tasks left (a
    stratum that runs out drops from later rounds).

    Args:
        ids: task ids, already in the wanted (e.g. seeded shuffled) order.
        stratum: task id -> stratum key (here τ²-Bench's ``Task.description.purpose``).

    Returns:
        a permutation of ``ids``.
    """
    by: dict[str, list[str]] = {}
    for i in ids:
        by.setdefault(stratum.get(i, ""), []).append(i)
    queues = list(by.values())
    out: list[str] = []
    for r in range(max((len(q) for q in queues), default=0)):
        out.extend(q[r] for q in queues if r < len(q))
    return out


def read_validations(run_dir: str | Path) -> list[dict]:
    """The run's validations (<run dir>/validation/*.json), in policy-version order. A file that is not
    a validation (one cut short when the driver was killed writing it) is skipped with a warning."""
    out = []
    for p in sorted(validation_dir(run_dir).glob("*.json")):
        try:
            record = json.loads(p.read_text(encoding="utf-8"))
        except (ValueError, OSError) as err:
            record = err
        if isinstance(record, dict) and isinstance(record.get("policy_version"), int) and "after" in record:
            out.append(record)
        else:
            log.warning("%s: skipped, not a validation record (cut short?): %s", p, str(record)[:200])
    order = {"base": 0, "warm_start": 1}
    return sorted(out, key=lambda r: (r["policy_version"], order.get(r["after"], 2)))


def paired_difference(after: dict, before: dict) -> dict[str, float]:
    """Mean of the per-task reward difference `after − before` over the tasks both validated,
    with the 95 % interval of the paired Student-t test over tasks (`sinkflex.reporting.paired_ci`,
    scipy.stats.ttest_rel).

    Raises:
        ValueError: no task in common.
    """
    common = sorted(set(after["per_task"]) & set(before["per_task"]))
    if not common:
        raise ValueError(f"validations {after['after']!r} and {before['after']!r} share no task")
    mean = lambda xs: sum(xs) / len(xs)
    m, lo, hi = paired_ci([mean(after["per_task"][t]) for t in common], [mean(before["per_task"][t]) for t in common])
    return {"after": after["after"], "before": before["after"], "difference": m, "ci_low": lo, "ci_high": hi,
            "tasks": len(common)}
