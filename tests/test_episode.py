"""The episode loop (`rollout_service.episode.run_episode`) on CPU, without vLLM: a
`ScriptedGenerator` (replies from a script of texts, tokenized with the real SmolLM2
tokenizer, deterministic log-probs) against a real in-process env (the env service's core on
τ²-Bench's mock domain, with tasks made by `tau2_adapter.generate`; its user is litellm's
scripted reply) and the real in-process reward service."""

from __future__ import annotations

import asyncio
import json

import pytest

from sinkflex.api.common.v1 import common_pb2

pytestmark = pytest.mark.timeout(120)

TR = common_pb2.TerminationReason


@pytest.fixture(scope="module")
def gen_tasks(tmp_path_factory):
    from tau2_adapter.generate import generate_mock_tasks, write_task_dir

    out = tmp_path_factory.mktemp("gen")
    write_task_dir(generate_mock_tasks(train=4, test=0, seed=0), out)
    return out


@pytest.fixture(scope="module")
def env(gen_tasks):
    """A LocalEnvClient over the mock domain and the generated tasks (scripted user)."""
    from env_service.client import LocalEnvClient
    from tau2_adapter.logs import quiet_tau2_logs
    from tests.fixtures.env import scripted_config

    quiet_tau2_logs("WARNING")
    client = LocalEnvClient(scripted_config(domains=("mock",), task_files={"mock": [str(gen_tasks)]}))
    yield client
    client.core.shutdown()


@pytest.fixture(scope="module")
def reward(gen_tasks):
    from reward_service.client import LocalRewardClient
    from reward_service.scoring import TaskCatalog

    return LocalRewardClient(TaskCatalog(task_files={"mock": [str(gen_tasks)]}))


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def task(gen_tasks):
    """(task id, the texts of its golden calls then tau2's `done` call) of a create task."""
    from rollout_service.formatting import hermes_call_text
    from tau2_adapter.tasks import domain_tasks, golden_actions

    ts = domain_tasks("mock", [gen_tasks])
    task_id = next(t for t in ts.splits["train"] if t.startswith("gen_create_0"))
    calls = [common_pb2.ToolCall(name=a["name"], arguments_json=json.dumps(a["arguments"]))
             for a in golden_actions(ts.tasks[task_id])]
    calls.append(common_pb2.ToolCall(name="done", arguments_json="{}"))
    return task_id, [hermes_call_text(c) for c in calls]


def _spec(task_id, max_turns=6, max_context_tokens=8192, max_new_tokens=256, solo_mode=True):
    from rollout_service.engine import Sampling
    from rollout_service.episode import EpisodeSpec

    return EpisodeSpec("mock", task_id, Sampling(temperature=1.0, max_new_tokens=max_new_tokens, seed=7), max_turns,
                       max_context_tokens, solo_mode=solo_mode)


def _play(tokenizer, env, texts, spec, lock=None):
    """(Episode, the ScriptedGenerator that played `texts`)."""
    from rollout_service.episode import run_episode
    from rollout_service.formatting import formatter_factory
    from rollout_service.generator import ScriptedGenerator

    fmt = formatter_factory("hermes", tokenizer)()
    gen = ScriptedGenerator.from_texts(tokenizer, texts, fmt.eot_id)
    return asyncio.run(run_episode(gen, env, fmt, spec, prefill_lock=lock)), gen


