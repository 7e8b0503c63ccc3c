"""The warm start: demonstrations built from golden actions through the real env and reward
services (over loopback gRPC), rendered exactly as the rollout service renders a trajectory,
and the masked cross-entropy the learner trains them with."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sinkflex.api.common.v1 import common_pb2

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def gen_tasks(tmp_path_factory):
    from tau2_adapter.generate import generate_mock_tasks, write_task_dir

    out = tmp_path_factory.mktemp("gen")
    write_task_dir(generate_mock_tasks(train=8, test=4, seed=0), out)
    return out


@pytest.fixture(scope="module")
def services(gen_tasks):
    """A real env server and a real reward server over the generated tasks; their gRPC clients."""
    from env_service.client import GrpcEnvClient
    from env_service.config import EnvServiceConfig
    from tau2_adapter.logs import quiet_tau2_logs
    from env_service.server import build_server as env_server
    from reward_service.client import GrpcRewardClient
    from reward_service.config import RewardServiceConfig
    from reward_service.server import build_server as reward_server

    quiet_tau2_logs("WARNING")
    files = {"mock": [str(gen_tasks)]}
    es, _ = env_server(EnvServiceConfig(domains=("mock",), task_files=files, user_base_url=None), port=0)
    rs, servicer = reward_server(RewardServiceConfig(port=0, metrics_port=None, preload_envs=[], task_files=files))
    port = rs.start()
    servicer.load(["mock"])
    rs.set_serving()
    env = GrpcEnvClient(f"127.0.0.1:{es.port}", timeout=60, wait_ready=True)
    reward = GrpcRewardClient(f"127.0.0.1:{port}", timeout=60)
    yield env, reward
    env.shutdown()
    reward.close()
    es.stop()
    rs.stop()


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def demos(services, tokenizer, gen_tasks):
    from sinkflex_rl.warm_start import build_demonstrations
    from tau2_adapter.tasks import domain_tasks, golden_actions

    env, reward = services
    ts = domain_tasks("mock", [gen_tasks])
    actions = {t: golden_actions(ts.tasks[t]) for t in ts.splits["train"]}
    return build_demonstrations(env, reward, tokenizer, "mock", actions, solo_mode=True, max_turns=4,
                                max_context_tokens=4096), ts


def test_every_family_gives_a_demonstration_scored_1(demos):
    from tau2_adapter.generate import family_of

    d, ts = demos
    assert not d.dropped
    assert len(d.groups) == len(ts.splits["train"])
    assert {family_of(g.task_id) for g in d.groups} == {"create", "status", "create_update", "forbidden"}
    for g in d.groups:
        (t,) = g.trajectories
        assert t.reward == 1.0 and t.termination_reason == common_pb2.TERMINATION_REASON_AGENT_STOP
        assert len(t.token_ids) == len(t.logprobs) == len(t.loss_mask) and t.loss_mask[0] == 0


def test_demonstration_tokens_are_the_chat_template_render_of_its_conversation(demos, services, tokenizer):
    """Token ids = the tokenizer's chat template over the whole conversation (system + Hermes
    tools, each golden call, each tool answer) rendered at once; loss mask 1 exactly on the
    agent's tokens (each call and its end-of-turn token)."""
    from rollout_service.formatting import HERMES_TOOLS_PROMPT, hermes_call_text, tool_schema
    from sinkflex.api.env.v1 import env_pb2

    env, _ = services
    d, _ = demos
    for g in d.groups:
        (t,) = g.trajectories
        reset = env.reset(env_pb2.ResetRequest(env="mock", task_id=g.task_id, solo_mode=True))
        env.close(reset.session_id)
        tools = "\n".join(json.dumps(tool_schema(s)) for s in reset.tools)
        chat = [{"role": "system", "content": HERMES_TOOLS_PROMPT.format(tools=tools) + "\n\n" + reset.system_prompt}]
        agent_texts = []
        for m in t.messages[1:]:
            if m.role == common_pb2.ROLE_ASSISTANT:
                text = "\n".join(hermes_call_text(c) for c in m.tool_calls)
                chat.append({"role": "assistant", "content": text})
                agent_texts.append(text + "<|im_end|>")
            elif m.role == common_pb2.ROLE_TOOL:
                chat.append({"role": "tool", "content": f"<tool_response>\n{m.content}\n</tool_response>"})
        full = list(tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False))
        ids = list(t.token_ids)
        assert full[: len(ids)] == ids, g.task_id
        assert tokenizer.decode(full[len(ids):]) == "\n"  # the template's newline after the last <|im_end|>
        masked = [i for i, m in zip(ids, t.loss_mask) if m]
        assert tokenizer.decode(masked) == "".join(agent_texts)
        # every masked run is one agent turn: generated ids are contiguous per turn
        runs = sum(1 for k in range(len(t.loss_mask)) if t.loss_mask[k] and (k == 0 or not t.loss_mask[k - 1]))
        assert runs == len(agent_texts) == len(t.turns)


