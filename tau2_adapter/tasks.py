"""Task sets in τ²-Bench's own format, and the tasks τ²-Bench ships, merged per domain.

A task dir is τ²-Bench's layout (as in `tau2/data/tau2/domains/<domain>/`):

- `tasks.json`: a JSON list of τ²-Bench `Task` objects (validated with
  `tau2.data_model.tasks.Task`);
- `split_tasks.json` (optional): `{split name: [task ids]}`.

A single tasks file `X.json` may be given instead of a dir; its splits are then read from
`split_X.json` next to it (τ²-Bench's own naming, see `tau2.domains.mock.environment`).
Without a split file the tasks belong to no named split (they are still served by id and
in the listing of all tasks).

`domain_tasks(domain, files)` is what the env and reward services serve for a domain:
τ²-Bench's shipped tasks and splits, then each file's, refusing duplicate task ids, splits
that name unknown ids, and a split name that already exists with different ids.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

TASKS_FILE = "tasks.json"
SPLITS_FILE = "split_tasks.json"


@dataclass(frozen=True)
class TaskSet:
    """Tasks by id (in file order) and named splits of task ids.

    Shared and cached: treat both dicts as read-only (copy before changing).
    """

    tasks: dict = field(default_factory=dict)  # task id -> tau2.data_model.tasks.Task
    splits: dict[str, list[str]] = field(default_factory=dict)  # split name -> task ids

    def __len__(self) -> int:
        return len(self.tasks)

    def split(self, name: str) -> list:
        """The Tasks of split `name`, in the split's order. Raises KeyError for an unknown split."""
        return [self.tasks[i] for i in self.splits[name]]


def _files_of(path: Path) -> tuple[Path, Path]:
    if path.is_dir():
        return path / TASKS_FILE, path / SPLITS_FILE
    return path, path.parent / f"split_{path.stem}.json"


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON: {err}") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text (JSON is UTF-8): {err}") from None
    except ValueError as err:  # a number Python will not convert (more than 4300 digits)
        raise ValueError(f"{path}: a value cannot be read: {str(err)[:300]}") from None
    except OSError as err:
        raise ValueError(f"{path}: cannot read: {err}") from None


def load_task_dir(path: str | Path) -> TaskSet:
    """The TaskSet of a task dir (`tasks.json` + optional `split_tasks.json`) or a tasks JSON file.

    Raises:
        ValueError: naming the file (and the task id or split) on a missing file, bad JSON,
            a task that is not a valid τ²-Bench Task, a duplicate id, or a split that is
            not a list of known ids.
    """
    from pydantic import ValidationError
    from tau2.data_model.tasks import Task

    path = Path(path)
    tasks_file, splits_file = _files_of(path)
    if not path.exists():
        raise ValueError(f"{path}: no such task dir or tasks file")
    if not tasks_file.is_file():
        raise ValueError(f"{path}: no {TASKS_FILE} (a task dir holds {TASKS_FILE} and {SPLITS_FILE})")
    raw = _read_json(tasks_file)
    if not isinstance(raw, list):
        raise ValueError(f"{tasks_file}: must be a JSON list of tau2 Task objects, got {type(raw).__name__}")
    tasks: dict = {}
    for i, item in enumerate(raw):
        name = repr(item.get("id")) if isinstance(item, dict) and "id" in item else f"#{i}"
        try:
            task = Task.model_validate(item)
        except ValidationError as err:
            raise ValueError(f"{tasks_file}: task {name} is not a valid tau2 Task: {err}") from None
        if task.id in tasks:
            raise ValueError(f"{tasks_file}: duplicate task id {task.id!r}")
        tasks[task.id] = task
    splits: dict[str, list[str]] = {}
    if splits_file.is_file():
        raw_splits = _read_json(splits_file)
        if not isinstance(raw_splits, dict):
            raise ValueError(f"{splits_file}: must be a JSON object {{split name: [task ids]}}")
        for split, ids in raw_splits.items():
            if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                raise ValueError(f"{splits_file}: split {split!r} must be a list of task ids")
            for task_id in ids:
                if task_id not in tasks:
                    raise ValueError(f"{splits_file}: split {split!r} lists unknown task id {task_id!r} (not in {tasks_file})")
            splits[split] = list(ids)
    return TaskSet(tasks=tasks, splits=splits)