def _check_token_record(ep, gen):
    """Generated ids are exactly the script's (mask 1, its log-probs); everything else is
    prompt (mask 0, log-prob 0); turn k+1's prompt extends turn k's prompt + reply."""
    from rollout_service.generator import scripted_logprob

    n = len(ep.token_ids)
    assert len(ep.logprobs) == len(ep.loss_mask) == n
    generated = set()
    for k, t in enumerate(ep.turns):
        span = range(t.generation_start, t.generation_start + t.num_generated)
        generated.update(span)
        scripted = gen.turns[k] if k < len(gen.turns) else (gen.end_token_id,)  # after the script: <|im_end|> alone
        assert list(ep.token_ids[span.start:span.stop]) == list(scripted[:t.num_generated])
        assert list(ep.logprobs[span.start:span.stop]) == [scripted_logprob(k, j) for j in range(t.num_generated)]
        assert gen.prompts[k] == list(ep.token_ids[:t.generation_start])  # what the generator was prompted with
        if k:
            assert ep.turns[k - 1].generation_start + ep.turns[k - 1].num_generated == t.prompt_start < t.generation_start
    assert [i for i in range(n) if ep.loss_mask[i]] == sorted(generated)
    assert all(ep.logprobs[i] == 0.0 for i in range(n) if not ep.loss_mask[i])


def test_scripted_golden_episode_is_done_with_reward_1(tokenizer, env, task):
    from rollout_service.episode import EpisodeStatus
    from rollout_service.generator import Generator, ScriptedGenerator

    task_id, texts = task
    ep, gen = _play(tokenizer, env, texts, _spec(task_id), lock=asyncio.Lock())  # the prefill warm-up consumes no turn
    assert isinstance(gen, Generator) and isinstance(gen, ScriptedGenerator)
    assert ep.status is EpisodeStatus.DONE and ep.termination_reason == TR.TERMINATION_REASON_AGENT_STOP
    assert ep.reward == 1.0 and ep.env_breakdown.reward == 1.0 and ep.error == ""
    assert len(ep.turns) == len(texts) == gen.calls
    assert not any(t.parse_error or t.truncated for t in ep.turns)
    assert [t.tool_calls for t in ep.turns] == [1] * len(texts)
    _check_token_record(ep, gen)
    assert ep.loss_mask[-1] == 1  # nothing rendered after the last reply
    # each reply decodes to its script text + <|im_end|>
    for t, text in zip(ep.turns, texts):
        span = ep.token_ids[t.generation_start:t.generation_start + t.num_generated]
        assert tokenizer.decode(span) == text + "<|im_end|>"
    roles = [m.role for m in ep.messages]
    assert roles[0] == common_pb2.ROLE_SYSTEM and roles.count(common_pb2.ROLE_ASSISTANT) == len(texts)
    m = ep.metrics()
    assert m["turns"] == len(texts) and m["tool_calls"] == len(texts) and m["parse_failures"] == 0
    assert m["generated_tokens"] == sum(ep.loss_mask) and m["tokens"] == len(ep.token_ids) and m["env_reward"] == 1.0
    assert ep.timing.episode_seconds >= ep.timing.env_seconds > 0 and ep.timing.format_seconds > 0
    with pytest.raises(AttributeError):  # frozen
        ep.status = EpisodeStatus.MAX_TURNS


def test_episode_proto_round_trips(tokenizer, env, task):
    from rollout_service.episode import episode_to_proto

    task_id, texts = task
    ep, _ = _play(tokenizer, env, texts, _spec(task_id))
    traj = common_pb2.Trajectory.FromString(episode_to_proto(ep).SerializeToString())
    assert (traj.trajectory_id, traj.task_id, traj.env) == (ep.trajectory_id, ep.task_id, "mock")
    assert list(traj.token_ids) == list(ep.token_ids) and list(traj.loss_mask) == list(ep.loss_mask)
    assert list(traj.logprobs) == list(ep.logprobs)  # multiples of 1/8: exact in float32
    assert list(traj.messages) == list(ep.messages)
    assert traj.termination_reason == ep.termination_reason and traj.reward == ep.reward == 1.0
    assert traj.reward_breakdown == ep.env_breakdown and traj.policy_version == ep.policy_version == 0
    assert [(t.prompt_start, t.generation_start, t.num_generated, t.policy_version, t.truncated, t.parse_error)
            for t in traj.turns] == [(t.prompt_start, t.generation_start, t.num_generated, t.policy_version, t.truncated,
                                      bool(t.parse_error)) for t in ep.turns]
    assert dict(traj.metrics) == {**ep.metrics(), "policy_versions": 1.0}