def test_demonstrations_file_roundtrip_and_errors(demos, tmp_path):
    from learner_service.sft import read_demonstrations, write_demonstrations

    d, _ = demos
    path = tmp_path / "demos.pb"
    assert write_demonstrations(path, d.groups) == len(d.groups)
    back = read_demonstrations(path)
    assert back == list(d.groups)  # message equality (map fields serialise in no fixed order)
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(ValueError, match="truncated"):
        read_demonstrations(path)


def test_sft_loss_is_masked_cross_entropy():
    from learner_service.sft import sft_loss

    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5))
    mask = torch.tensor([[0, 1, 1, 0, 1], [1, 0, 0, 0, 1]], dtype=torch.bool)
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    loss, nll = sft_loss(logp, mask, float(mask.sum()))
    ce = torch.nn.functional.cross_entropy(logits[mask], targets[mask])
    assert torch.allclose(loss.double(), ce, atol=1e-6) and torch.allclose(nll.double(), ce * mask.sum(), atol=1e-5)
    with pytest.raises(ValueError, match="num_tokens"):
        sft_loss(logp, mask, 0.0)
    with pytest.raises(ValueError, match="same shape"):
        sft_loss(logp, mask[:, :3], 1.0)


class _CaptureGrads:
    """Stands in for the optimiser: records the gradients `step` would apply."""

    def __init__(self, model):
        self.model = model
        self.grads: dict[str, torch.Tensor] = {}

    def step(self):
        self.grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=True)