def task_sets() -> list[str]:
    """Names of τ²-Bench's registered task sets (the domains, and e.g. telecom-workflow)."""
    from tau2.registry import registry

    return list(registry.get_task_sets())


@functools.lru_cache(maxsize=None)
def shipped_tasks(domain: str) -> TaskSet:
    """τ²-Bench's own tasks of `domain` (every split) and its splits (cached).

    A domain without a split file gets one split, "base", with all its tasks; split ids
    that are not among the tasks are dropped. Raises ValueError for an unknown domain.
    """
    from tau2.registry import registry

    known = task_sets()
    if domain not in known:
        raise ValueError(f"unknown tau2 domain {domain!r}; tau2 ships task sets for {', '.join(known)}")
    loader = registry.get_tasks_loader(domain)
    try:
        tasks_list = loader(None)  # every task the domain ships (all splits)
    except TypeError:
        tasks_list = loader()
    tasks = {t.id: t for t in tasks_list}
    split_loader = registry.get_task_splits_loader(domain)
    if split_loader is None:  # mock: not registered, but the domain module may ship one
        try:
            module = __import__(f"tau2.domains.{domain}.environment", fromlist=["get_tasks_split"])
            split_loader = getattr(module, "get_tasks_split", None)
        except ImportError:
            split_loader = None
    splits: dict[str, list[str]] = {}
    if split_loader is not None:
        try:
            splits = {k: [i for i in v if i in tasks] for k, v in split_loader().items()}
        except (FileNotFoundError, OSError) as err:
            log.info("tau2 domain %s ships no split file (%s): one split 'base'", domain, err)
    if not splits:
        splits = {"base": list(tasks)}
    return TaskSet(tasks=tasks, splits=splits)


def _key(task_files: Sequence[str | Path]) -> tuple[str, ...]:
    if isinstance(task_files, (str, Path)):
        task_files = [task_files]
    return tuple(str(Path(f).expanduser().resolve()) for f in task_files)


def domain_tasks(domain: str, task_files: Sequence[str | Path] = ()) -> TaskSet:
    """τ²-Bench's shipped tasks and splits of `domain`, plus those of `task_files` (cached
    per domain and resolved file paths).

    Raises:
        ValueError: unknown domain; a bad file (see `load_task_dir`); a task id defined
            twice (shipped or in an earlier file); a split name that already exists with
            different ids. The message names the file and the id or split.
    """
    return _domain_tasks(domain, _key(task_files))


@functools.lru_cache(maxsize=None)
def _domain_tasks(domain: str, files: tuple[str, ...]) -> TaskSet:
    base = shipped_tasks(domain)
    if not files:
        return base
    tasks = dict(base.tasks)
    origin = {task_id: f"tau2's shipped {domain} tasks" for task_id in tasks}
    splits = {k: list(v) for k, v in base.splits.items()}
    split_origin = {k: f"tau2's shipped {domain} tasks" for k in splits}
    for f in files:
        extra = load_task_dir(f)
        tasks_file, splits_file = _files_of(Path(f))
        for task_id, task in extra.tasks.items():
            if task_id in tasks:
                raise ValueError(f"{tasks_file}: task id {task_id!r} is already defined by {origin[task_id]}")
            tasks[task_id] = task
            origin[task_id] = str(tasks_file)
        for split, ids in extra.splits.items():
            if split in splits and splits[split] != ids:
                raise ValueError(f"{splits_file}: split {split!r} already exists in {split_origin[split]} with different task ids")
            splits[split] = list(ids)
            split_origin.setdefault(split, str(splits_file))
        log.info("tau2 domain %s: %d tasks, splits %s from %s", domain, len(extra), list(extra.splits), f)
    return TaskSet(tasks=tasks, splits=splits)


def golden_actions(task) -> list[dict]:
    """The task's golden actions (`evaluation_criteria.actions`) in order, as
    `{"name", "arguments", "requestor"}` dicts (arguments copied)."""
    crit = task.evaluation_criteria
    return [
        {"name": a.name, "arguments": copy.deepcopy(dict(a.arguments)), "requestor": a.requestor}
        for a in ((crit.actions or []) if crit is not None else [])
    ]
