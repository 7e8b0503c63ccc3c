"""Generated τ²-Bench mock-domain tasks that need the user (dual control), in τ²-Bench's format.

In these tasks the agent's system prompt holds only τ²-Bench's mock policy (no ticket: the
tasks run with `solo_mode` false) and its first observation is τ²-Bench's greeting plus the
user's opening line, which never states the facts the golden actions need. Those facts are in
the user's scenario (`user_scenario.instructions`, τ²-Bench's `StructuredUserInstructions`:
reason for call, known info, task instructions), so the agent has to ask for them, and the
user simulator (τ²-Bench's `UserSimulator`) has to give them.

| family           | the user opens with                         | the agent must                                    | reward basis |
| ---------------- | ------------------------------------------- | ------------------------------------------------- | ------------ |
| `ask_create`     | "I would like to create a new task."        | ask for the user id and title; create_task        | DB, ACTION |
| `ask_status`     | "I want to change the status of a task."    | ask for the task id and status; update_task_status | DB, ACTION |
| `create_relay`   | "... and I need to know the id of the new task." | ask; create_task; tell the user the new id (task_N) | DB, ACTION, COMMUNICATE |
| `confirm_status` | "Please set task_A to completed." (a slip)  | read the change back before making it; the user corrects it to task_B and confirms | DB, ACTION |

`confirm_status` is the confirmation family: the user names the wrong task first and corrects
it only when the agent reads the change back, so an agent that changes the DB before
confirming changes the wrong task (DB and ACTION give 0). τ²-Bench's mock policy has no rule
that asks for a confirmation (retail's and airline's have one), and tasks cannot change a
domain's policy, so here the need for it comes from the scenario. The mock domain gives the
user no tools, so no family has an action only the user can take.

Every write compares all its arguments (`compare_args` unset), so one wrong argument (another
user, title, task id or status, or the slip's task id) gives 0.0; `create_relay` also gives
0.0 when the agent tells another id (COMMUNICATE: `communicate_info` is the new id).

`golden_dialogue(task)` is each task's canonical dialogue (user lines and agent turns);
`GoldenAgent` is a scripted agent that plays it reacting to what the user actually says (it
reads the facts from the user's messages and the tool answers, never from the task), so with
a user that states the scenario's facts it earns 1.0 and with one that does not it fails;
`ScriptedUserServer` is an OpenAI-compatible endpoint that answers τ²-Bench's user simulator
with the golden user lines. Ids are `dual_<family>_<nnnn>`; held-out content as in
`tau2_adapter.generate` (train and test draw users, names and title words from disjoint pools).
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from sinkflex.chat_endpoint import ChatEndpoint, ChatReply
from tau2_adapter.generate import _POOLS, STATUSES, _title
from tau2_adapter.tasks import TaskSet

FAMILIES = ("ask_create", "ask_status", "create_relay", "confirm_status")
#: Prefix of the generated ids (`dual_<family>_<nnnn>`).
PREFIX = "dual_"
#: τ²-Bench's stop token (the agent's and the user simulator's).
STOP = "###STOP###"

_PURPOSE = {
    "ask_create": "Create a task; the user id and the title are known only to the user.",
    "ask_status": "Set a task's status; the task id and the status are known only to the user.",
    "create_relay": "Create a task for the user and tell the user the new task's id.",
    "confirm_status": "Set a task's status after reading the change back: the user corrects a slip when asked to confirm.",
}
_NOTES = (
    "Generated (tau2_adapter.generate_dual), dual control: run with a user simulator (solo mode off); "
    "the facts the golden actions need are only in the user scenario. Writes compare all arguments."
)
_PERSONA = "Direct and brief. You answer exactly what the agent asks."

#: The agent's questions in the golden dialogues.
ASK_CREATE = "Sure. What is your user id, and what title should the new task have?"
ASK_STATUS = "Sure. Which task is it (its task id), and which status do you want: pending or completed?"


@dataclass(frozen=True)
class AgentTurn:
    """One agent turn: a reply to the user (`content`, ending the episode when it holds
    ###STOP###) or one tool call (`tool` with `arguments`)."""

    content: Optional[str] = None
    tool: Optional[str] = None
    arguments: dict = field(default_factory=dict)

    @property
    def stop(self) -> bool:
        return self.tool is None and STOP in (self.content or "")


@dataclass(frozen=True)
class Facts:
    """What a task is about, read from its golden actions and initial state."""

    family: str
    user_id: str
    title: Optional[str] = None  # create families
    task_id: Optional[str] = None  # status families: the task to change
    status: Optional[str] = None
    slip_task_id: Optional[str] = None  # confirm_status: the id the user names first by mistake
    new_task_id: Optional[str] = None  # create families: the id create_task gives

    def stated(self) -> dict[str, str]:
        """The facts the user must state when asked: {name: value}."""
        if self.family in ("ask_create", "create_relay"):
            return {"user_id": self.user_id, "title": self.title}
        return {"task_id": self.task_id, "status": self.status}


def family_of(task_id: str) -> str:
    """The family of a generated id (`dual_create_relay_0003` -> create_relay). Raises ValueError."""
    body = task_id.removeprefix(PREFIX).rsplit("_", 1)[0] if task_id.startswith(PREFIX) else ""
    if body not in FAMILIES:
        raise ValueError(f"{task_id!r} is not a generated dual-control task id ({PREFIX}<family>_<nnnn>)")
    return body


def facts_of(task) -> Facts:
    """The `Facts` of a generated task (τ²-Bench Task). Raises ValueError for another task."""
    family = family_of(task.id)
    action = task.evaluation_criteria.actions[0]
    users = task.initial_state.initialization_data.agent_data["users"]
    tasks = task.initial_state.initialization_data.agent_data["tasks"]
    if family in ("ask_create", "create_relay"):
        uid, title = action.arguments["user_id"], action.arguments["title"]
        return Facts(family, uid, title=title, new_task_id=f"task_{len(tasks) + 2}")  # + task_1 of the mock DB
    tid, status = action.arguments["task_id"], action.arguments["status"]
    uid = next(u for u, d in users.items() if tid in d["tasks"])
    slip = users[uid]["tasks"][1] if family == "confirm_status" else None
    return Facts(family, uid, task_id=tid, status=status, slip_task_id=slip)


def _scenario(f: Facts) -> dict:
    if f.family == "ask_create":
        reason = "You want a new task created in the task management system."
        known = f"Your user id is {f.user_id}. The title of the new task is '{f.title}'."
        steps = ("Open with: 'Hi, I would like to create a new task.' and nothing more. When the agent asks, "
                 f"say: 'My user id is {f.user_id} and the title is '{f.title}'.' Once the agent says the task "
                 "is created, end the conversation.")
        unknown = None
    elif f.family == "create_relay":
        reason = "You want a new task created, and you need to know the id the new task gets."
        known = f"Your user id is {f.user_id}. The title of the new task is '{f.title}'."
        unknown = "The id of the new task: the agent has to tell you."
        steps = ("Open with: 'Hi, I need a new task created, and I need to know the id of the new task.' and "
                 f"nothing more. When the agent asks, say: 'My user id is {f.user_id} and the title is "
                 f"'{f.title}'.' The conversation is done once the agent tells you the new task's id.")
    elif f.family == "ask_status":
        reason = "You want to change the status of one of your tasks."
        known = f"Your user id is {f.user_id}. The task is {f.task_id}. You want its status set to {f.status}."
        unknown = None
        steps = ("Open with: 'Hi, I want to change the status of one of my tasks.' and nothing more. When the "
                 f"agent asks, say: 'It is {f.task_id}. Please set it to {f.status}.' Once the agent says it is "
                 "done, end the conversation.")
    else:
        reason = "You want to change the status of one of your tasks."
        known = (f"Your user id is {f.user_id}. The task you mean is {f.task_id}; you want it set to {f.status}. "
                 f"You mix it up with your other task, {f.slip_task_id}.")
        unknown = None
        steps = (f"Open with: 'Hi, please set {f.slip_task_id} to {f.status}.' (a slip: you mean {f.task_id}). "
                 f"When the agent asks you to confirm {f.slip_task_id}, say: 'Sorry, my mistake: I mean {f.task_id}, "
                 f"not {f.slip_task_id}. Please set {f.task_id} to {f.status}.' When the agent asks you to confirm "
                 f"{f.task_id} with {f.status}, say: 'Yes, that is right.' Once the agent says it is done, end the "
                 "conversation.")
    out = {"domain": "mock", "reason_for_call": reason, "known_info": known, "task_instructions": steps}
    if unknown:
        out["unknown_info"] = unknown
    return out


def _make_task(family: str, task_id: str, rng: random.Random, pool: dict):
    from tau2.data_model.tasks import Task


    numbers = rng.sample(list(pool["users"]), rng.randint(1, 3))
    users = {f"user_{n}": {"user_id": f"user_{n}", "name": f"{rng.choice(pool['first'])} {rng.choice(pool['last'])}",
                           "tasks": []} for n in numbers}
    user_ids = list(users)
    target = user_ids[0]
    n_existing = rng.randint(2, 4)  # confirm_status needs two tasks of the target user
    next_id = f"task_{1 + n_existing + 1}"  # create_task's next id (the mock DB ships task_1)
    existing = rng.sample([f"task_{k}" for k in range(2, 31) if f"task_{k}" != next_id], n_existing)
    tasks = {}
    for k, tid in enumerate(existing):
        owner = target if k < 2 else rng.choice(user_ids)
        tasks[tid] = {"task_id": tid, "title": _title(rng, pool), "description": None, "status": rng.choice(STATUSES)}
        users[owner]["tasks"].append(tid)
    if family in ("ask_create", "create_relay"):
        title = _title(rng, pool)
        actions = [("create_task", {"user_id": target, "title": title})]
        facts = Facts(family, target, title=title, new_task_id=next_id)
    else:
        tid, slip = existing[0], existing[1]
        status = "completed" if tasks[tid]["status"] == "pending" else "pending"
        tasks[slip]["status"] = tasks[tid]["status"]  # changing the slip by mistake changes the DB too
        actions = [("update_task_status", {"task_id": tid, "status": status})]
        facts = Facts(family, target, task_id=tid, status=status, slip_task_id=slip if family == "confirm_status" else None)
    criteria = {
        "actions": [{"action_id": f"{family}_{i}", "requestor": "assistant", "name": n, "arguments": a}
                    for i, (n, a) in enumerate(actions)],
        "reward_basis": ["DB", "ACTION"],
    }
    if family == "create_relay":
        criteria["communicate_info"] = [next_id]
        criteria["reward_basis"] = ["DB", "ACTION", "COMMUNICATE"]
    return Task.model_validate({
        "id": task_id,
        "description": {"purpose": _PURPOSE[family], "notes": _NOTES},
        "user_scenario": {"persona": _PERSONA, "instructions": _scenario(facts)},
        "initial_state": {"initialization_data": {"agent_data": {"users": users, "tasks": tasks}}},
        "evaluation_criteria": criteria,
    })


def generate_dual_tasks(train: int, test: int, seed: int, families: tuple[str, ...] = FAMILIES) -> TaskSet:
    """`train` + `test` dual-control mock tasks, splits "train" and "test" (deterministic for a seed).

    Families are cycled over each split (counts differ by at most one); ids are
    `dual_<family>_<nnnn>`, numbered per family across both splits; test tasks use only the
    test pools' users, names and title words (`tau2_adapter.generate._POOLS`).

    Raises:
        ValueError: a negative count or an unknown family.
    """
    if train < 0 or test < 0:
        raise ValueError(f"train and test must be >= 0, got {train} and {test}")
    unknown = [f for f in families if f not in FAMILIES]
    if unknown or not families:
        raise ValueError(f"unknown families {unknown}; families: {', '.join(FAMILIES)}")
    counters: Counter = Counter()
    tasks: dict = {}
    splits: dict[str, list[str]] = {}
    for split_index, (split, n) in enumerate((("train", train), ("test", test))):
        rng = random.Random(seed * 1_000_003 + split_index + 7919)  # not the solo generator's streams
        ids = []
        for j in range(n):
            family = families[j % len(families)]
            task_id = f"{PREFIX}{family}_{counters[family]:04d}"
            counters[family] += 1
            tasks[task_id] = _make_task(family, task_id, rng, _POOLS[split])
            ids.append(task_id)
        splits[split] = ids
    return TaskSet(tasks=tasks, splits=splits)


def summary(task_set: TaskSet) -> dict[str, dict[str, int]]:
    """{split: {family: count}} of a generated dual-control task set."""
    return {split: dict(Counter(family_of(i) for i in ids)) for split, ids in task_set.splits.items()}


# --------------------------------------------------------------------------- golden dialogues


def _done_text(f: Facts) -> str:
    if f.family == "create_relay":
        return f"The task '{f.title}' has been created; its id is {f.new_task_id}. {STOP}"
    if f.family == "ask_create":
        return f"The task '{f.title}' has been created for {f.user_id}. {STOP}"
    return f"{f.task_id} is now {f.status}. {STOP}"


def _confirm_text(task_id: str, status: str) -> str:
    return f"To confirm: you want {task_id} set to {status}. Is that right?"


def golden_dialogue(task) -> list[tuple[str, object]]:
    """The canonical dialogue of a generated task, after τ²-Bench's greeting: a list of
    ("user", text) and ("agent", AgentTurn), in order (a tool call's answer is the env's and is
    not listed). The user's texts are `golden_user_turns`; the last agent turn stops."""
    f = facts_of(task)
    out: list[tuple[str, object]] = []
    if f.family in ("ask_create", "create_relay"):
        opening = ("Hi, I would like to create a new task." if f.family == "ask_create"
                   else "Hi, I need a new task created, and I need to know the id of the new task.")
        out += [("user", opening), ("agent", AgentTurn(content=ASK_CREATE)),
                ("user", f"My user id is {f.user_id} and the title is '{f.title}'."),
                ("agent", AgentTurn(tool="create_task", arguments={"user_id": f.user_id, "title": f.title}))]
    elif f.family == "ask_status":
        out += [("user", "Hi, I want to change the status of one of my tasks."), ("agent", AgentTurn(content=ASK_STATUS)),
                ("user", f"It is {f.task_id}. Please set it to {f.status}."),
                ("agent", AgentTurn(tool="update_task_status", arguments={"task_id": f.task_id, "status": f.status}))]
    else:
        out += [("user", f"Hi, please set {f.slip_task_id} to {f.status}."),
                ("agent", AgentTurn(content=_confirm_text(f.slip_task_id, f.status))),
                ("user", f"Sorry, my mistake: I mean {f.task_id}, not {f.slip_task_id}. Please set {f.task_id} to {f.status}."),
                ("agent", AgentTurn(content=_confirm_text(f.task_id, f.status))),
                ("user", "Yes, that is right."),
                ("agent", AgentTurn(tool="update_task_status", arguments={"task_id": f.task_id, "status": f.status}))]
    out.append(("agent", AgentTurn(content=_done_text(f))))
    return out


def golden_agent_turns(task) -> list[AgentTurn]:
    """The agent's turns of `golden_dialogue(task)`, in order (the last one stops)."""
    return [t for role, t in golden_dialogue(task) if role == "agent"]


def golden_user_turns(task) -> list[str]:
    """The user's lines of `golden_dialogue(task)`, in order."""
    return [t for role, t in golden_dialogue(task) if role == "user"]


_USER_ID = re.compile(r"\buser_\d+\b")
_TASK_ID = re.compile(r"\btask_\d+\b")
_STATUS = re.compile(r"\b(pending|completed)\b", re.IGNORECASE)
#: A quoted title: the opening quote not inside a word (the apostrophe of "I'm" opens nothing).
_QUOTED = re.compile(r"""(?<!\w)['"‘“]([^'"’”\n]{2,60}?)['"’”](?!\w)""")
_TITLE_WORDS = re.compile(r"\b(?:titled|title(?:\s+of\s+the(?:\s+new)?\s+task)?(?:\s+(?:is|should\s+be|will\s+be))?|called|named)"
                          r"\s*:?\s*([A-Z][\w-]*(?:\s+[A-Z][\w-]*)*)")
_YES = re.compile(r"\b(yes|yeah|yep|correct|right|confirm(?:ed)?|exactly|please do|go ahead)\b", re.IGNORECASE)


def read_facts(text: str, family: str) -> dict[str, str]:
    """The facts a user message states, as `GoldenAgent` reads them: user_id and title (create
    families: the first user id; a quoted title, else the capitalised words after
    'title'/'called'/'named'), or task_id and status (status families: the last task id
    mentioned, the first status word). Missing facts are left out."""
    out: dict[str, str] = {}
    if family in ("ask_create", "create_relay"):
        if m := _USER_ID.search(text):
            out["user_id"] = m.group(0)
        quoted = [q.strip() for q in _QUOTED.findall(text) if not _USER_ID.fullmatch(q.strip())]
        if quoted:
            out["title"] = quoted[0].rstrip(".")
        elif m := _TITLE_WORDS.search(text):
            out["title"] = m.group(1).strip()
    else:
        ids = _TASK_ID.findall(text)
        if ids:
            # "I mean task_9, not task_4": the id after "mean"/"is" wins over one after "not"
            kept = [i for i in ids if not re.search(rf"\bnot\s+{i}\b", text)]
            out["task_id"] = (kept or ids)[0]
        if m := _STATUS.search(text):
            out["status"] = m.group(1).lower()
    return out


class GoldenAgent:
    """A scripted agent that plays `golden_dialogue`'s agent side, reacting to what the user says.

    It asks the family's question, reads the facts from the user's messages (`read_facts`; later
    messages win), reads a status change back and waits for a yes in `confirm_status`, makes the
    golden call with what it read, then ends with the family's closing line (the new id read
    from create_task's answer). It never looks at the task's facts, only at its family: the
    episode earns 1.0 exactly when the user stated the scenario's facts. After `max_questions`
    questions without the facts it stops without acting.

    Use: `turn = agent.next_turn(user_text_or_None, tool_answer_or_None)` after each observation.
    """

    def __init__(self, family: str, max_questions: int = 3):
        if family not in FAMILIES:
            raise ValueError(f"unknown family {family!r}")
        self.family, self.max_questions = family, max_questions
        self.known: dict[str, str] = {}
        self.questions = 0
        self.read_back: Optional[dict] = None
        self.acted = False
        self.new_task_id: Optional[str] = None
        self.finished = False

    def _needs(self) -> tuple[str, str]:
        return ("user_id", "title") if self.family in ("ask_create", "create_relay") else ("task_id", "status")

    def next_turn(self, user_text: Optional[str], tool_answer: Optional[str] = None) -> AgentTurn:
        if tool_answer is not None:  # after the golden call: close
            if m := _TASK_ID.search(tool_answer):
                self.new_task_id = m.group(0)
            self.finished = True
            k = self.known
            if self.family == "create_relay":
                return AgentTurn(content=f"The task '{k['title']}' has been created; its id is {self.new_task_id}. {STOP}")
            if self.family == "ask_create":
                return AgentTurn(content=f"The task '{k['title']}' has been created for {k['user_id']}. {STOP}")
            return AgentTurn(content=f"{k['task_id']} is now {k['status']}. {STOP}")
        text = user_text or ""
        new = read_facts(text, self.family)
        self.known.update(new)
        if all(n in self.known for n in self._needs()):
            call = dict(zip(self._needs(), (self.known[n] for n in self._needs())))
            if self.family == "confirm_status":
                if self.read_back == call and _YES.search(text):
                    return self._act(call)
                if self.read_back != call and self.questions < self.max_questions:
                    self.read_back, self.questions = call, self.questions + 1
                    return AgentTurn(content=_confirm_text(call["task_id"], call["status"]))
            else:
                return self._act(call)
        if self.questions >= self.max_questions:
            self.finished = True
            return AgentTurn(content=f"I could not get what I need to help you. {STOP}")
        self.questions += 1
        if self.family == "confirm_status" and self.read_back is not None:
            return AgentTurn(content=_confirm_text(self.read_back["task_id"], self.read_back["status"]))
        return AgentTurn(content=ASK_CREATE if self.family in ("ask_create", "create_relay") else ASK_STATUS)

    def _act(self, call: dict) -> AgentTurn:
        self.acted = True
        name = "create_task" if self.family in ("ask_create", "create_relay") else "update_task_status"
        return AgentTurn(tool=name, arguments=call)


# --------------------------------------------------------------------------- the scripted user


class ScriptedUserServer:
    """An OpenAI-compatible chat-completions endpoint (stdlib HTTP, loopback) that answers
    τ²-Bench's user simulator with each task's golden user lines.

    It finds the task by the `<scenario>...</scenario>` block of the user simulator's system
    prompt (τ²-Bench's `UserSimulator.system_prompt` holds `str(task.user_scenario)` there) and
    answers the k-th user turn (k = the request's assistant-role messages: the user's own
    earlier lines, roles flipped) with `golden_user_turns(task)[k]`, then "###STOP###". A
    request for an unknown scenario gets HTTP 400. litellm: model "openai/<any>", api_base
    `.base_url`.

    Args:
        tasks: the generated tasks to answer for (τ²-Bench Tasks).
        host, port: where to listen (port 0: a free port).
    """

    def __init__(self, tasks, host: str = "127.0.0.1", port: int = 0):
        self.turns = {str(t.user_scenario).strip(): golden_user_turns(t) for t in tasks}
        self.requests = 0
        self._endpoint = ChatEndpoint(self._answer, "scripted-user", host=host, port=port, name="scripted-user")
        self.host, self.port = self._endpoint.host, self._endpoint.port

    @property
    def base_url(self) -> str:
        """The litellm `api_base`: http://HOST:PORT/v1."""
        return self._endpoint.base_url

    def _answer(self, body: dict) -> ChatReply:
        """The endpoint's `reply`: `reply` on the request's messages. Raises KeyError (HTTP 400)."""
        text = self.reply(body.get("messages") or [])
        self.requests += 1
        return ChatReply(text=text)

    def reply(self, messages: list[dict]) -> str:
        """The golden user line for a user-simulator request. Raises KeyError for an unknown scenario."""
        system = next((m.get("content") or "" for m in messages if m.get("role") == "system"), "")
        m = re.search(r"<scenario>\s*(.*?)\s*</scenario>", system, re.DOTALL)
        if not m or m.group(1).strip() not in self.turns:
            raise KeyError("no generated task has this scenario")
        turns = self.turns[m.group(1).strip()]
        k = sum(1 for x in messages if x.get("role") == "assistant")
        return turns[k] if k < len(turns) else STOP

    def close(self) -> None:
        """Stops serving and frees the port."""
        self._endpoint.close()
