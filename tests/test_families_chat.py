"""One real multi-turn episode with tool calls per model family, on vLLM CPU, then one learner step.

Families: Hermes (the real SmolLM2 and its own template), Qwen3 with thinking on and off, and
Llama 3.x JSON tool calling (tiny random-weight Qwen3ForCausalLM / LlamaForCausalLM with the
templates of tests/fixtures/families.py). Random weights do not write tool calls, so each reply
is constrained (vLLM structured outputs, `Sampling.guide_regex`) to one of the task's golden calls
in the family's own syntax (Qwen3 thinking: after a ``<think>`` block); everything else is real:
the engine, τ²-Bench's mock domain in solo mode (env service core), the rollout service's episode
loop and formatter, the family's parser, the learner. Checked: the token stream equals one render
of the whole conversation by the template (generated spans compared after re-tokenising their text:
the engine may pick another tokenisation of the same text; Qwen3 with thinking off: the template
drops the generation prompt's empty ``<think>`` block from past turns, so the texts are compared
without it), loss mask 1 exactly on generated ids, reasoning never in the messages sent to the env,
parsed calls, and a learner step on the group."""

from __future__ import annotations

import json
import math
import re

import pytest

from sinkflex.api.common.v1 import common_pb2

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def gen_tasks(tmp_path_factory):
    from tau2_adapter.generate import generate_mock_tasks, write_task_dir

    out = tmp_path_factory.mktemp("gen")
    write_task_dir(generate_mock_tasks(train=2, test=0, seed=0), out)
    return out


@pytest.fixture(scope="module")
def env(gen_tasks):
    from env_service.client import LocalEnvClient
    from tau2_adapter.logs import quiet_tau2_logs
    from tests.fixtures.env import scripted_config

    quiet_tau2_logs("WARNING")
    client = LocalEnvClient(scripted_config(domains=("mock",), task_files={"mock": [str(gen_tasks)]}))
    yield client
    client.core.shutdown()


@pytest.fixture(scope="module")
def task(gen_tasks):
    """(task id, its golden calls except `done`: [(name, arguments dict)])."""
    from tau2_adapter.tasks import domain_tasks, golden_actions

    ts = domain_tasks("mock", [gen_tasks])
    task_id = next(t for t in ts.splits["train"] if t.startswith("gen_create_0"))
    return task_id, [(a["name"], a["arguments"]) for a in golden_actions(ts.tasks[task_id]) if a["name"] != "done"]


def _call_regex(family: str, enable_thinking: bool, calls) -> str:
    """The reply's regex: one of `calls` in the family's syntax."""
    texts = []
    for name, args in calls:
        a = json.dumps(args)
        if family == "llama3":
            texts.append(f'{{"name": "{name}", "parameters": {a}}}')
        else:
            texts.append(f'<tool_call>\n{{"name": "{name}", "arguments": {a}}}\n</tool_call>')
    body = "(" + "|".join(_escape(t) for t in texts) + ")"
    return ("<think>\\n[a-z]{1,8}( [a-z]{1,8}){0,3}\\n</think>\\n\\n" + body) if (family == "qwen3" and enable_thinking) else body


def _escape(text: str) -> str:
    """`text` as a regex for xgrammar: metacharacters escaped, newlines as \\n (no other escapes)."""
    return re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", text).replace("\n", "\\n")


def _canonical(tok, ep) -> list[int]:
    """The stream with each generated span re-tokenised from its text (mask-0 ids kept)."""
    out, span = [], []
    for t, m in zip(ep.token_ids, ep.loss_mask):
        if m:
            span.append(t)
            continue
        if span:
            out += tok.encode(tok.decode(span), add_special_tokens=False)
            span = []
        out.append(t)
    if span:
        out += tok.encode(tok.decode(span), add_special_tokens=False)
    return out


def _count(ids: list[int], block: list[int]) -> int:
    return sum(ids[i:i + len(block)] == block for i in range(len(ids)))


def _drop(ids: list[int], block: list[int]) -> list[int]:
    """`ids` with every occurrence of `block` taken out."""
    out, i = [], 0
    while i < len(ids):
        if ids[i:i + len(block)] == block:
            i += len(block)
        else:
            out.append(ids[i])
            i += 1
    return out


def _first_diff(tok, stream: list[int], whole: list[int]) -> str:
    at = next((i for i, (a, b) in enumerate(zip(stream, whole)) if a != b), min(len(stream), len(whole)))
    return f"at token {at}: stream {tok.decode(stream[at:at + 12])!r} vs render {tok.decode(whole[at:at + 12])!r}"


CASES = [("hermes", True), ("llama3", True), ("qwen3", True), ("qwen3", False)]  # qwen3 last: the next test shares its engine


