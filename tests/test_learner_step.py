"""The in-process Learner on tiny random models (CPU, fp32), through the sink attention path."""

import json
import math
from pathlib import Path

import pytest
import torch

from learner_service.checkpoint import load_checkpoint, save_checkpoint
from learner_service.publish import publish_policy
from learner_service.trainer import Learner
from tests.fixtures.learner import TINY_GPT_OSS, TINY_LLAMA, learner_config, make_group

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _weights(learner):
    return {k: v.detach().clone() for k, v in learner.model.state_dict().items()}


def test_gpt_oss_grpo_steps_on_sink_path(tmp_path):
    from sinkflex.attention.hf import NAME  # the sink path is registered under this name

    cfg = learner_config(tmp_path, TINY_GPT_OSS, grpo=dict(beta=0.05, clip_eps_high=0.28), tensorboard=True)
    learner = Learner(cfg)
    assert learner.model.config._attn_implementation == NAME == "sinkflex"
    assert learner.model.config.layer_types == ["sliding_attention", "full_attention"]
    sinks0 = learner.model.model.layers[0].self_attn.sinks.detach().clone()
    w0 = _weights(learner)
    for step in range(3):
        groups = [make_group(f"s{step}-a", [0.0, 1.0, 1.0, 0.0], seed=2 * step),
                  make_group(f"s{step}-b", [0.2, 0.9, 0.4], seed=2 * step + 1, policy_version=0)]
        m = learner.train_step(groups)
        assert m["policy_version"] == step + 1 and learner.state.policy_version == step + 1
        for name in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "clip_fraction", "tokens_per_s", "peak_memory_gb"):
            assert math.isfinite(m[name]), name
        assert m["rollouts"] == 7 and m["groups"] == 2
        assert m["staleness_max"] == step  # sampled by version 0, trained at version `step`
        assert m["reward_mean"] == pytest.approx((2.0 + 1.5) / 7)
        assert m["grad_norm"] > 0 and m["entropy"] > 0
    assert m["kl"] > 0  # the policy moved away from the reference
    w1 = _weights(learner)
    assert all(torch.isfinite(v).all() for v in w1.values())
    changed = [k for k in w0 if not torch.equal(w0[k], w1[k])]
    assert len(changed) == len(w0), set(w0) - set(changed)
    assert not torch.equal(sinks0, learner.model.model.layers[0].self_attn.sinks)  # sinks learn too
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["kind"] == "train" for r in records)
    assert {"loss", "kl", "clip_fraction", "staleness_mean", "adv_std"} <= set(records[0])
    learner.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(tmp_path / "tb"))
    tb.Reload()
    assert [e.step for e in tb.Scalars("train/loss")] == [1, 2, 3]
    assert tb.Scalars("train/kl")[-1].value == pytest.approx(m["kl"], rel=1e-5)


def test_recomputed_old_logprobs_give_ratio_one_and_zero_kl(tmp_path):
    # π_θold recomputed = π_θ before the update; reference = the same initial weights.
    cfg = learner_config(tmp_path, TINY_LLAMA, grpo=dict(beta=0.1, old_logprobs="recompute"))
    learner = Learner(cfg)
    m = learner.train_step([make_group("g", [0.0, 1.0, 0.5], seed=3)])
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert m["clip_fraction"] == 0.0
    assert m["kl"] == pytest.approx(0.0, abs=1e-7)


#: Adam with eps ≫ |g| is SGD: update = lr·g/(|g| + eps) ≈ g. Plain Adam's first step is
#: lr·sign(g), which turns float noise on near-zero gradients into differences of size lr.
LINEAR_ADAM = dict(lr=1e3, eps=1e3, max_grad_norm=None)


def test_micro_batching_does_not_change_the_update(tmp_path):
    groups = [make_group("a", [0.0, 1.0, 0.3, 0.7], seed=4), make_group("b", [1.0, 0.0], seed=5)]
    out = []
    for mbs in (1, 3, 8):
        learner = Learner(learner_config(tmp_path / str(mbs), TINY_GPT_OSS, batch=dict(micro_batch_size=mbs), optim=LINEAR_ADAM), metrics=False)
        m = learner.train_step(groups)
        out.append((_weights(learner), m["loss"]))
    for w, loss in out[1:]:
        assert loss == pytest.approx(out[0][1], rel=1e-5, abs=1e-7)
        for k in w:
            torch.testing.assert_close(w[k], out[0][0][k], rtol=1e-5, atol=1e-6)


