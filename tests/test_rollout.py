"""The rollout service end to end: SmolLM2 on vLLM (CPU), real retail tasks with the tau2
user simulator, real reward service, real Redis, gRPC over loopback.

One engine for the whole session (tests/fixtures/rollout.py); tiny budgets (2 turns of
32 tokens, user replies of 24 tokens) keep the module within a few minutes.
"""

from __future__ import annotations

import logging
import shutil

import grpc
import pytest
import torch

from rollout_service.client import GrpcRolloutClient
from rollout_service.engine import Sampling
from sinkflex.api.common.v1 import common_pb2
from sinkflex.api.rollout.v1 import rollout_pb2
from sinkflex.errors import ServiceError

pytestmark = pytest.mark.slow

G = 4
MAX_NEW = 32


@pytest.fixture(scope="module")
def client(rollout_stack):
    with GrpcRolloutClient(rollout_stack.address, timeout=1800, wait_ready=True) as c:
        yield c


@pytest.fixture(scope="module")
def retail_group(rollout_stack, client):
    """One published group of G retail trajectories, rolled out over gRPC."""
    task = rollout_stack.env.list_tasks("retail", "train")[0]
    request = rollout_pb2.RolloutRequest(env="retail", task_ids=[task], group_size=G, publish=True, max_turns=2,
                                         sampling=common_pb2.SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=7))
    groups = list(client.rollout(request))
    assert len(groups) == 1
    return groups[0]


def test_group_lands_in_redis_with_token_level_invariants(rollout_stack, retail_group, rollout_tokenizer):
    entries = rollout_stack.buffer.read("test-learner", count=8, block_ms=2000)
    assert [e.group.group_id for e in entries] == [retail_group.group_id]
    stored = entries[0].group
    assert stored == retail_group  # what the learner reads is what the stream returned
    rollout_stack.buffer.ack(entries)
    assert len(stored.trajectories) == G and stored.env == "retail"
    eot = rollout_tokenizer.convert_tokens_to_ids("<|im_end|>")
    for traj in stored.trajectories:
        n = len(traj.token_ids)
        assert n == len(traj.logprobs) == len(traj.loss_mask) > 1000  # the retail system prompt alone is long
        assert traj.termination_reason != common_pb2.TERMINATION_REASON_INFRASTRUCTURE_ERROR, traj.metrics
        assert 1 <= len(traj.turns) <= 2
        mask = [0] * n
        for k, t in enumerate(traj.turns):
            s, e = t.generation_start, t.generation_start + t.num_generated
            mask[s:e] = [1] * t.num_generated
            gen = list(traj.token_ids[s:e])
            if t.truncated:  # cut at max_new_tokens: tokens kept, no EOS invented
                assert t.num_generated == MAX_NEW and gen[-1] != eot
            else:  # the end-of-turn token is generated and trained on
                assert gen[-1] == eot and t.num_generated <= MAX_NEW
            assert all(lp <= 0.0 for lp in traj.logprobs[s:e]) and any(lp < 0 for lp in traj.logprobs[s:e])
            assert t.policy_version == traj.policy_version
            if k + 1 < len(traj.turns):
                nxt = traj.turns[k + 1]
                # the prompt of turn k+1 starts with every id of turn k (prompt + generated) ...
                assert nxt.prompt_start == e and nxt.generation_start > e
                # ... followed by the env reply rendered once as a suffix (template text, mask 0)
                suffix = rollout_tokenizer.decode(list(traj.token_ids[e:nxt.generation_start]))
                assert suffix.endswith("<|im_start|>assistant\n")
                assert suffix.startswith("<|im_end|>\n<|im_start|>" if t.truncated else "\n<|im_start|>")
        assert list(traj.loss_mask) == mask  # 1 exactly on generated tokens
        assert all(lp == 0.0 for lp, m in zip(traj.logprobs, mask) if m == 0)
        assert traj.metrics["parse_failures"] == sum(t.parse_error for t in traj.turns)
        assert traj.metrics["generated_tokens"] == sum(mask)
        # scored by the reward service (tau2 checker): checks ran, or it says why none did
        assert traj.reward_breakdown.components or "terminated prematurely" in traj.reward_breakdown.info
        assert traj.reward == traj.reward_breakdown.reward
        roles = [m.role for m in traj.messages]
        assert roles[0] == common_pb2.ROLE_SYSTEM and common_pb2.ROLE_USER in roles  # user simulator answered
    assert len({tuple(t.token_ids) for t in stored.trajectories}) > 1  # G different samples


def test_engine_logprobs_match_transformers_rescoring(smollm2_dir, retail_group, caplog):
    from transformers import AutoModelForCausalLM

    from rollout_service.rescore import rescore_group, turn_mismatch

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    caplog.set_level(logging.INFO, logger="rollout_service.rescore")
    diffs = []
    trajs = list(retail_group.trajectories)
    refs = rescore_group(model, trajs, temperature=1.0)  # shared prompt prefix computed once
    for traj, ref in zip(trajs, refs):
        per_turn = turn_mismatch(model, traj, temperature=1.0, ref_T=ref)
        assert len(per_turn) == len(traj.turns)
        assert "logprob_mismatch_max" in traj.metrics and "logprob_mismatch_turn0" in traj.metrics
        diffs.extend(per_turn)
    n = sum(d.num_tokens for d in diffs)
    mean = sum(d.mean_abs * d.num_tokens for d in diffs) / n
    worst = max(d.max_abs for d in diffs)
    print(f"\nengine vs transformers log-probs over {n} generated tokens: mean |diff| {mean:.2e}, max |diff| {worst:.2e}")
    assert "logprob mismatch" in caplog.text  # the per-turn metric is logged
    assert mean < 2e-3 and worst < 5e-2