@pytest.mark.parametrize("family, thinking", CASES, ids=["hermes", "llama3", "qwen3-thinking", "qwen3-no-thinking"])
def test_family_episode_and_learner_step(family, thinking, request, env, task, tmp_path):
    from transformers import AutoTokenizer

    from rollout_service.engine import Sampling
    from rollout_service.episode import EpisodeSpec, EpisodeStatus, run_episode
    from rollout_service.formatting import formatter_factory

    if family == "hermes":
        model_dir, engine = request.getfixturevalue("smollm2_dir"), request.getfixturevalue("rollout_engine")
    else:
        model_dir = request.getfixturevalue("family_model_dirs")(family)
        engine = request.getfixturevalue("family_engine")(family)
    tok = AutoTokenizer.from_pretrained(model_dir)
    make = formatter_factory(family, tok, model=str(model_dir), enable_thinking=thinking)  # the start-up check passes
    task_id, calls = task
    regex = _call_regex(family, thinking, calls)
    episodes, formatters = [], []
    for seed in (1, 2):
        fmt = make()
        spec = EpisodeSpec("mock", task_id, Sampling(temperature=1.0, max_new_tokens=160, seed=seed, guide_regex=regex),
                           max_turns=3, max_context_tokens=4096, solo_mode=True)
        episodes.append(engine.run(run_episode(engine, env, fmt, spec)))
        formatters.append(fmt)

    for ep, fmt in zip(episodes, formatters):
        assert ep.status is EpisodeStatus.MAX_TURNS, (ep.status, ep.error)
        assert len(ep.turns) == 3 and all(t.tool_calls == 1 and not t.parse_error for t in ep.turns)
        assert len(ep.token_ids) == len(ep.logprobs) == len(ep.loss_mask)
        gen = {i for t in ep.turns for i in range(t.generation_start, t.generation_start + t.num_generated)}
        assert {i for i, m in enumerate(ep.loss_mask) if m} == gen  # mask 1 exactly on generated ids (reasoning too)
        actions = [m for m in ep.messages if m.role == common_pb2.ROLE_ASSISTANT]
        assert len(actions) == 3
        for a in actions:
            assert len(a.tool_calls) == 1 and (a.tool_calls[0].name, json.loads(a.tool_calls[0].arguments_json)) in calls
            assert "<think>" not in a.content and "</think>" not in a.content  # reasoning never sent to the env
        if family == "qwen3" and thinking:
            assert all("<think>" in tok.decode(ep.token_ids[t.generation_start:t.generation_start + t.num_generated])
                       for t in ep.turns)  # the reasoning stays in the stream as generated
        # the stream against one render of the whole conversation, each assistant turn rendered from what the
        # product parsed of it (its calls; Qwen3: its reasoning, as `reasoning_content`, the template's own field)
        system = ep.messages[0].content
        rest = [m for m in ep.messages[1:] if m.role != common_pb2.ROLE_SYSTEM]  # as the first prompt renders them
        last = max(i for i, m in enumerate(rest) if m.role == common_pb2.ROLE_ASSISTANT)
        chat = [fmt.system_message(system)] + [fmt.to_chat(m) for m in rest[:last + 1]]  # the last env reply is not rendered
        replies = iter(fmt.parse(ep.token_ids[t.generation_start:t.generation_start + t.num_generated]) for t in ep.turns)
        for c in chat:
            if c["role"] == "assistant":
                reply = next(replies)
                if family == "qwen3" and thinking:
                    c["reasoning_content"] = reply.reasoning.strip("\n")
        if family == "qwen3":
            # Qwen3's template drops the reasoning of assistant turns before the last user message: none here
            # (solo mode: the only user message, if any, is the first observation), so every turn is comparable
            last_user = max((i for i, c in enumerate(chat) if c["role"] == "user"), default=-1)
            assert all(i > last_user for i, c in enumerate(chat) if c["role"] == "assistant")
        whole = fmt._render(chat, add_generation_prompt=False)
        stream = _canonical(tok, ep)
        if family == "qwen3" and not thinking:
            # the template drops the generation prompt's empty block from past assistant turns (it renders it in the
            # last one only): compared with every such block taken out of both, token by token
            block = tok.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
            assert _count(stream, block) == 3 and _count(whole, block) == 1
            stream, whole = _drop(stream, block), _drop(whole, block)
        assert whole[:len(stream)] == stream, _first_diff(tok, stream, whole)
        assert tok.decode(whole[len(stream):]).strip() == ""  # only the template's trailing newline

    _learner_step(model_dir, tmp_path, f"g-{family}-{thinking}", task_id, episodes, "sdpa")


