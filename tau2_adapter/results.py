"""Trajectory groups as τ²-Bench's own results file (`tau2.data_model.simulation.Results`).

What `tau2 run` saves and `tau2 view` / `tau2.metrics.agent_metrics.compute_metrics` read:
`Results(info, tasks, simulations)`. `results_of` builds it from the groups of one validation
or evaluation (`common.v1.TrajectoryGroup`, one group per task, its trajectories the trials):

- one `SimulationRun` per scored trajectory: id = trajectory_id, trial = its index in the
  group, messages = the trajectory's messages without the system prompt (`to_tau2_messages`),
  reward_info = the reward service's breakdown as τ²-Bench's `RewardInfo` (reward, basis,
  per-kind rewards in the basis, and τ²-Bench's check records: db_check, action_checks, ...),
  duration = the episode's wall seconds (metric ``episode_seconds``), termination_reason =
  τ²-Bench's reason (`termination.PB_TO_TAU2`); the rollout worker's own reasons, which
  τ²-Bench does not have, become ``max_steps`` (turn or context budget spent) and
  ``agent_error`` (infrastructure error), the wire name kept in ``reward_info.info``;
- an unscored trajectory (reward NaN: its evaluation raised) is left out, as it is left out of
  mean@1 (τ²-Bench's metrics would read a missing reward as a failure);
- tasks = the τ²-Bench `Task` of every group (`tasks.domain_tasks`);
- info: the domain and its policy (τ²-Bench's registry), the agent (``implementation``
  "sinkflex", ``llm`` the policy's name), the user (the user simulator's model, or "none" in
  solo mode), trials, max_steps (the rollout's max_turns), seed.
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sinkflex.api.common.v1 import common_pb2
from tau2_adapter.termination import PB_TO_TAU2

log = logging.getLogger(__name__)

#: τ²-Bench's reasons for the rollout worker's own (not τ²-Bench's) termination reasons.
WORKER_REASONS = {
    common_pb2.TERMINATION_REASON_MAX_TURNS: "max_steps",
    common_pb2.TERMINATION_REASON_MAX_CONTEXT_TOKENS: "max_steps",
    common_pb2.TERMINATION_REASON_INFRASTRUCTURE_ERROR: "agent_error",
    common_pb2.TERMINATION_REASON_UNSPECIFIED: "agent_stop",
}

_REWARD_TYPE_NAMES = {common_pb2.REWARD_TYPE_DB: "DB", common_pb2.REWARD_TYPE_ACTION: "ACTION",
                      common_pb2.REWARD_TYPE_COMMUNICATE: "COMMUNICATE",
                      common_pb2.REWARD_TYPE_ENV_ASSERTION: "ENV_ASSERTION",
                      common_pb2.REWARD_TYPE_NL_ASSERTION: "NL_ASSERTION"}

#: RewardInfo fields that hold τ²-Bench's check records (the keys of a component's details_json).
_CHECK_FIELDS = ("db_check", "env_assertions", "action_checks", "nl_assertions", "communicate_checks")


def reward_info(t: common_pb2.Trajectory):
    """τ²-Bench's `RewardInfo` of a scored trajectory: reward, basis, the reward of each kind in
    the basis, the check records the reward service sent (details_json of each component), and
    ``info`` {"sinkflex": the breakdown's info, "termination_reason": the wire reason's name}.
    Records τ²-Bench's model refuses are kept as JSON under ``info["checks"]`` instead."""
    from tau2.data_model.simulation import RewardInfo

    b = t.reward_breakdown
    checks: dict = {}
    breakdown = {}
    for c in b.components:
        name = _REWARD_TYPE_NAMES.get(c.type)
        try:
            details = json.loads(c.details_json) if c.details_json else {}
        except ValueError:
            details = {}
        if name and details.get("in_basis", True):
            breakdown[name] = float(c.reward)
        checks.update({k: v for k, v in details.items() if k in _CHECK_FIELDS and v is not None})
    info = {"sinkflex": b.info, "termination_reason": common_pb2.TerminationReason.Name(t.termination_reason)}
    base = {"reward": float(t.reward), "reward_basis": [_REWARD_TYPE_NAMES[r] for r in b.reward_basis
                                                      if r in _REWARD_TYPE_NAMES] or None,
                "reward_breakdown": breakdown or None, "info": info}
    try:
        return RewardInfo(**base, **checks)
    except ValueError:  # pydantic's ValidationError: records of another tau2 version
        return RewardInfo(**{**base, "info": {**info, "checks": checks}})


