"""Demonstrations for the warm start: golden actions played through the real services.

A demonstration of task t is what the rollout service's agent loop (`rollout_service.agent
.AgentLoop`) records when its policy emits exactly t's golden actions
(`evaluation_criteria.actions`, τ²-Bench's) and then stops: the episode runs through the
env service (Reset/Step over gRPC), the same formatter renders the prompt and every
environment reply to token ids once, and the reward service scores it with τ²-Bench's
checker. The only difference from an RL rollout is the generator: `GoldenEngine`, a
scripted stand-in for the vLLM engine whose "samples" are the canonical token ids of each
golden call in the model's tool format (for Hermes: the `<tool_call>` JSON block, then the
end-of-turn token) with log-prob 0. So token ids, loss mask (1 exactly on the agent's
tokens) and messages are exactly what the rollout service produces for the same actions.

Demonstrations that τ²-Bench does not score 1.0 are dropped (and counted): rejection
sampling of the scripted policy, as in slime's rejection fine-tuning.

Supported: the Hermes/ChatML tool format (SmolLM2, Qwen) in solo mode, where the golden
actions alone solve a task. Harmony (gpt-oss) demonstrations are not built yet (ValueError).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from rollout_service.agent import AgentLoop
from rollout_service.engine import Sampling
from rollout_service.formatting import ChatTemplateFormatter, hermes_call_text
from rollout_service.generator import ScriptedGenerator
from sinkflex.api.common.v1 import common_pb2

log = logging.getLogger(__name__)

#: τ²-Bench's stop tool (tau2.gym.gym_agent.GymAgent.STOP_FUNCTION_NAME), offered in solo mode.
STOP_TOOL = "done"


class GoldenEngine(ScriptedGenerator):
    """The golden policy: a `ScriptedGenerator` (a `rollout_service.generator.Generator`) whose
    turns are the golden calls' token ids, each with log-prob 0.0.

    Each `generate` call returns the next scripted turn (finish "stop"); once the script is
    exhausted it returns only `end_token_id` (an empty reply). Calls with `count=False` (the
    agent loop's prefix-cache warm-up) consume nothing.

    Args:
        turns: [K] lists of token ids, one per agent turn, each ending with a stop token.
        end_token_id: the reply after the script.
        max_model_len: context length the agent loop budgets against.
    """

    def __init__(self, turns: Sequence[Sequence[int]], end_token_id: int, max_model_len: int = 1 << 20,
                 policy_version: int = 0):
        super().__init__(turns, end_token_id, logprob=lambda turn, position: 0.0, policy_version=policy_version,
                         max_model_len=max_model_len)


def golden_turns(formatter: ChatTemplateFormatter, actions: Sequence[dict], solo_mode: bool) -> list[list[int]]:
    """The token ids the policy must generate to play `actions`, then stop.

    Args:
        formatter: the episode's Hermes formatter (its tokenizer and end-of-turn id).
        actions: τ²-Bench golden actions, dicts {name, arguments, requestor}.
        solo_mode: in solo mode the agent also plays user-requested actions, and stops with
            τ²-Bench's `done` tool; otherwise user-side actions are skipped and it stops
            with τ²-Bench's stop token.

    Returns:
        [K] turns of token ids, each `tokenizer.encode(text) + [end-of-turn]`.
    """
    tok = formatter.tok
    texts = []
    for a in actions:
        if a.get("requestor", "assistant") != "assistant" and not solo_mode:
            continue
        call = common_pb2.ToolCall(name=a["name"], arguments_json=json.dumps(a.get("arguments") or {}))
        texts.append(hermes_call_text(call))
    if solo_mode:
        texts.append(hermes_call_text(common_pb2.ToolCall(name=STOP_TOOL, arguments_json="{}")))
    else:
        texts.append("###STOP###")
    return [list(tok.encode(t, add_special_tokens=False)) + [formatter.eot_id] for t in texts]


def dialogue_turns(formatter: ChatTemplateFormatter, turns: Sequence) -> list[list[int]]:
    """The token ids the policy must generate to play scripted agent turns of a dialogue.

    Args:
        formatter: the episode's Hermes formatter.
        turns: agent turns with `content` (a reply to the user; τ²-Bench's stop token in it
            ends the episode) or `tool` and `arguments` (one call), e.g.
            `tau2_adapter.generate_dual.golden_dialogue`'s agent turns.

    Returns:
        [K] turns of token ids, each `tokenizer.encode(text) + [end-of-turn]`.
    """
    texts = [hermes_call_text(common_pb2.ToolCall(name=t.tool, arguments_json=json.dumps(t.arguments or {})))
             if t.tool is not None else (t.content or "") for t in turns]
    return [list(formatter.tok.encode(x, add_special_tokens=False)) + [formatter.eot_id] for x in texts]


@dataclass(frozen=True)
class Demonstrations:
    """The kept demonstrations and what was dropped."""

    groups: tuple[common_pb2.TrajectoryGroup, ...]  # one group (G = 1) per kept task
    dropped: tuple[tuple[str, float], ...]  # (task id, reward) of demonstrations scored below 1.0


def build_demonstrations(env_client, reward_client, tokenizer, env: str, task_actions: dict[str, list[dict]],
                         solo_mode: bool, max_turns: int, max_context_tokens: int, tool_format: str = "hermes",
                         env_max_steps: int = 0, concurrency: int = 16, dialogues: dict | None = None) -> Demonstrations:
    """Plays each task's golden actions through the env service; keeps those scored 1.0.

    Args:
        env_client, reward_client: `env_service.client` / `reward_service.client` clients (gRPC or in-process).
        tokenizer: the policy's transformers tokenizer.
        env: the environment (τ²-Bench domain) name.
        task_actions: task id -> its golden actions ({name, arguments, requestor}), in order.
        solo_mode, max_turns, max_context_tokens, env_max_steps: as for RL rollouts.
        dialogues: task id -> scripted agent turns (`dialogue_turns`) played instead of the golden
            actions: dual-control tasks, whose golden dialogue asks the user before acting
            (`tau2_adapter.generate_dual.golden_agent_turns`); the user's turns come from the
            env's user simulator and are in the demonstration, outside the loss mask.

    Raises:
        ValueError: a tool format other than "hermes".
    """
    if tool_format != "hermes":
        raise ValueError(f"warm-start demonstrations are built for the hermes tool format only, not {tool_format!r}")

    async def one(task_id: str, actions: list[dict], sem: asyncio.Semaphore) -> common_pb2.TrajectoryGroup:
        async with sem:
            fmt = ChatTemplateFormatter(tokenizer)
            turns = (dialogue_turns(fmt, dialogues[task_id]) if dialogues and task_id in dialogues
                     else golden_turns(fmt, actions, solo_mode))
            loop = AgentLoop(GoldenEngine(turns, fmt.eot_id), tokenizer, env_client, reward=reward_client,
                             tool_format="hermes", env_max_steps=env_max_steps)
            sampling = Sampling(temperature=1.0, max_new_tokens=max(len(t) for t in turns))
            return await loop.run_group(env, task_id, 1, sampling, max(max_turns, len(turns)), max_context_tokens,
                                        solo_mode=solo_mode, publish=False)

    async def go():
        sem = asyncio.Semaphore(concurrency)
        return await asyncio.gather(*(one(t, a, sem) for t, a in task_actions.items()))

    groups = asyncio.run(go())
    kept, dropped = [], []
    for g in groups:
        t = g.trajectories[0]
        if t.reward >= 1.0 - 1e-6:
            g.group_id = f"demo-{g.task_id}"
            kept.append(g)
        else:
            dropped.append((g.task_id, float(t.reward)))
    if dropped:
        log.warning("%d of %d demonstrations scored below 1.0 and were dropped: %s", len(dropped), len(groups),
                    ", ".join(f"{t} ({r:.2f})" for t, r in dropped[:10]))
    return Demonstrations(tuple(kept), tuple(dropped))
