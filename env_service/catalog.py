"""The tau2 domains the env service serves: environments, tasks and task splits.

The environment constructor comes from tau2's registry (`tau2.registry.registry`): a
fresh `tau2.environment.environment.Environment` with its own DB per session. Tasks
(`tau2.data_model.tasks.Task`) and splits come from `tau2_adapter.tasks.domain_tasks`:
the tasks tau2 ships with their splits (`get_tasks_split`, e.g. retail train 74 / test 40 /
base 114; a domain without a split file gets one split, "base", with all its tasks;
telecom serves all its tasks, base 114 plus the generated "full" set, 2285 in all), plus
the task files the config names for the domain (`EnvServiceConfig.task_files`, tau2's own
format, see docs/tasks.md).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Callable

from sinkflex.errors import clip, invalid_argument, not_found

log = logging.getLogger(__name__)

_DESCRIPTIONS = {
    "retail": "tau2-Bench retail: customer service for an online store (orders, returns, exchanges).",
    "airline": "tau2-Bench airline: customer service for flight reservations (book, change, cancel).",
    "telecom": "tau2-Bench telecom: dual-control technical support; the user acts on their phone with tools.",
    "mock": "tau2-Bench mock: a tiny task-management domain for tests (supports solo mode).",
}


@dataclass
class Domain:
    """One tau2 domain: how to build its environment, its tasks, its splits."""

    name: str
    description: str
    make_environment: Callable[..., object]  # (solo_mode: bool) -> tau2 Environment
    tasks: dict  # task id -> tau2 Task, in tau2's order
    splits: dict[str, list[str]] = field(default_factory=dict)  # split name -> task ids
    supports_solo: bool = False
    _tools: dict = field(default_factory=dict, repr=False)

    def agent_tools(self, environment, solo_mode: bool) -> list:
        """The agent's tau2 Tools (solo mode: the user's tools too), built once per mode.

        tau2 rebuilds pydantic models for every tool on each `get_tools()` call (0.1-0.6 s
        a session); the agent uses the Tools only for their specs -- calls run through the
        session's own environment -- so one list per mode serves every session.
        """
        if solo_mode not in self._tools:
            tools = environment.get_tools()
            if solo_mode and environment.user_tools is not None:
                tools = tools + environment.get_user_tools()
            self._tools[solo_mode] = tools
        return list(self._tools[solo_mode])

    def user_tools(self, environment) -> list | None:
        """The user simulator's tau2 Tools (None where the domain has none), built once.

        Unlike the agent's, the user simulator only reads their specs too (its tool calls
        run through the orchestrator's environment)."""
        if "user" not in self._tools:
            self._tools["user"] = environment.get_user_tools() if environment.user_tools is not None else None
        return self._tools["user"]

    def task(self, task_id: str):
        """The tau2 Task `task_id`. Raises ServiceError NOT_FOUND."""
        try:
            return self.tasks[task_id]
        except KeyError:
            raise not_found(f"unknown task {clip(task_id)} in env {self.name!r} ({len(self.tasks)} tasks)") from None

    def task_ids(self, split: str = "") -> list[str]:
        """Task ids of `split` ("" = all tasks). Raises ServiceError NOT_FOUND for an unknown split."""
        if not split:
            return list(self.tasks)
        try:
            return list(self.splits[split])
        except KeyError:
            raise not_found(f"unknown split {clip(split)} of env {self.name!r} (splits: {', '.join(self.splits)})") from None

    def sample_task_id(self, split: str, seed: int) -> str:
        """A task id drawn uniformly from `split` with `random.Random(seed)` (deterministic)."""
        ids = self.task_ids(split)
        if not ids:
            raise invalid_argument(f"split {clip(split)} of env {self.name!r} has no tasks")
        return random.Random(seed).choice(ids)


def _load_domain(name: str, task_files=()) -> Domain:
    from tau2.registry import registry
    from tau2_adapter.tasks import domain_tasks

    make_env = registry.get_env_constructor(name)
    task_set = domain_tasks(name, task_files)
    try:
        make_env(solo_mode=True)
        supports_solo = True
    except ValueError:  # e.g. "Retail domain does not support solo mode"
        supports_solo = False
    return Domain(
        name=name,
        description=_DESCRIPTIONS.get(name, f"tau2-Bench {name}"),
        make_environment=make_env,
        tasks=dict(task_set.tasks),
        splits={k: list(v) for k, v in task_set.splits.items()},
        supports_solo=supports_solo,
    )


def check_domains(names: tuple[str, ...] | list[str]) -> None:
    """Raises ValueError naming the first of `names` that is not a domain τ²-Bench ships (its
    registry's domains), and the ones it ships."""
    from tau2.registry import registry

    known = registry.get_domains()
    for name in names:
        if name not in known:
            raise ValueError(f"unknown tau2 domain {clip(name)}; tau2 ships {', '.join(known)}")


class Catalog:
    """The served domains, loaded once (the server is NOT_SERVING until this is built).

    Args:
        names: tau2 domains.
        task_files: domain -> extra task dirs/files (tau2's format) served besides tau2's
            own tasks. Raises ValueError naming the file and id on a bad one.
    """

    def __init__(self, names: tuple[str, ...] | list[str], task_files: dict | None = None):
        check_domains(names)
        from tau2_adapter import guards

        guards.install()  # τ²-Bench's calculate tool cannot stall the server (tau2_adapter/guards.py)
        task_files = dict(task_files or {})
        for name in task_files:
            if name not in names:
                raise ValueError(f"task files given for domain {name!r}, which is not served ({', '.join(names)})")
        self.domains: dict[str, Domain] = {n: _load_domain(n, tuple(task_files.get(n, ()))) for n in names}

    def get(self, env: str) -> Domain:
        """The domain `env`. Raises ServiceError NOT_FOUND."""
        try:
            return self.domains[env]
        except KeyError:
            raise not_found(f"unknown env {clip(env)}; this server serves: {', '.join(self.domains)}") from None
