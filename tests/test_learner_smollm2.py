"""A GRPO step on the real SmolLM2-135M-Instruct (prepared folder) through the sink path,
on trajectories tokenised with its own chat template; the published version is a complete
transformers folder (weights, config, tokenizer)."""

import math

import pytest
import torch

from learner_service.publish import publish_policy
from learner_service.trainer import Learner
from sinkflex.api.common.v1 import common_pb2
from tests.fixtures.learner import learner_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_one_thread")]

REPLIES = ["I can help with that order.", "Sure, what is your order id?", "No.", "Let me check the order status for you."]


def _group(tok) -> common_pb2.TrajectoryGroup:
    prompt = tok.apply_chat_template(
        [{"role": "system", "content": "You are a retail agent."}, {"role": "user", "content": "Where is my order?"}],
        add_generation_prompt=True, tokenize=True, return_dict=False,
    )
    end = tok.convert_tokens_to_ids("<|im_end|>")
    group = common_pb2.TrajectoryGroup(group_id="smol-0", task_id="t", env="retail")
    for i, text in enumerate(REPLIES):
        reply = tok.encode(text, add_special_tokens=False) + [end]
        ids = list(prompt) + reply
        mask = [0] * len(prompt) + [1] * len(reply)
        group.trajectories.add(trajectory_id=f"smol-0-{i}", token_ids=ids, logprobs=[0.0] * len(ids), loss_mask=mask,
                               reward=[1.0, 1.0, 0.0, 0.5][i])
    return group


def test_smollm2_grpo_step_and_publish(tmp_path, smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    cfg = learner_config(tmp_path, None, model=dict(path=str(smollm2_dir), arch=None, attn_implementation="sinkflex"),
                         grpo=dict(old_logprobs="recompute", temperature=0.7), optim=dict(lr=1e-5))
    learner = Learner(cfg, metrics=False)
    assert learner.model.config._attn_implementation == "sinkflex"
    w = learner.model.model.layers[0].self_attn.q_proj.weight
    w0 = w.detach().clone()
    m = learner.train_step([_group(tok)])
    assert m["policy_version"] == 1 and math.isfinite(m["loss"]) and m["grad_norm"] > 0
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # recomputed π_old, one optimiser step
    assert not torch.equal(w0, w.detach())
    pub = publish_policy(learner)
    loaded = AutoModelForCausalLM.from_pretrained(pub.location)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    # the model's own template is the published version's default one (sinkflex.chat_templates
    # adds a named tool_use template beside it for serving)
    assert AutoTokenizer.from_pretrained(pub.location).chat_template["default"] == tok.chat_template
    torch.testing.assert_close(loaded.model.layers[0].self_attn.q_proj.weight, w.detach())
