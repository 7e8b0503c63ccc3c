"""A generator of τ²-Bench mock-domain tasks (the "task management" domain), in τ²-Bench's format.

Four families, each one short, regular ticket (solo mode: the ticket is in the agent's
system prompt and states everything the agent needs):

| family          | ticket                                                                 | golden actions |
| --------------- | ---------------------------------------------------------------------- | -------------- |
| `create`        | Create a new task titled 'Quarterly Budget' for user_4.                | create_task(user_id, title) |
| `status`        | Set the status of task_7 of user_4 to completed.                       | update_task_status(task_id, status) |
| `create_update` | Create a new task titled 'Quarterly Budget' for user_4, then set its status to completed. | create_task, then update_task_status(task_{n+1}, completed) |
| `forbidden`     | Delete task_7 of user_4.                                               | transfer_to_human_agents(summary=<the ticket>) |

Users, titles, task ids and statuses vary through each task's
`initial_state.initialization_data.agent_data` (users and tasks added to the mock DB,
which starts with user_1 / task_1). `create_task` names the new task
`task_{len(tasks)+1}`, so the existing ids are drawn to avoid that id, and a
create-then-update task's second action uses it (the agent reads it from create_task's
answer). Statuses: a `status` task flips an existing task (pending -> completed,
completed -> pending).

Reward basis ["DB", "ACTION"] (no LLM needed). Write actions compare every argument
(`compare_args` None). The forbidden family compares `summary` (`compare_args:
["summary"]`) and the golden summary is the ticket verbatim: with tau2's default for
transfers (`compare_args: []`) any summary would pass and no argument could be wrong;
with it, one wrong argument gives 0.0 while the rule stays learnable (copy the request).

Held-out content: train and test draw users (ids and names) and title words from
disjoint pools, so no test title, title word or user occurs in a train task.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

from tau2_adapter.tasks import SPLITS_FILE, TASKS_FILE, TaskSet

FAMILIES = ("create", "status", "create_update", "forbidden")
STATUSES = ("pending", "completed")

#: Disjoint pools: (user numbers, first names, last names, title first words, title second words).
_POOLS = {
    "train": dict(
        users=range(2, 26),
        first=("Alice", "Bruno", "Chloe", "Daniel", "Elena", "Felix", "Grace", "Hugo", "Irene", "Jonas", "Karin", "Liam"),
        last=("Adams", "Baker", "Clark", "Davis", "Evans", "Foster", "Green", "Hughes"),
        title_a=("Quarterly", "Weekly", "Annual", "Team", "Client", "Project", "Sales", "Product", "Design", "Travel",
                 "Office", "Training"),
        title_b=("Budget", "Meeting", "Review", "Report", "Plan", "Launch", "Survey", "Workshop", "Checklist", "Update",
                 "Interview", "Audit"),
    ),
    "test": dict(
        users=range(40, 52),
        first=("Maya", "Nikolai", "Olivia", "Pedro", "Quinn", "Rosa"),
        last=("Moreno", "Novak", "Ortiz", "Patel"),
        title_a=("Marketing", "Research", "Hiring", "Security", "Vendor", "Garden"),
        title_b=("Roadmap", "Summary", "Proposal", "Forecast", "Briefing", "Inventory"),
    ),
}

_PURPOSE = {
    "create": "Create a task with a given title for a given user.",
    "status": "Set an existing task's status.",
    "create_update": "Create a task, then update its status (two calls; the new id comes from create_task's answer).",
    "forbidden": "A request the policy forbids (deleting a task): transfer to a human agent.",
}
_NOTES = {
    "create": "Generated (tau2_adapter.generate). Reward basis DB+ACTION; create_task compares all arguments.",
    "status": "Generated (tau2_adapter.generate). Reward basis DB+ACTION; update_task_status compares all arguments.",
    "create_update": (
        "Generated (tau2_adapter.generate). Reward basis DB+ACTION; both calls compare all arguments. "
        "create_task names the new task task_{len(tasks)+1}; the update uses that id."
    ),
    "forbidden": (
        "Generated (tau2_adapter.generate). Policy: tasks may not be deleted, transfer to a human agent. "
        "Reward basis DB+ACTION; the transfer compares its summary (compare_args ['summary']), which is the "
        "ticket verbatim, so that one wrong argument gives 0.0 (tau2's own impossible_task_1 uses "
        "compare_args [] and accepts any summary)."
    ),
}


def _title(rng: random.Random, pool: dict) -> str:
    return f"{rng.choice(pool['title_a'])} {rng.choice(pool['title_b'])}"


def _make_task(family: str, task_id: str, rng: random.Random, pool: dict):
    from tau2.data_model.tasks import Task

    # Users: the target and up to two others, from this split's pool.
    numbers = rng.sample(list(pool["users"]), rng.randint(1, 3))
    users = {
        f"user_{n}": {"user_id": f"user_{n}", "name": f"{rng.choice(pool['first'])} {rng.choice(pool['last'])}", "tasks": []}
        for n in numbers
    }
    user_ids = list(users)
    target_user = user_ids[0]
    # Existing tasks: 1..3, ids drawn from task_2..task_30 but never the id create_task picks next.
    n_existing = rng.randint(1, 3)
    next_id = f"task_{1 + n_existing + 1}"  # the mock DB ships task_1
    candidates = [f"task_{k}" for k in range(2, 31) if f"task_{k}" != next_id]
    existing_ids = rng.sample(candidates, n_existing)
    tasks = {}
    for k, tid in enumerate(existing_ids):
        owner = target_user if k == 0 else rng.choice(user_ids)
        tasks[tid] = {"task_id": tid, "title": _title(rng, pool), "description": None, "status": rng.choice(STATUSES)}
        users[owner]["tasks"].append(tid)
    target_task = existing_ids[0]

    if family == "create":
        title = _title(rng, pool)
        ticket = f"Create a new task titled '{title}' for {target_user}."
        actions = [("create_task", {"user_id": target_user, "title": title}, None)]
        instructions = f"You are {target_user}. You want a new task titled '{title}' created for {target_user}."
    elif family == "status":
        status = "completed" if tasks[target_task]["status"] == "pending" else "pending"
        ticket = f"Set the status of {target_task} of {target_user} to {status}."
        actions = [("update_task_status", {"task_id": target_task, "status": status}, None)]
        instructions = f"You are {target_user}. You want the status of your task {target_task} set to {status}."
    elif family == "create_update":
        title = _title(rng, pool)
        ticket = f"Create a new task titled '{title}' for {target_user}, then set its status to completed."
        actions = [
            ("create_task", {"user_id": target_user, "title": title}, None),
            ("update_task_status", {"task_id": next_id, "status": "completed"}, None),
        ]
        instructions = (
            f"You are {target_user}. You want a new task titled '{title}' created for {target_user}, "
            "and then marked as completed."
        )
    elif family == "forbidden":
        ticket = f"Delete {target_task} of {target_user}."
        actions = [("transfer_to_human_agents", {"summary": ticket}, ["summary"])]
        instructions = f"You are {target_user}. You want your task {target_task} deleted."
    else:
        raise ValueError(f"unknown family {family!r}; families: {', '.join(FAMILIES)}")

    return Task.model_validate({
        "id": task_id,
        "description": {"purpose": _PURPOSE[family], "notes": _NOTES[family]},
        "user_scenario": {"persona": "Direct and brief.", "instructions": instructions},
        "ticket": ticket,
        "initial_state": {"initialization_data": {"agent_data": {"users": users, "tasks": tasks}}},
        "evaluation_criteria": {
            "actions": [
                {"action_id": f"{family}_{i}", "requestor": "assistant", "name": name, "arguments": args,
                 **({"compare_args": cmp} if cmp is not None else {})}
                for i, (name, args, cmp) in enumerate(actions)
            ],
            "reward_basis": ["DB", "ACTION"],
        },
    })


def family_of(task_id: str) -> str:
    """The family named in a generated task id (`gen_create_update_0007` -> create_update)."""
    body = task_id.removeprefix("gen_").rsplit("_", 1)[0]
    if body not in FAMILIES:
        raise ValueError(f"{task_id!r} is not a generated task id (gen_<family>_<nnnn>)")
    return body


def generate_mock_tasks(train: int, test: int, seed: int) -> TaskSet:
    """`train` + `test` mock-domain tasks, splits "train" and "test" (deterministic for a seed).

    Families are spread evenly over each split (cycled: counts differ by at most one).
    Ids are `gen_<family>_<nnnn>`, numbered per family across both splits. Test tasks use
    only test-pool users and title words (never seen in train).
    """
    if train < 0 or test < 0:
        raise ValueError(f"train and test must be >= 0, got {train} and {test}")
    counters: Counter = Counter()
    tasks: dict = {}
    splits: dict[str, list[str]] = {}
    for split_index, (split, n) in enumerate((("train", train), ("test", test))):
        rng = random.Random(seed * 1_000_003 + split_index)
        pool = _POOLS[split]
        ids = []
        for j in range(n):
            family = FAMILIES[j % len(FAMILIES)]
            task_id = f"gen_{family}_{counters[family]:04d}"
            counters[family] += 1
            tasks[task_id] = _make_task(family, task_id, rng, pool)
            ids.append(task_id)
        splits[split] = ids
    return TaskSet(tasks=tasks, splits=splits)


def write_task_dir(task_set: TaskSet, out_dir: str | Path) -> Path:
    """Writes `tasks.json` and `split_tasks.json` (τ²-Bench's layout) into `out_dir`; returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tasks = [t.model_dump(mode="json", exclude_none=True) for t in task_set.tasks.values()]
    (out / TASKS_FILE).write_text(json.dumps(tasks, indent=2) + "\n")
    (out / SPLITS_FILE).write_text(json.dumps(task_set.splits, indent=2) + "\n")
    return out


def summary(task_set: TaskSet) -> dict[str, dict[str, int]]:
    """{split: {family: count}} of a generated task set."""
    return {split: dict(Counter(family_of(i) for i in ids)) for split, ids in task_set.splits.items()}