def test_warm_start_gradient_does_not_depend_on_micro_batching(demos, tmp_path, torch_one_thread):
    """The gradient of one warm-start step over the same demonstrations is the same (float64,
    max |Δ| ≤ 1e-8 of the largest entry) whether they are fed one per micro-batch (unshared rows) or all at once (one
    shared-prefix row: they share the tool block and the policy); the loss is normalised by
    the global token count. Then a whole warm start publishes the next policy version."""
    from learner_service.sft import demonstration_rollouts, sft_step, warm_start
    from learner_service.trainer import Learner
    from tests.fixtures.learner import TINY_LLAMA, learner_config

    d, _ = demos
    arch = {**TINY_LLAMA, "vocab_size": 49152, "hidden_size": 16, "intermediate_size": 16, "num_attention_heads": 2,
            "num_key_value_heads": 1, "max_position_embeddings": 4096}
    groups = list(d.groups[:3])
    rollouts = demonstration_rollouts(groups)
    grads, sums = [], []
    for mbs in (1, 3):
        cfg = learner_config(tmp_path / f"m{mbs}", arch=arch, model={"dtype": "float64", "gradient_checkpointing": False},
                             batch={"micro_batch_size": mbs}, optim={"max_grad_norm": None},
                             warm_start={"epochs": 1, "batch_size": 3, "lr": 1e-2})
        learner = Learner(cfg, metrics=False)
        cap = _CaptureGrads(learner.model)
        nll, tokens, hits, gn = sft_step(learner, cap, rollouts, [0, 1, 2])
        assert tokens == sum(int(r.mask_T.sum()) for r in rollouts) and nll > 0 and gn > 0
        grads.append(cap.grads)
        sums.append((nll, tokens, hits))
    assert sums[0][1:] == sums[1][1:] and sums[0][0] == pytest.approx(sums[1][0], rel=1e-12)
    assert grads[0].keys() == grads[1].keys()
    for k in grads[0]:
        scale = grads[0][k].abs().max().item()
        assert (grads[0][k] - grads[1][k]).abs().max().item() <= 1e-8 * max(scale, 1e-12), k
    m = warm_start(learner, groups)
    assert learner.state.policy_version == 1 == learner.state.warm_start_version
    assert m["warm_start_demonstrations"] == 3 and m["warm_start_loss"] > 0
    with pytest.raises(ValueError, match="no loss-mask token"):
        g = common_pb2.TrajectoryGroup(group_id="x", trajectories=[common_pb2.Trajectory(
            token_ids=[1, 2, 3], logprobs=[0, 0, 0], loss_mask=[0, 0, 0])])
        demonstration_rollouts([g])


def test_shaped_reward_from_taus_own_checks(services, gen_tasks):
    """Partial credit from τ²-Bench's per-check records: a create-then-update episode whose second
    call is wrong scores 0.0 in τ²-Bench and half the action credit when shaped."""
    from env_service.replay import replay_golden
    from learner_service.config import RewardShapingConfig
    from learner_service.shaping import check_shares, shaped_reward
    from sinkflex.api.reward.v1 import reward_pb2
    from tau2_adapter.tasks import load_task_dir

    env, reward = services
    task_id = next(t for t in load_task_dir(gen_tasks).splits["train"] if t.startswith("gen_create_update"))
    r = replay_golden(env, "mock", task_id, solo_mode=True, task_files=[gen_tasks],
                      edit=lambda i, name, args: {**args, "status": "pending" if args.get("status") == "completed" else "completed"} if i == 1 else args)
    b = reward.score(reward_pb2.ScoreRequest(env="mock", task_id=task_id, messages=r.messages, solo_mode=True,
                                             termination_reason=common_pb2.TERMINATION_REASON_AGENT_STOP))
    assert b.reward == 0.0
    assert check_shares(b) == {"action": 0.5}
    assert shaped_reward(b.reward, b, RewardShapingConfig()) == 0.0  # off by default
    assert shaped_reward(b.reward, b, RewardShapingConfig(alpha=0.2)) == pytest.approx(0.1)
    assert math.isnan(shaped_reward(float("nan"), b, RewardShapingConfig(alpha=0.2)))  # unscored stays unscored
    # in the learner: a group of the wrong and a third, empty, episode has zero variance under
    # τ²-Bench's reward, and a non-zero advantage for the half-right one once shaped
    from learner_service.batch import rollouts_from_group

    def traj(breakdown):
        return common_pb2.Trajectory(token_ids=[1, 2, 3], logprobs=[0, -1, -1], loss_mask=[0, 1, 1],
                                     reward=breakdown.reward, reward_breakdown=breakdown)

    group = common_pb2.TrajectoryGroup(group_id="g", trajectories=[traj(b), traj(common_pb2.RewardBreakdown(reward=0.0))])
    _, plain = rollouts_from_group(group)
    _, shaped = rollouts_from_group(group, shaping=RewardShapingConfig(alpha=0.2))
    assert plain.zero_variance and not shaped.zero_variance
    assert shaped.adv_G[0] > 0 > shaped.adv_G[1] and shaped.rewards_G.tolist() == pytest.approx([0.1, 0.0])