def test_agent_loop_runs_on_a_scripted_generator_and_the_reward_service_scores_1(tokenizer, env, reward, task):
    """AgentLoop.run_group without vLLM: the same token record as the bare episode, scored by
    the reward service (1.0), the metrics summed into `totals`."""
    from rollout_service.agent import AgentLoop
    from rollout_service.engine import Sampling
    from rollout_service.formatting import ChatTemplateFormatter
    from rollout_service.generator import ScriptedGenerator

    task_id, texts = task
    bare, _ = _play(tokenizer, env, texts, _spec(task_id))
    gen = ScriptedGenerator.from_texts(tokenizer, texts, ChatTemplateFormatter(tokenizer).eot_id)
    loop = AgentLoop(gen, tokenizer, env, reward=reward)
    group = asyncio.run(loop.run_group("mock", task_id, 1, Sampling(max_new_tokens=256, seed=3), 6, 8192, solo_mode=True,
                                       publish=False))
    (traj,) = group.trajectories
    assert traj.reward == 1.0 and traj.reward_breakdown.reward == 1.0 and traj.metrics["unscored"] == 0.0
    assert traj.termination_reason == TR.TERMINATION_REASON_AGENT_STOP
    assert list(traj.token_ids) == list(bare.token_ids) and list(traj.loss_mask) == list(bare.loss_mask)
    assert list(traj.logprobs) == list(bare.logprobs)
    assert loop.totals["turns"] == len(texts) and loop.totals["tokens"] == len(traj.token_ids) and loop.groups_completed == 1


def test_parse_error_reply_goes_to_the_env_as_written_and_the_episode_goes_on(tokenizer, env, task):
    """Dual control: a malformed call is sent as text, the scripted user answers, the next turn follows."""
    from rollout_service.episode import EpisodeStatus
    from tests.fixtures.env import SCRIPTED_USER

    task_id, _ = task
    bad = '<tool_call>\n{"name": "create_task", "arguments": {"user_id": </tool_call>'
    ep, gen = _play(tokenizer, env, [bad, "Let me check."], _spec(task_id, max_turns=2, solo_mode=False))
    assert ep.status is EpisodeStatus.MAX_TURNS and ep.termination_reason == TR.TERMINATION_REASON_MAX_TURNS
    first, second = ep.turns
    assert first.parse_error and first.tool_calls == 0 and not second.parse_error
    actions = [m for m in ep.messages if m.role == common_pb2.ROLE_ASSISTANT][-2:]  # after the env's greeting
    assert actions[0].content == bad and not actions[0].tool_calls
    users = [m.content for m in ep.messages if m.role == common_pb2.ROLE_USER]
    assert users[-1] == SCRIPTED_USER  # the user's reply to the malformed turn
    assert ep.metrics()["parse_failures"] == 1.0
    _check_token_record(ep, gen)
    # the user's reply is in the prompt of turn 2 (mask 0)
    assert SCRIPTED_USER in tokenizer.decode(ep.token_ids[second.prompt_start:second.generation_start])


def test_truncated_reply_is_kept_as_cut_and_the_suffix_closes_the_turn(tokenizer, env, task):
    from rollout_service.episode import EpisodeStatus

    task_id, texts = task
    ep, gen = _play(tokenizer, env, [texts[0], "Done."], _spec(task_id, max_turns=2, max_new_tokens=6, solo_mode=False))
    first = ep.turns[0]
    assert first.truncated and first.num_generated == 6 and "truncated" in first.parse_error
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ep.token_ids[first.generation_start + 6] == eot and ep.loss_mask[first.generation_start + 6] == 0
    assert ep.status is EpisodeStatus.MAX_TURNS and ep.metrics()["truncated_turns"] >= 1
    _check_token_record(ep, gen)