def termination_reason(t: common_pb2.Trajectory) -> str:
    """τ²-Bench's termination reason (a `TerminationReason` value) of a trajectory."""
    return PB_TO_TAU2.get(t.termination_reason) or WORKER_REASONS.get(t.termination_reason, "agent_error")


def results_of(groups: Sequence[common_pb2.TrajectoryGroup], env: str, task_files: Sequence[str] = (),
               agent_llm: str = "", user_llm: str | None = None, max_steps: int = 0, seed: int | None = None,
               started: float | None = None):
    """τ²-Bench `Results` of one validation's or evaluation's groups (module docstring).

    Args:
        groups: one group per task (`task_id`), its trajectories the trials.
        env: the τ²-Bench domain.
        task_files: the extra task sets the env service serves (`tasks.domain_tasks`).
        agent_llm: the policy's name (e.g. its folder).
        user_llm: the user simulator's model (None: solo mode, no user simulator).
        max_steps: the rollout's turn budget.
        seed: the sampling seed of the request.
        started: Unix time the request started (each run's start_time; default now).

    Raises:
        KeyError: a group's task is not a task of `env` (with `task_files`).
    """
    from tau2.data_model.simulation import (
        AgentInfo,
        Info,
        Results,
        SimulationRun,
        UserInfo,
    )
    from tau2.environment.environment import EnvironmentInfo

    from tau2_adapter.convert import to_tau2_messages
    from tau2_adapter.tasks import domain_tasks

    task_set = domain_tasks(env, list(task_files))
    tasks = [task_set.tasks[g.task_id] for g in groups]
    t0 = datetime.fromtimestamp(started, UTC) if started is not None else datetime.now(UTC)
    trials = max((len(g.trajectories) for g in groups), default=0)
    runs = []
    for g in groups:
        for trial, t in enumerate(g.trajectories):
            if math.isnan(t.reward):
                continue
            duration = float(t.metrics.get("episode_seconds", 0.0))
            runs.append(SimulationRun(
                id=t.trajectory_id or f"{g.group_id}-{trial}", task_id=g.task_id, trial=trial, seed=seed,
                start_time=t0.isoformat(), end_time=(t0 + timedelta(seconds=duration)).isoformat(), duration=duration,
                termination_reason=termination_reason(t), reward_info=reward_info(t), agent_cost=0.0, user_cost=0.0,
                messages=to_tau2_messages(t.messages, include_system=False)))
    info = Info(git_commit=_git_commit(), num_trials=trials, max_steps=max_steps, max_errors=0, seed=seed,
                user_info=UserInfo(implementation="user_simulator" if user_llm else "none", llm=user_llm),
                agent_info=AgentInfo(implementation="sinkflex", llm=agent_llm),
                environment_info=EnvironmentInfo(domain_name=env, policy=_domain_policy(env)))
    return Results(info=info, tasks=tasks, simulations=runs)


def write_results(path: str | Path, groups: Sequence[common_pb2.TrajectoryGroup], env: str, **kw) -> Path:
    """Writes `results_of(groups, env, **kw)` to `path` as τ²-Bench's `Results.save` does (JSON);
    `tau2 view --file <path>` opens it and `Results.load` reads it. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    results_of(groups, env, **kw).save(path)
    return path


def _domain_policy(env: str) -> str:
    """The domain's policy text from τ²-Bench's registry ("" for a domain it does not know)."""
    try:
        from tau2.registry import registry

        return registry.get_env_constructor(env)().policy
    except Exception:
        log.debug("no τ²-Bench policy for domain %r", env, exc_info=True)
        return ""


def _git_commit() -> str:
    """This checkout's commit ("" outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""
