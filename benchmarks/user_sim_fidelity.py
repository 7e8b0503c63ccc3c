"""How faithful a model is as τ²-Bench's user simulator on held-out dual-control scenarios.

The user is τ²-Bench's own `UserSimulator` (its prompt: simulation guidelines + the task's
scenario), run by the env service (`env_service.client.LocalEnvClient`), calling the model
through litellm on an OpenAI-compatible endpoint: vLLM's OpenAI server started here
(`rollout_service.user_sim.start_vllm_server`, the command the local launcher runs), or the one
at --base-url. The agent is the scripted `tau2_adapter.generate_dual.GoldenAgent`, which plays
the golden dialogue reacting to what the user says; the tasks are the held-out (test) split of
`generate_dual_tasks`.

Two figures (and their Wilson 95 % intervals, scipy.stats.binomtest):
- fidelity: of the user turns that answer the agent's question for the scenario's facts (its
  ask, or its read-back of the slip in confirm_status), the share whose text states every fact
  the scenario gives for it (user id and title, or task id and status) with the scenario's
  value, read by `read_facts` (the agent's own reader); per fact too;
- dialogues_completed_by_golden_agent: the share of episodes τ²-Bench's evaluator scores 1.0.
Also counted: user turns that end the conversation (###STOP###) before the agent acted, empty
user turns, the first user turn stating a fact it was told to keep back.

    flock /tmp/mid.lock .venv/bin/python benchmarks/user_sim_fidelity.py --tasks 40 \
        --out docs/results/dual/user_sim_fidelity_smollm2
    ... --model DIR (a user-simulator warm start) | --base-url http://HOST:PORT/v1 --served-name NAME

Writes OUT.json (figures, settings, every dialogue) and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scipy.stats import binomtest  # noqa: E402

from tau2_adapter.generate import write_task_dir  # noqa: E402
from tau2_adapter.generate_dual import STOP, GoldenAgent, facts_of, family_of, generate_dual_tasks, read_facts  # noqa: E402


_TASK_ID = re.compile(r"\btask_\d+\b")


def replies_of(turns: list[dict]) -> tuple[str, list[tuple[str, str]]]:
    """(the user's opening line, [(question kind, the user's reply)]) of a recorded dialogue
    (`turns`: {role, content}, τ²-Bench's greeting first). A question is an agent reply that
    neither calls a tool nor stops: kind "ask", or "read_back:<task id>" for a read-back."""
    opening, out, question = "", [], None
    for t in turns[1:]:
        if t["role"] == "user":
            if question is not None:
                out.append((question, t["content"]))
            elif not opening:
                opening = t["content"]
            question = None
        elif t["role"] == "agent" and not t.get("tool_calls") and STOP not in t["content"]:
            ids = _TASK_ID.findall(t["content"]) if t["content"].startswith("To confirm") else []
            question = f"read_back:{ids[0]}" if ids else "ask"
        else:
            question = None
    return opening, out


def score(dialogues: list[dict], tasks: dict) -> dict:
    """The figures of `dialogues` (as in OUT.json) for their tasks (id -> τ²-Bench Task)."""
    answered = correct = completed = early_stop = empty = leaked = user_turns = 0
    per_fact: dict[str, list[int]] = {}
    for d in dialogues:
        f = facts_of(tasks[d["task_id"]])
        want = f.stated()
        users = [t["content"] for t in d["turns"] if t["role"] == "user"]
        user_turns += len(users)
        empty += sum(1 for u in users if not u.strip())
        opening, replies = replies_of(d["turns"])
        # the opening line keeps the facts back (confirm_status opens with the slip by design)
        if f.family != "confirm_status" and any(read_facts(opening, f.family).get(k) == v for k, v in want.items()):
            leaked += 1
        for kind, reply in replies:
            if kind == f"read_back:{f.task_id}":
                continue  # the reply to the read-back of the right task is a yes, not facts
            got = read_facts(reply, f.family)
            answered += 1
            correct += all(got.get(k) == v for k, v in want.items())
            for k, v in want.items():
                per_fact.setdefault(k, [0, 0])
                per_fact[k][0] += got.get(k) == v
                per_fact[k][1] += 1
        acted = any(t.get("tool_calls") for t in d["turns"])
        early_stop += (not acted) and d["termination_reason"] == "user_stop"
        completed += d["reward"] == 1.0
    n = len(dialogues)
    return {
        "fidelity": round(correct / answered, 4) if answered else None,
        "fidelity_ci95": _wilson(correct, answered),
        "answers": answered,
        "answers_correct": correct,
        "per_fact": {k: round(v[0] / v[1], 4) for k, v in per_fact.items()},
        "dialogues_completed_by_golden_agent": round(completed / n, 4) if n else None,
        "dialogues_completed_ci95": _wilson(completed, n),
        "dialogues": n,
        "dialogues_completed": completed,
        "stopped_before_the_agent_acted": early_stop,
        "opening_stated_a_kept_back_fact": leaked,
        "user_turns": user_turns,
        "empty_user_turns": empty,
    }


def _wilson(k: int, n: int) -> list[float]:
    if n == 0:
        return [float("nan"), float("nan")]
    ci = binomtest(k, n).proportion_ci(0.95, method="wilson")
    return [round(float(ci.low), 4), round(float(ci.high), 4)]


def run(args) -> dict:
    from env_service.client import LocalEnvClient
    from env_service.config import EnvServiceConfig
    from env_service.replay import replay_dialogue
    from sinkflex.api.common.v1 import common_pb2
    from rollout_service.engine import resolve_engine_dtype
    from tau2_adapter.logs import quiet_tau2_logs

    quiet_tau2_logs("ERROR")
    task_set = generate_dual_tasks(train=0, test=args.tasks, seed=args.seed)
    tasks = [task_set.tasks[i] for i in task_set.splits["test"]]
    task_dir = write_task_dir(task_set, tempfile.mkdtemp(prefix="dual-fidelity-"))
    server = None
    base_url, served = args.base_url, args.served_name
    t0 = time.monotonic()
    if base_url is None:
        from rollout_service.user_sim import start_vllm_server
        from sinkflex.models import prepare_model

        model = args.model or str(prepare_model("smollm2"))
        port = args.port
        server = start_vllm_server(model, port=port, served_model_name=served, kv_cache_gib=1.0, max_model_len=4096,
                                   log_path=args.vllm_log, dtype=args.dtype)
        base_url = f"http://127.0.0.1:{port}/v1"
    start_s = time.monotonic() - t0
    try:
        env = LocalEnvClient(EnvServiceConfig(
            domains=("mock",), task_files={"mock": [str(task_dir)]}, user_model=f"openai/{served}", user_base_url=base_url,
            user_temperature=args.temperature, user_max_tokens=args.max_tokens, reward_on_termination=False))

        def one(task):
            r = replay_dialogue(env, "mock", task, GoldenAgent(family_of(task.id)), max_turns=10, seed=args.seed)
            return task, r

        t1 = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(one, tasks))
        episodes_s = time.monotonic() - t1
    finally:
        if server is not None:
            from rollout_service.user_sim import stop_vllm_server

            stop_vllm_server(server)

    roles = {common_pb2.ROLE_USER: "user", common_pb2.ROLE_ASSISTANT: "agent", common_pb2.ROLE_TOOL: "tool"}
    dialogues = [{"task_id": task.id, "reward": r.reward, "termination_reason": r.termination_reason,
                  "breakdown": r.breakdown, "facts": facts_of(task).stated(),
                  "turns": [{"role": roles.get(m.role, "?"), "content": m.content,
                             **({"tool_calls": [[c.name, c.arguments_json] for c in m.tool_calls]} if m.tool_calls else {})}
                            for m in r.messages]} for task, r in results]
    return {
        "user_simulator": score(dialogues, {t.id: t for t in tasks}),
        "settings": {"model": args.model or ("smollm2 (sinkflex.models.prepare_model)" if args.base_url is None else served),
                     "base_url": args.base_url, "dtype": None if args.base_url else resolve_engine_dtype(args.dtype),
                     "temperature": args.temperature, "max_tokens": args.max_tokens,
                     "tasks": len(tasks), "split": "test (held-out pools)", "seed": args.seed, "concurrency": args.concurrency,
                     "families": sorted({family_of(t.id) for t in tasks}),
                     "golden_agent_max_questions": GoldenAgent("ask_create").max_questions},
        "timing": {"server_start_s": round(start_s, 1), "episodes_s": round(episodes_s, 1)},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "per_family_completed": {fam: sum(1 for d in dialogues if family_of(d["task_id"]) == fam and d["reward"] == 1.0)
                                 for fam in sorted({family_of(t.id) for t in tasks})},
        "dialogues": dialogues,
    }


def markdown(result: dict, title: str) -> str:
    u, s = result["user_simulator"], result["settings"]
    lines = [f"# {title}", "", f"Command: `{result['command']}`", "",
             f"User simulator: τ²-Bench's `UserSimulator` on {s['model']} (temperature {s['temperature']}, "
             f"max {s['max_tokens']} tokens a reply); agent: the scripted `GoldenAgent`; {s['tasks']} held-out "
             f"dual-control tasks (`generate_dual_tasks`, seed {s['seed']}, test split).", "",
             "| measure | value | 95 % interval |", "| --- | --- | --- |",
             f"| fidelity: answers stating the scenario's facts | {u['fidelity']} ({u['answers_correct']}/{u['answers']}) | "
             f"{u['fidelity_ci95']} |",
             f"| dialogues the golden agent completes (reward 1.0) | {u['dialogues_completed_by_golden_agent']} "
             f"({u['dialogues_completed']}/{u['dialogues']}) | {u['dialogues_completed_ci95']} |", "",
             "| detail | value |", "| --- | --- |"]
    lines += [f"| per fact: {k} | {v} |" for k, v in u["per_fact"].items()]
    lines += [f"| completed per family | {result['per_family_completed']} |",
              f"| stopped before the agent acted | {u['stopped_before_the_agent_acted']} of {u['dialogues']} |",
              f"| opening line stated a fact to keep back | {u['opening_stated_a_kept_back_fact']} |",
              f"| empty user turns | {u['empty_user_turns']} of {u['user_turns']} |",
              f"| vLLM server start, episodes | {result['timing']['server_start_s']} s, {result['timing']['episodes_s']} s |", ""]
    # two dialogues as read
    for d in result["dialogues"][:2]:
        lines += [f"Dialogue `{d['task_id']}` (reward {d['reward']}, {d['termination_reason']}):", "", "```"]
        lines += [f"{t['role']}: {t['content'][:200]}" + (f" {t['tool_calls']}" if t.get("tool_calls") else "")
                  for t in d["turns"]]
        lines += ["```", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=40, help="held-out tasks (families cycled)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="model folder to serve (default: the prepared SmolLM2)")
    p.add_argument("--base-url", default=None, help="an OpenAI-compatible endpoint that runs already")
    p.add_argument("--served-name", default="user-sim")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--temperature", type=float, default=0.0, help="user simulator temperature (tau2's default 0.0)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--vllm-log", default=None)
    p.add_argument("--dtype", default="auto",
                   help="vLLM --dtype of the server it starts (auto: the rollout engine's rule, resolve_engine_dtype)")
    p.add_argument("--out", default="docs/results/dual/user_sim_fidelity_smollm2", help="OUT.json and OUT.md")
    p.add_argument("--title", default="User-simulator fidelity: SmolLM2-135M-Instruct")
    p.add_argument("--rescore", default=None, help="re-score the dialogues of an OUT.json (same --tasks/--seed)")
    args = p.parse_args()
    if args.rescore:
        result = json.loads(Path(args.rescore).read_text())
        ts = generate_dual_tasks(train=0, test=args.tasks, seed=args.seed)
        result["user_simulator"] = score(result["dialogues"], ts.tasks)
    else:
        result = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result, args.title))
    print(json.dumps(result["user_simulator"], indent=1))


if __name__ == "__main__":
    main()