def test_max_turns(tokenizer, env, task):
    from rollout_service.episode import EpisodeStatus, episode_to_proto

    task_id, texts = task
    ep, gen = _play(tokenizer, env, texts, _spec(task_id, max_turns=1))
    assert ep.status is EpisodeStatus.MAX_TURNS and len(ep.turns) == 1 and ep.env_breakdown is None
    assert ep.loss_mask[-1] == 1  # no env suffix after the last allowed turn
    _check_token_record(ep, gen)
    traj = episode_to_proto(ep)
    assert traj.termination_reason == TR.TERMINATION_REASON_MAX_TURNS and not traj.HasField("reward_breakdown")


def test_context_full(tokenizer, env, task):
    from rollout_service.episode import EpisodeStatus

    task_id, texts = task
    golden, _ = _play(tokenizer, env, texts, _spec(task_id))
    first = golden.turns[0]
    limit = first.generation_start + first.num_generated + 3  # room for turn 1, not for the tool answer after it
    ep, gen = _play(tokenizer, env, texts, _spec(task_id, max_context_tokens=limit))
    assert ep.status is EpisodeStatus.CONTEXT_FULL and ep.termination_reason == TR.TERMINATION_REASON_MAX_CONTEXT_TOKENS
    assert len(ep.turns) == 1 and len(ep.token_ids) > limit and ep.loss_mask[-1] == 0  # ends with the tool answer
    _check_token_record(ep, gen)
    # a prompt that does not fit at all: no turn
    ep, gen = _play(tokenizer, env, texts, _spec(task_id, max_context_tokens=first.generation_start))
    assert ep.status is EpisodeStatus.CONTEXT_FULL and ep.turns == () and gen.calls == 0 and sum(ep.loss_mask) == 0


def test_empty_reply_is_an_agent_error(tokenizer, env, task):
    from rollout_service.episode import EpisodeStatus

    task_id, texts = task
    ep, gen = _play(tokenizer, env, texts[:1], _spec(task_id))  # the script ends: an <|im_end|>-only reply
    assert ep.status is EpisodeStatus.AGENT_ERROR and ep.termination_reason == TR.TERMINATION_REASON_AGENT_ERROR
    assert [t.num_generated for t in ep.turns][-1] == 1
    _check_token_record(ep, gen)


class _StepFails:
    """The env client, except that Step number `fail_at` raises UNAVAILABLE (a dropped env server)."""

    def __init__(self, inner, fail_at: int):
        self.inner, self.fail_at, self.steps, self.closed = inner, fail_at, 0, []

    def reset(self, request):
        return self.inner.reset(request)

    def step(self, request):
        self.steps += 1
        if self.steps == self.fail_at:
            import grpc

            from sinkflex.errors import ServiceError

            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "env server went away")
        return self.inner.step(request)

    def close(self, session_id):
        self.closed.append(session_id)
        self.inner.close(session_id)


def test_env_errors_keep_what_was_sampled(tokenizer, env, task):
    from rollout_service.episode import EpisodeStatus, episode_to_proto

    task_id, texts = task
    # Reset fails: unknown task
    ep, gen = _play(tokenizer, env, texts, _spec("no_such_task"))
    assert ep.status is EpisodeStatus.ENV_ERROR and ep.error and ep.token_ids == () and gen.calls == 0
    traj = episode_to_proto(ep)
    assert traj.termination_reason == TR.TERMINATION_REASON_INFRASTRUCTURE_ERROR
    assert traj.metrics["infrastructure_error"] == 1.0 and "policy_versions" not in traj.metrics
    # the second Step fails: both sampled turns are kept, the session is closed
    flaky = _StepFails(env, fail_at=2)
    ep, gen = _play(tokenizer, flaky, texts, _spec(task_id))
    assert ep.status is EpisodeStatus.ENV_ERROR and "went away" in ep.error and len(ep.turns) == 2
    assert ep.loss_mask[-1] == 1 and len(flaky.closed) == 1
    _check_token_record(ep, gen)
    assert episode_to_proto(ep).termination_reason == TR.TERMINATION_REASON_INFRASTRUCTURE_ERROR