def test_zero_variance_filtered_duplicates_skipped(tmp_path):
    cfg = learner_config(tmp_path, TINY_LLAMA, grpo=dict(filter_zero_variance=True))
    learner = Learner(cfg, metrics=False)
    w0 = _weights(learner)
    # all-equal rewards and a group of one: both zero-variance, both filtered → no update.
    m = learner.train_step([make_group("eq", [1.0, 1.0, 1.0], seed=6), make_group("one", [0.5], seed=7)])
    assert m["skipped"] == 1 and m["zero_variance_groups"] == 2 and m["filtered_groups"] == 2
    assert learner.state.policy_version == 0 and learner.is_trained("eq")
    assert all(torch.equal(w0[k], v) for k, v in _weights(learner).items())
    m = learner.train_step([make_group("eq", [0.0, 1.0], seed=6), make_group("ok", [0.0, 1.0], seed=8)])
    assert m["duplicate_groups"] == 1 and m["groups"] == 1 and learner.state.policy_version == 1
    # NaN reward: excluded from the statistics, its rollout gets advantage 0.
    m = learner.train_step([make_group("nan", [0.0, float("nan"), 1.0], seed=9)])
    assert m["unscored"] == 1 and m["reward_mean"] == 0.5 and m["adv_zero_fraction"] == pytest.approx(1 / 3)


def test_invalid_group_is_refused(tmp_path):
    learner = Learner(learner_config(tmp_path, TINY_LLAMA), metrics=False)
    bad = make_group("bad", [0.0, 1.0], seed=1)
    del bad.trajectories[1].logprobs[-1]
    with pytest.raises(ValueError, match="differ in length"):
        learner.train_step([bad])
    bad = make_group("bad2", [0.0, 1.0], seed=1)
    bad.trajectories[0].loss_mask[0] = 1
    with pytest.raises(ValueError, match=r"loss_mask\[0\]"):
        learner.train_step([bad])


def test_mini_batches_keep_groups_whole(tmp_path):
    """4 groups of 4 in 2 mini-batches: 2 optimiser steps, and each group is one shared-prefix
    row (its prompt computed once), never split across mini-batches."""
    over = dict(grpo=dict(mini_batches=2), batch=dict(groups_per_step=4, micro_batch_size=4, shared_prefix_min_tokens=4))
    groups = [make_group(f"g{i}", [0.0, 1.0, 0.5, 0.2], seed=i, prompt_len=12, lengths=[20, 23, 18, 25]) for i in range(4)]
    m = Learner(learner_config(tmp_path / "two", TINY_LLAMA, **over), metrics=False).train_step(groups)
    one = dict(over, grpo=dict(mini_batches=1))
    m1 = Learner(learner_config(tmp_path / "one", TINY_LLAMA, **one), metrics=False).train_step(groups)
    assert m["optimizer_steps"] == 2 and m1["optimizer_steps"] == 1
    assert m["shared_prefix_rows"] == m1["shared_prefix_rows"] == 4 and m["shared_prefix_fallback_groups"] == 0
    assert m["positions_computed"] == m1["positions_computed"] < m["positions_trained"]
    assert m["rollouts"] == 16