def _learner_step(model_dir, run_dir, name: str, task_id: str, episodes, attn: str) -> None:
    """One learner step (fp32) on the episodes as one group, rewards set by the test (1, 0: the group
    needs an advantage for a gradient): version 1, a finite loss and a gradient."""
    from learner_service.trainer import Learner
    from rollout_service.episode import episode_to_proto
    from tests.fixtures.learner import learner_config

    group = common_pb2.TrajectoryGroup(group_id=name, task_id=task_id, env="mock")
    for k, ep in enumerate(episodes):
        traj = group.trajectories.add()
        traj.CopyFrom(episode_to_proto(ep))
        traj.reward = float(k == 0)
    cfg = learner_config(run_dir, model=dict(path=str(model_dir), arch=None, attn_implementation=attn),
                         batch=dict(groups_per_step=1, micro_batch_size=2), optim=dict(lr=1e-4))
    learner = Learner(cfg)
    try:
        m = learner.train_step([group])
    finally:
        learner.close()
    assert m["policy_version"] == 1 and m.get("skipped", 0.0) == 0.0
    assert math.isfinite(m["loss"]) and m["grad_norm"] > 0


def _sampled_group(engine, name: str, sampling_kw: dict) -> common_pb2.TrajectoryGroup:
    """Two completions of one prompt sampled by the engine (old log-probs = the engine's), rewards 0 and 1."""
    from rollout_service.engine import Sampling

    prompt = list(range(1000, 1040))
    group = common_pb2.TrajectoryGroup(group_id=name, task_id="t", env="test")
    for k in range(2):
        gen = engine.run(engine.generate(prompt, Sampling(max_new_tokens=48, seed=k + 1, **sampling_kw), max_tokens=48))
        group.trajectories.add(trajectory_id=f"{name}-r{k}", task_id="t", env="test", token_ids=prompt + list(gen.token_ids),
                               logprobs=[0.0] * len(prompt) + list(gen.logprobs),
                               loss_mask=[0] * len(prompt) + [1] * len(gen.token_ids), reward=float(k))
    return group


def _first_step(model_dir, run_dir, group, **grpo) -> dict:
    """The metrics of a fresh learner's first step on `group` (its log-probs are step 0's)."""
    from learner_service.trainer import Learner
    from tests.fixtures.learner import learner_config

    cfg = learner_config(run_dir, model=dict(path=str(model_dir), arch=None, attn_implementation="sdpa"),
                         grpo=grpo, batch=dict(groups_per_step=1, micro_batch_size=2))
    learner = Learner(cfg)
    try:
        return learner.train_step([group])
    finally:
        learner.close()


@pytest.mark.parametrize("temperature, top_p, top_k", [(0.8, 0.9, 20), (1.0, 0.95, 0), (0.6, 1.0, 20)])
def test_engine_and_learner_agree_at_step_0_under_top_p_top_k(temperature, top_p, top_k, family_model_dirs, family_engine,
                                                               tmp_path):
    """vLLM CPU samples from the tiny Qwen3 with top-p / top-k; the learner's first step (old
    log-probs = the engine's) recomputes them over the same kept set: ratio 1 within the
    engine/learner mismatch, measured here without truncation on either side (same temperature,
    fp32 both sides). Without the learner's truncation the same tokens' log-probs are off by the
    log of the kept probability mass, far more than that mismatch."""
    model_dir, engine = family_model_dirs("qwen3"), family_engine("qwen3")
    base = _first_step(model_dir, tmp_path / "base", _sampled_group(engine, "base", dict(temperature=temperature)),
                       temperature=temperature, top_p=1.0, top_k=0)
    group = _sampled_group(engine, "trunc", dict(temperature=temperature, top_p=top_p, top_k=top_k))
    trunc = _first_step(model_dir, tmp_path / "trunc", group, temperature=temperature, top_p=top_p, top_k=top_k)
    full = _first_step(model_dir, tmp_path / "full", group, temperature=temperature, top_p=1.0, top_k=0)
    noise = base["logprob_mismatch_max"]  # the engine/learner mismatch of untruncated sampling (nats)
    print(f"T={temperature} top_p={top_p} top_k={top_k}: untruncated |engine - learner| max {noise:.2e}; truncated "
          f"mean {trunc['logprob_mismatch_mean']:.2e} max {trunc['logprob_mismatch_max']:.2e}, ratio_mean "
          f"{trunc['ratio_mean']:.7f}; the learner without truncation: mean {full['logprob_mismatch_mean']:.3f}")
    assert 0 < noise < full["logprob_mismatch_mean"]  # the kept-mass bias is above the numerical mismatch
    assert trunc["logprob_mismatch_mean"] <= noise  # truncated on both sides: at the untruncated level
    assert abs(trunc["ratio_mean"] - 1.0) <= noise  # ratio 1 at step 0 within the measured mismatch


