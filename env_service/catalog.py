"""The tau2 domains the env service serves: environments, tasks and task splits.

Everything here comes from tau2's registry (`tau2.registry.registry`): the domain's
environment constructor (a fresh `tau2.environment.environment.Environment` with its own
DB per session), its tasks (`tau2.data_model.tasks.Task`) and its task splits
(`get_tasks_split`, e.g. retail train 74 / test 40 / base 114). A domain without a split
file gets one split, "base", with all its tasks. Telecom serves all its tasks
(`get_tasks(None)`: base 114 plus the generated "full" set, 2285 in all) so that every
split it ships is servable.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Callable

from sinkflex.errors import invalid_argument, not_found

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
            raise not_found(f"unknown task {task_id!r} in env {self.name!r} ({len(self.tasks)} tasks)") from None

    def task_ids(self, split: str = "") -> list[str]:
        """Task ids of `split` ("" = all tasks). Raises ServiceError NOT_FOUND for an unknown split."""
        if not split:
            return list(self.tasks)
        try:
            return list(self.splits[split])
        except KeyError:
            raise not_found(f"unknown split {split!r} of env {self.name!r} (splits: {', '.join(self.splits)})") from None

    def sample_task_id(self, split: str, seed: int) -> str:
        """A task id drawn uniformly from `split` with `random.Random(seed)` (deterministic)."""
        ids = self.task_ids(split)
        if not ids:
            raise invalid_argument(f"split {split!r} of env {self.name!r} has no tasks")
        return random.Random(seed).choice(ids)


def _load_domain(name: str) -> Domain:
    from tau2.registry import registry

    make_env = registry.get_env_constructor(name)
    loader = registry.get_tasks_loader(name)
    tasks_list = loader(None)  # every task the domain ships (all splits)
    tasks = {t.id: t for t in tasks_list}
    split_loader = registry.get_task_splits_loader(name)
    if split_loader is None:  # mock: not registered, but the domain module may ship one
        module = __import__(f"tau2.domains.{name}.environment", fromlist=["get_tasks_split"])
        split_loader = getattr(module, "get_tasks_split", None)
    splits: dict[str, list[str]] = {}
    if split_loader is not None:
        try:
            splits = {k: [i for i in v if i in tasks] for k, v in split_loader().items()}
        except (FileNotFoundError, OSError) as err:
            log.info("env %s ships no split file (%s): one split 'base'", name, err)
    if not splits:
        splits = {"base": list(tasks)}
    try:
        make_env(solo_mode=True)
        supports_solo = True
    except ValueError:  # e.g. "Retail domain does not support solo mode"
        supports_solo = False
    return Domain(
        name=name,
        description=_DESCRIPTIONS.get(name, f"tau2-Bench {name}"),
        make_environment=make_env,
        tasks=tasks,
        splits=splits,
        supports_solo=supports_solo,
    )


class Catalog:
    """The served domains, loaded once (the server is NOT_SERVING until this is built)."""

    def __init__(self, names: tuple[str, ...] | list[str]):
        from tau2.registry import registry

        known = registry.get_domains()
        for name in names:
            if name not in known:
                raise ValueError(f"unknown tau2 domain {name!r}; tau2 ships {', '.join(known)}")
        self.domains: dict[str, Domain] = {n: _load_domain(n) for n in names}

    def get(self, env: str) -> Domain:
        """The domain `env`. Raises ServiceError NOT_FOUND."""
        try:
            return self.domains[env]
        except KeyError:
            raise not_found(f"unknown env {env!r}; this server serves: {', '.join(self.domains)}") from None
