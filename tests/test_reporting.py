"""Validation statistics, metric files and learning-curve plots."""

import json
import math

import pytest

from sinkflex.reporting import MetricsWriter, mean_ci, pass_hat_k, plot_learning_curves, read_metrics, summary_table


def test_pass_hat_k_matches_tau_bench_definition():
    # task a: 2 of 4 trials succeed -> pass^1 = 0.5, pass^2 = C(2,2)/C(4,2) = 1/6
    # task b: 4 of 4 -> 1.0 for every k
    trials = {"a": [True, False, True, False], "b": [True] * 4}
    assert pass_hat_k(trials, 1) == pytest.approx((0.5 + 1.0) / 2)
    assert pass_hat_k(trials, 2) == pytest.approx((1 / 6 + 1.0) / 2)
    assert pass_hat_k(trials, 4) == pytest.approx((0.0 + 1.0) / 2)
    with pytest.raises(ValueError, match="at least 5 trials"):
        pass_hat_k(trials, 5)


def test_mean_ci():
    m, lo, hi = mean_ci([0.0, 1.0, 1.0, 0.0])
    assert m == 0.5
    # t(0.975, 3) = 3.182446; sem = 0.5 / sqrt(4) * sqrt(4/3) = 0.288675
    assert hi - m == pytest.approx(3.182446 * 0.288675, rel=1e-5)
    assert m - lo == pytest.approx(hi - m)
    assert mean_ci([0.25]) == (0.25, 0.25, 0.25)
    assert mean_ci([1.0, 1.0]) == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError):
        mean_ci([])


def test_metrics_jsonl_plots_and_summary(tmp_path):
    w = MetricsWriter(tmp_path)
    for step in range(3):
        w.write("train", step, {"reward_mean": 0.1 * step, "reward_std": 0.05, "loss": 1.0 / (step + 1), "groups": 2})
        w.write("trajectory", step, {"reward": 0.0})
    w.write("val", 2, {"mean_at_1": 0.5, "ci_low": 0.2, "ci_high": 0.8})
    w.close()
    records = read_metrics(tmp_path)
    assert [r["kind"] for r in records].count("train") == 3
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["reward_mean"] == 0.0
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())
    pngs = plot_learning_curves(records, tmp_path / "plots")
    assert {p.name for p in pngs} == {"training_score.png", "trajectory_reward.png", "validation.png"}
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    table = summary_table(records)
    assert table.row_count == 3
    assert not math.isnan(records[-1]["mean_at_1"])
