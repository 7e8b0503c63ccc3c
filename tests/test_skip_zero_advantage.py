"""grpo.skip_zero_advantage: rollouts with Â = 0 are not run through the training forward/backward
when β = 0, and the step is exactly the full step (tiny Llama, float64, CPU).

A rollout with Â = 0 contributes −min(ρ·0, clip(ρ)·0) = 0 to eq. (6) at every token whatever ρ,
so its gradient is exactly 0; its tokens stay in the normaliser N = Σ_i T_i. In float64 the
weights after AdamW steps with and without the skip agree to rounding (≤ 1e-12), including a
step whose every rollout has Â = 0 (AdamW still moves the weights by its momentum, as the full
step does).
"""

from __future__ import annotations

import pytest

from learner_service.trainer import Learner
from tests.fixtures.learner import TINY_LLAMA, learner_config, make_group

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _steps():
    return [
        [  # group a: no zero advantage; group b: its 0.5 is the group mean (Â = 0); group c: zero variance
            make_group("a", [0.0, 1.0, 0.3, 0.7], seed=4, prompt_len=9, lengths=[14, 20, 12, 17]),
            make_group("b", [1.0, 0.0, 0.5], seed=5, prompt_len=9, lengths=[15, 11, 10]),
            make_group("c", [1.0, 1.0, 1.0], seed=6, prompt_len=9, lengths=[13, 16, 12]),
        ],
        [make_group("d", [0.0, 0.0], seed=7, prompt_len=9, lengths=[12, 14])],  # every Â = 0
    ]


def _run(tmp_path, name, skip, beta=0.0):
    cfg = learner_config(
        tmp_path / name, TINY_LLAMA,
        model=dict(arch=TINY_LLAMA, attn_implementation="sinkflex", seed=0, dtype="float64"),
        optim=dict(lr=1e-2, eps=1e-8, max_grad_norm=None),
        batch=dict(shared_prefix_min_tokens=1, micro_batch_size=4),
        grpo=dict(skip_zero_advantage=skip, beta=beta),
    )
    learner = Learner(cfg, metrics=False)
    weights = [{k: v.detach().clone() for k, v in learner.model.state_dict().items()}]
    metrics = []
    for groups in _steps():
        metrics.append(learner.train_step(groups))
        weights.append({k: v.detach().clone() for k, v in learner.model.state_dict().items()})
    return metrics, weights


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_skipping_zero_advantage_rollouts_is_exact(tmp_path, float64_norms):
    (full1, full2), w_full = _run(tmp_path, "full", skip=False)
    (skip1, skip2), w_skip = _run(tmp_path, "skip", skip=True)
    assert full1["skipped_rollouts"] == 0 and full2["skipped_rollouts"] == 0
    assert skip1["skipped_rollouts"] == 4 and skip2["skipped_rollouts"] == 2  # b's 0.5, all of c; all of d
    assert skip1["positions_trained"] + skip1["skipped_positions"] == full1["positions_trained"]
    assert skip1["skipped_tokens"] > 0 and skip1["optimised_tokens"] == full1["optimised_tokens"]
    for key in ("loss", "pg_loss", "clip_fraction"):
        assert abs(skip1[key] - full1[key]) <= 1e-12, key
    assert skip2["loss"] == 0.0 and skip2["grad_norm"] == 0.0 == full2["grad_norm"]
    assert skip2["policy_version"] == full2["policy_version"] == 2
    assert _max_diff(w_full[0], w_skip[0]) == 0.0  # same initial weights
    for step in (1, 2):
        assert _max_diff(w_full[step], w_skip[step]) <= 1e-12, step
    # the all-zero-advantage step moved the weights (AdamW's momentum), and the skip did the same
    assert _max_diff(w_skip[1], w_skip[2]) > 1e-4


def test_skip_is_off_with_a_kl_term(tmp_path, float64_norms):
    (m1, _), _ = _run(tmp_path, "kl", skip=True, beta=0.1)
    assert m1["skipped_rollouts"] == 0 and m1["kl"] > 0


def test_benchmark_workload_is_demo_shaped():
    """benchmarks/bench_learner_step.py's step: 10 groups × 8, a common 830-token prompt, 4 groups
    at zero variance (32 rollouts with Â = 0), suffixes of 125–205 tokens (the timed runs: docs/)."""
    import importlib.util
    from pathlib import Path

    from learner_service.batch import common_prefix_len, rollouts_from_group

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_learner_step.py"
    spec = importlib.util.spec_from_file_location("bench_learner_step", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    groups = bench.demo_groups("t", 10)
    rollouts = [r for g in groups for r in rollouts_from_group(g)[0]]
    assert len(rollouts) == 80 and common_prefix_len(rollouts, list(range(80))) == 830
    assert sum(r.advantage == 0.0 for r in rollouts) == 32
    assert all(855 + 100 <= len(t.token_ids) < 855 + 180 for g in groups for t in g.trajectories)
    assert bench.demo_groups("u", 10)[3].trajectories[2].token_ids == groups[3].trajectories[2].token_ids