def test_formatter_is_chosen_once_by_tool_format(tokenizer):
    from rollout_service.formatting import FORMATTERS, ChatTemplateFormatter, formatter_factory

    make = formatter_factory("hermes", tokenizer)
    a, b = make(), make()
    assert isinstance(a, ChatTemplateFormatter) and a is not b  # fresh per episode
    assert set(FORMATTERS) == {"hermes", "qwen3", "llama3", "harmony"}
    with pytest.raises(ValueError, match="unknown tool format 'xml'"):
        formatter_factory("xml", tokenizer)


def test_generator_failure_and_a_weight_update_between_turns(tokenizer, env, task):
    """A generator that raises ends the episode with GENERATION_ERROR (what was sampled kept);
    a policy version that changes between turns: the trajectory's version is the oldest, and
    `policy_versions` counts 2."""
    from rollout_service.episode import EpisodeStatus, episode_to_proto, run_episode
    from rollout_service.formatting import ChatTemplateFormatter
    from rollout_service.generator import ScriptedGenerator

    task_id, texts = task

    class Updating(ScriptedGenerator):
        """Version 3 for the first reply, 4 after it; the third reply raises."""

        async def generate(self, prompt_ids, sampling, **kwargs):
            if self.calls == 2:
                raise RuntimeError("engine died")
            out = await super().generate(prompt_ids, sampling, **kwargs)
            self.policy_version += 1
            return out

    fmt = ChatTemplateFormatter(tokenizer)
    gen = Updating.from_texts(tokenizer, texts[:1] * 3, fmt.eot_id, policy_version=3)
    ep = asyncio.run(run_episode(gen, env, fmt, _spec(task_id, solo_mode=False)))
    assert ep.status is EpisodeStatus.GENERATION_ERROR and "engine died" in ep.error
    assert [t.policy_version for t in ep.turns] == [3, 4] and ep.start_policy_version == 3
    _check_token_record(ep, gen)
    traj = episode_to_proto(ep)
    assert traj.policy_version == 3 and traj.metrics["policy_versions"] == 2.0
    assert traj.termination_reason == TR.TERMINATION_REASON_INFRASTRUCTURE_ERROR and traj.metrics["infrastructure_error"] == 1.0


def test_the_vllm_engine_has_the_generator_signature():
    """`Engine` (not started here) and `ScriptedGenerator` implement `Generator.generate` alike."""
    import inspect

    from rollout_service.engine import Engine
    from rollout_service.generator import Generator, ScriptedGenerator

    want = list(inspect.signature(Generator.generate).parameters)
    assert list(inspect.signature(Engine.generate).parameters) == want
    assert list(inspect.signature(ScriptedGenerator.generate).parameters) == want
    assert inspect.iscoroutinefunction(Engine.generate)


def test_a_stopping_service_ends_episodes_at_a_turn_boundary_as_failed_with_the_reason(tokenizer, env, task):
    """SIGTERM's graceful stop (`AgentLoop.stopping`): asked before the reset and before every
    turn, it ends the episode there as STOPPED: the turns sampled so far are kept, the session is
    closed, and on the wire it is INFRASTRUCTURE_ERROR, unscored (NaN) with the reason."""
    import math

    from rollout_service.episode import STOPPED_ERROR, EpisodeStatus, episode_to_proto, run_episode
    from rollout_service.formatting import ChatTemplateFormatter
    from rollout_service.generator import ScriptedGenerator

    task_id, texts = task
    fmt = ChatTemplateFormatter(tokenizer)
    gen = ScriptedGenerator.from_texts(tokenizer, texts, fmt.eot_id)
    closing = _StepFails(env, fail_at=0)  # never fails: records the closed sessions
    ep = asyncio.run(run_episode(gen, closing, fmt, _spec(task_id), stopping=lambda: gen.calls >= 1))
    assert ep.status is EpisodeStatus.STOPPED and ep.error == STOPPED_ERROR.format(turn=2)
    assert len(ep.turns) == 1 and ep.loss_mask[-1] == 0 and len(closing.closed) == 1  # the env reply to turn 1 is kept
    _check_token_record(ep, gen)
    traj = episode_to_proto(ep)
    assert traj.termination_reason == TR.TERMINATION_REASON_INFRASTRUCTURE_ERROR
    assert traj.metrics["stopped"] == 1.0 and traj.metrics["infrastructure_error"] == 1.0
    assert math.isnan(traj.reward) and traj.reward_breakdown.info == ep.error and "SIGTERM" in ep.error
    # stopping before the reset: no session, no tokens
    gen = ScriptedGenerator.from_texts(tokenizer, texts, fmt.eot_id)
    ep = asyncio.run(run_episode(gen, closing, fmt, _spec(task_id), stopping=lambda: True))
    assert ep.status is EpisodeStatus.STOPPED and ep.token_ids == () and gen.calls == 0 and len(closing.closed) == 1
    assert ep.error == STOPPED_ERROR.format(turn=1)