def _greedy(rollout_stack, rollout_tokenizer):
    engine = rollout_stack.worker.engine
    ids = list(rollout_tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                                     add_generation_prompt=True, tokenize=True, return_dict=False))
    return engine.run(engine.generate(ids, Sampling(temperature=0.0, max_new_tokens=12)))


def test_update_weights_changes_generation_without_restart(rollout_stack, client, rollout_tokenizer, smollm2_dir, tmp_path,
                                                           retail_group):
    from safetensors.torch import load_file, save_file

    engine = rollout_stack.worker.engine
    v0 = engine.policy_version
    before = _greedy(rollout_stack, rollout_tokenizer)
    with pytest.raises(ServiceError) as err:
        client.update_weights(v0 + 1, str(tmp_path / "missing"))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(ServiceError) as err:
        client.update_weights(v0, str(smollm2_dir))
    # not above the served version: refused (version 0, the base model, is never a published version)
    assert err.value.code == (grpc.StatusCode.INVALID_ARGUMENT if v0 == 0 else grpc.StatusCode.FAILED_PRECONDITION)

    perturbed = tmp_path / "perturbed"
    perturbed.mkdir()
    for f in smollm2_dir.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, perturbed / f.name)
    gen = torch.Generator().manual_seed(0)
    state = {k: (v + 0.5 * v.float().std() * torch.randn(v.shape, generator=gen)).to(v.dtype) if v.ndim == 2 else v
             for k, v in load_file(str(smollm2_dir / "model.safetensors")).items()}
    save_file(state, str(perturbed / "model.safetensors"), metadata={"format": "pt"})
    llm_before = engine.llm
    resp = client.update_weights(v0 + 1, str(perturbed))
    assert resp.policy_version == v0 + 1 and resp.load_seconds > 0
    after = _greedy(rollout_stack, rollout_tokenizer)
    assert engine.llm is llm_before  # same engine, no restart
    assert after.policy_version == v0 + 1 and before.policy_version == v0
    assert after.token_ids != before.token_ids

    resp = client.update_weights(v0 + 2, str(smollm2_dir))  # back to the original weights
    restored = _greedy(rollout_stack, rollout_tokenizer)
    assert restored.token_ids == before.token_ids and restored.policy_version == v0 + 2
    assert client.status().policy_version == v0 + 2


def test_bad_requests_get_status_codes(client):
    with pytest.raises(ServiceError) as err:
        list(client.rollout(rollout_pb2.RolloutRequest(env="retail", group_size=2)))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "task_ids" in err.value.message
    with pytest.raises(ServiceError) as err:
        list(client.rollout(rollout_pb2.RolloutRequest(env="retail", task_ids=["no-such-task"], group_size=2)))
    assert err.value.code == grpc.StatusCode.NOT_FOUND and "no-such-task" in err.value.message
    with pytest.raises(ServiceError) as err:
        list(client.rollout(rollout_pb2.RolloutRequest(env="retail", task_ids=["0"], group_size=0)))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_status_counts_groups_and_tokens(client, retail_group):
    status = client.status()
    assert status.groups_completed >= 1 and status.groups_in_flight == 0
    assert status.tokens_generated >= sum(sum(t.num_generated for t in tr.turns) for tr in retail_group.trajectories)
    assert status.metrics["turns"] >= G


def test_user_simulator_endpoint_answers_litellm(user_sim_endpoint):
    import litellm

    resp = litellm.completion(model="openai/smollm2", api_base=user_sim_endpoint.base_url, api_key="EMPTY",
                              messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0.0)
    text = resp.choices[0].message.content
    assert isinstance(text, str) and text.strip()
    assert resp.usage.completion_tokens <= 8


def test_a_cancelled_rollout_stops_its_groups_and_publishes_none(rollout_stack):
    """The client cancels a publishing Rollout while its groups are in flight (as the controller
    does when it samples a step again after a service restart): the episodes stop, their env
    sessions are closed, and no group of the request reaches the buffer, then or later."""
    import time

    from sinkflex.api.rollout.v1 import rollout_pb2_grpc

    stack = rollout_stack
    before = stack.buffer.stats().stream_length
    tasks = stack.env.list_tasks("retail", "train")[:2]
    request = rollout_pb2.RolloutRequest(env="retail", task_ids=tasks, group_size=2, publish=True, max_turns=2,
                                         sampling=common_pb2.SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=11))
    with grpc.insecure_channel(stack.address) as channel:
        call = rollout_pb2_grpc.RolloutServiceStub(channel).Rollout(request)
        deadline = time.monotonic() + 120
        while not (stack.worker.loop.groups_in_flight and stack.env.core.num_sessions):  # episodes begun
            assert time.monotonic() < deadline, "no episode in flight"
            time.sleep(0.05)
        call.cancel()

        def wait_until_stopped(what: str) -> None:
            t0 = time.monotonic()
            while stack.worker.loop.groups_in_flight or stack.env.core.num_sessions:
                assert time.monotonic() - t0 < 30, f"{what}: {stack.worker.loop.groups_in_flight} group(s) in flight, " \
                                                   f"{stack.env.core.num_sessions} env session(s) open"
                time.sleep(0.05)

        wait_until_stopped("the cancelled request's groups went on")
    time.sleep(5.0)  # longer than a turn: a group left running would be published by now
    wait_until_stopped("a session of the cancelled request was left open")  # (a reset still running at the cancel)
    assert stack.buffer.stats().stream_length == before, "a cancelled request published a group"