def test_checkpoint_resume_is_bitwise(tmp_path):
    # PPO epochs and mini-batches exercise the shuffle generator, scheduler and Adam state.
    over = dict(grpo=dict(ppo_epochs=2, mini_batches=2), optim=dict(scheduler="linear", warmup_steps=1, total_steps=10))
    g1, g2 = [make_group("a", [0.0, 1.0, 0.5], seed=1)], [make_group("b", [1.0, 0.0, 0.2], seed=2)]
    a = Learner(learner_config(tmp_path, TINY_GPT_OSS, **over), metrics=False)
    a.train_step(g1)
    path = save_checkpoint(a)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == path.name
    torch.manual_seed(123)  # the checkpoint's RNG state must win over this
    a.train_step(g2)
    b = Learner(learner_config(tmp_path, TINY_GPT_OSS, **over), metrics=False)
    assert load_checkpoint(b) == path
    assert b.state.policy_version == 1 and b.state.trained_group_ids == ["a"]
    b.train_step(g2)
    wa, wb = _weights(a), _weights(b)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert b.state.policy_version == 2 and b.scheduler.get_last_lr() == a.scheduler.get_last_lr()


def test_published_policy_loads_with_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    learner = Learner(learner_config(tmp_path, TINY_GPT_OSS), metrics=False)
    learner.train_step([make_group("a", [0.0, 1.0], seed=1)])
    pub = publish_policy(learner)
    assert pub.policy_version == 1 and pub.location.endswith("policy/v1") and pub.update_error == ""
    assert learner.state.published_version == 1
    loaded = AutoModelForCausalLM.from_pretrained(pub.location, attn_implementation="sinkflex")
    assert type(loaded).__name__ == "GptOssForCausalLM"
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    learner.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, learner.model(input_ids=ids).logits)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_published_files_have_the_mode_of_a_plain_open(tmp_path, umask):
    """Every file of a published version, model.safetensors included (safetensors 0.8 writes it
    through a 0600 temporary file), has the mode a file made with plain open() gets."""
    import os
    import stat

    old = os.umask(umask)
    try:
        learner = Learner(learner_config(tmp_path, TINY_LLAMA), metrics=False)
        pub = publish_policy(learner)
        plain = tmp_path / "plain.txt"
        with open(plain, "w") as fh:
            fh.write("x")
    finally:
        os.umask(old)
    want = stat.S_IMODE(plain.stat().st_mode)
    assert want == 0o666 & ~umask
    files = {p.relative_to(pub.location).as_posix(): stat.S_IMODE(p.stat().st_mode)
             for p in Path(pub.location).rglob("*") if p.is_file()}
    assert "model.safetensors" in files and "config.json" in files
    assert files == {name: want for name in files}, {name: oct(m) for name, m in files.items()}
    assert not [p.name for p in Path(pub.location).iterdir() if p.name.startswith(".mode-probe")]


@pytest.mark.parametrize("arch", [TINY_GPT_OSS, TINY_LLAMA], ids=["gpt_oss", "llama"])
def test_packed_rows_equal_padded_rows(tmp_path, arch):
    # Rollouts of 8..20 tokens packed into rows of ≤ 24 positions (several per row, position
    # ids restarting, document mask) train exactly like one padded rollout per row.
    from learner_service.batch import pack, rollouts_from_group

    groups = [make_group("a", [0.0, 1.0, 0.3, 0.7, 0.2], seed=4), make_group("b", [1.0, 0.0, 0.5], seed=5)]
    rollouts = [r for g in groups for r in rollouts_from_group(g)[0]]
    packed = pack(rollouts, list(range(len(rollouts))), row_tokens=24)
    assert packed.input_ids_BT.shape[0] < len(rollouts) and packed.input_ids_BT.shape[1] <= 24
    assert sorted(i for i, _, _ in packed.segments) == list(range(len(rollouts)))
    out = []
    for pack_tokens in (None, 24):
        cfg = learner_config(tmp_path / str(pack_tokens), arch, optim=LINEAR_ADAM,
                             batch=dict(micro_batch_size=8, pack_tokens=pack_tokens), grpo=dict(beta=0.1, old_logprobs="recompute"))
        learner = Learner(cfg, metrics=False)
        m = learner.train_step(groups)
        out.append((_weights(learner), m))
    (w0, m0), (w1, m1) = out
    for name in ("loss", "kl", "entropy", "optimised_tokens"):
        assert m1[name] == pytest.approx(m0[name], rel=1e-5, abs=1e-7), name
    for k in w0:
        torch.testing.assert_close(w1[k], w0[k], rtol=1e-5, atol=1e-6)