@pytest.mark.timeout(420)
def test_harmony_episode_and_learner_step(env, task, family_model_dirs, family_engine, tmp_path):
    """gpt-oss (harmony): a tiny random-weight GptOssForCausalLM (`make_harmony_model`: the o200k_harmony
    vocabulary from `openai_harmony`) on vLLM CPU, replies constrained to the golden calls as harmony
    commentary messages (`Sampling.guide_structural_tag`); the stream equals `openai_harmony`'s render
    of the whole conversation (generated spans re-tokenised from their text, as for the other families;
    the special ids are pinned by the tag), parsed calls,
    loss mask 1 exactly on generated ids, and a learner step (the learner's own gpt-oss attention)."""
    from openai_harmony import Conversation

    from rollout_service.engine import Sampling
    from rollout_service.episode import EpisodeSpec, EpisodeStatus, run_episode
    from rollout_service.formatting import formatter_factory
    from sinkflex.api.env.v1 import env_pb2

    model_dir, engine = family_model_dirs("harmony"), family_engine("harmony")
    make = formatter_factory("harmony", None, model=str(model_dir), reasoning_effort="low")  # the start-up check passes
    task_id, calls = task
    # a structural tag, not a regex: its "token" elements pin harmony's special ids (a regex matches text: the model
    # could spell "<|channel|>" in plain characters). A stop id cannot be part of a guide: the reply's <|call|> is the
    # model's choice among the stops (see make_harmony_model)
    enc = make().enc
    special = {t: enc.encode(t, allowed_special="all")[0] for t in ("<|channel|>", "<|constrain|>", "<|message|>")}
    tag = json.dumps({"type": "structural_tag", "format": {"type": "or", "elements": [
        {"type": "sequence", "elements": [
            {"type": "token", "token": special["<|channel|>"]},
            {"type": "const_string", "value": f"commentary to=functions.{name} "},
            {"type": "token", "token": special["<|constrain|>"]}, {"type": "const_string", "value": "json"},
            {"type": "token", "token": special["<|message|>"]}, {"type": "const_string", "value": json.dumps(args)}]}
        for name, args in calls]}})
    episodes = []
    for seed in (1, 2):
        spec = EpisodeSpec("mock", task_id, Sampling(temperature=1.0, max_new_tokens=160, seed=seed, guide_structural_tag=tag),
                           max_turns=3, max_context_tokens=4096, solo_mode=True)
        episodes.append(engine.run(run_episode(engine, env, make(), spec)))
    reset = env.reset(env_pb2.ResetRequest(env="mock", task_id=task_id, solo_mode=True))  # the tools, for the render
    env.close(reset.session_id)
    for ep in episodes:
        assert ep.status is EpisodeStatus.MAX_TURNS, (ep.status, ep.error)
        assert len(ep.turns) == 3 and all(t.tool_calls == 1 and not t.parse_error for t in ep.turns)
        gen = {i for t in ep.turns for i in range(t.generation_start, t.generation_start + t.num_generated)}
        assert {i for i, m in enumerate(ep.loss_mask) if m} == gen
        actions = [m for m in ep.messages if m.role == common_pb2.ROLE_ASSISTANT]
        assert all(len(a.tool_calls) == 1 and (a.tool_calls[0].name, json.loads(a.tool_calls[0].arguments_json)) in calls
                   for a in actions)
        fmt = make()
        rest = [m for m in ep.messages[1:] if m.role != common_pb2.ROLE_SYSTEM]
        last = max(i for i, m in enumerate(rest) if m.role == common_pb2.ROLE_ASSISTANT)
        msgs = fmt._prompt_messages(reset.system_prompt, reset.tools, reset.observation)
        for m in rest[:last + 1]:
            msgs += fmt._to_harmony(m)
        whole = list(fmt.enc.render_conversation(Conversation.from_messages(msgs)))
        text = _HarmonyText(fmt.enc)
        stream = _canonical(text, ep)
        assert stream == whole, _first_diff(text, stream, whole)
    _learner_step(model_dir, tmp_path, "g-harmony", task_id, episodes, "sinkflex")


class _HarmonyText:
    """`openai_harmony`'s encoding with the two tokenizer methods `_canonical` and `_first_diff` use."""

    def __init__(self, enc):
        self.enc = enc

    def decode(self, ids):
        return self.enc.decode(list(ids))

    def encode(self, text, add_special_tokens=False):
        return list(self.enc.encode(text, allowed_special="all"))