def test_a_group_cut_short_by_the_stop_is_returned_unscored_and_never_published(tokenizer, env, reward, task,
                                                                                 redis_embedded_url, unique_stream):
    """AgentLoop.run_group while the service stops: every episode of the group comes back
    (none lost), the group is not scored and not put into the buffer (a group cut short is not
    G samples of the policy); `totals["groups_stopped"]` counts it. Without the stop the same
    group is scored 1.0 and published."""
    import math

    from rollout_service.agent import GROUP_STOPPED, AgentLoop
    from rollout_service.engine import Sampling
    from rollout_service.formatting import ChatTemplateFormatter
    from rollout_service.generator import ScriptedGenerator
    from sinkflex.buffer import TrajectoryBuffer

    task_id, texts = task
    buffer = TrajectoryBuffer(redis_embedded_url, stream=unique_stream)
    try:
        class StopsTheService(ScriptedGenerator):
            """SIGTERM arrives while the first reply of sample 0 is being generated."""

            async def generate(self, prompt_ids, sampling, **kwargs):
                out = await super().generate(prompt_ids, sampling, **kwargs)
                loop.stopping.set()
                return out

        eot = ChatTemplateFormatter(tokenizer).eot_id
        loop = AgentLoop(StopsTheService.from_texts(tokenizer, texts, eot), tokenizer, env, reward=reward, buffer=buffer)
        group = asyncio.run(loop.run_group("mock", task_id, 1, Sampling(max_new_tokens=256, seed=3), 6, 8192,
                                           solo_mode=True, publish=True))
        (traj,) = group.trajectories
        assert traj.metrics["stopped"] == 1.0 and len(traj.turns) == 1 and math.isnan(traj.reward)
        assert traj.termination_reason == TR.TERMINATION_REASON_INFRASTRUCTURE_ERROR and "SIGTERM" in traj.reward_breakdown.info
        assert loop.totals["groups_stopped"] == 1.0 and loop.totals["unscored"] == 1.0 and loop.groups_completed == 1
        assert buffer.stats().stream_length == 0  # not published
        # a finished episode in a stopped group is unscored too, and says why
        loop._mark_stopped([traj, finished := common_pb2.Trajectory(reward=1.0)])  # noqa: SLF001
        assert math.isnan(finished.reward) and finished.reward_breakdown.info == GROUP_STOPPED
        # the same group without the stop: scored and published
        plain = AgentLoop(ScriptedGenerator.from_texts(tokenizer, texts, eot), tokenizer, env, reward=reward, buffer=buffer)
        group = asyncio.run(plain.run_group("mock", task_id, 1, Sampling(max_new_tokens=256, seed=3), 6, 8192,
                                            solo_mode=True, publish=True))
        assert group.trajectories[0].reward == 1.0 and buffer.stats().stream_length == 1
    finally:
        buffer.delete()
        buffer.close()
