"""Validation statistics, metric files and learning-curve plots."""

import json
import math

import pytest

from sinkflex.reporting import (
    MetricsWriter,
    mean_ci,
    paired_ci,
    pass_hat_k,
    plot_learning_curves,
    rate_ci,
    read_metrics,
    reward_interval,
    rl_step_of,
    summary_table,
)


def test_pass_hat_k_matches_tau_bench_definition():
    # task a: 2 of 4 trials succeed -> pass^1 = 0.5, pass^2 = C(2,2)/C(4,2) = 1/6
    # task b: 4 of 4 -> 1.0 for every k
    trials = {"a": [True, False, True, False], "b": [True] * 4}
    assert pass_hat_k(trials, 1) == pytest.approx((0.5 + 1.0) / 2)
    assert pass_hat_k(trials, 2) == pytest.approx((1 / 6 + 1.0) / 2)
    assert pass_hat_k(trials, 4) == pytest.approx((0.0 + 1.0) / 2)
    with pytest.raises(ValueError, match="at least 5 trials"):
        pass_hat_k(trials, 5)


def test_pass_hat_k_equals_tau2_compute_metrics_on_a_results_file():
    """Ours against τ²-Bench's own pipeline: a `Results` of seeded rewards on generated mock tasks,
    scored by `tau2.metrics.agent_metrics.compute_metrics` (its success rule, its per-task
    pass^k, its mean over tasks)."""
    import random

    from tau2.data_model.simulation import AgentInfo, Info, Results, RewardInfo, SimulationRun, TerminationReason, UserInfo
    from tau2.environment.environment import EnvironmentInfo
    from tau2.metrics.agent_metrics import compute_metrics, is_successful

    from tau2_adapter.generate import generate_mock_tasks

    tasks = list(generate_mock_tasks(train=7, test=0, seed=0).tasks.values())
    trials, rng = 4, random.Random(0)
    rewards = {t.id: [rng.choice([0.0, 0.5, 1.0, 1.0, 1.0 - 1e-7]) for _ in range(trials)] for t in tasks}
    rewards[tasks[0].id] = [1.0] * trials  # every k: 1
    rewards[tasks[1].id] = [0.0] * trials  # every k: 0
    sims = [SimulationRun(id=f"{task_id}-{i}", task_id=task_id, trial=i, start_time="t0", end_time="t1", duration=0.0,
                          termination_reason=TerminationReason.AGENT_STOP, reward_info=RewardInfo(reward=r), messages=[],
                          agent_cost=0.0, user_cost=0.0)
            for task_id, rs in rewards.items() for i, r in enumerate(rs)]
    info = Info(git_commit="-", num_trials=trials, max_steps=30, max_errors=10, user_info=UserInfo(implementation="none"),
                agent_info=AgentInfo(implementation="none"), environment_info=EnvironmentInfo(domain_name="mock", policy=""))
    theirs = compute_metrics(Results(info=info, tasks=tasks, simulations=sims)).pass_hat_ks
    ours = {k: pass_hat_k({t: [is_successful(r) for r in rs] for t, rs in rewards.items()}, k) for k in range(1, trials + 1)}
    assert sorted(theirs) == [1, 2, 3, 4]
    assert ours == pytest.approx(theirs, abs=1e-12)
    assert 0.0 < ours[4] < ours[1] < 1.0  # the seeded outcomes are mixed, so the comparison means something


def test_pass_hat_k_is_tau2s_per_task_estimate_averaged():
    from tau2.metrics.agent_metrics import pass_hat_k as tau2_pass_hat_k

    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                outcomes = {"t": [True] * c + [False] * (n - c), "all": [True] * n}
                assert pass_hat_k(outcomes, k) == (tau2_pass_hat_k(n, c, k) + 1.0) / 2


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


def test_paired_ci_is_the_paired_t_interval():
    after, before = [1.0, 0.5, 1.0, 0.0, 1.0], [0.0, 0.5, 0.5, 0.0, 0.0]
    m, lo, hi = paired_ci(after, before)
    diffs = [a - b for a, b in zip(after, before)]
    assert m == pytest.approx(sum(diffs) / 5)
    assert (lo, hi) == pytest.approx(mean_ci(diffs)[1:])  # the paired t interval is the one-sample interval of the differences
    # t(0.975, 4) = 2.776445; sd of the differences 0.5 -> half width 2.776445 * 0.5 / sqrt(5)
    assert hi - m == pytest.approx(2.776445 * 0.5 / 5 ** 0.5, rel=1e-5)
    assert paired_ci([1.0, 0.5], [0.5, 0.0]) == (0.5, 0.5, 0.5)
    with pytest.raises(ValueError, match="pairs"):
        paired_ci([1.0], [1.0, 0.0])


def test_rate_ci_is_wilson_and_stays_in_0_1():
    rate, lo, hi = rate_ci(3, 10)
    # Wilson: (p + z²/2n ± z·sqrt(p(1−p)/n + z²/4n²)) / (1 + z²/n), z = 1.959964
    z, n, p = 1.959964, 10, 0.3
    centre, half = (p + z * z / (2 * n)) / (1 + z * z / n), z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
    assert (rate, lo, hi) == pytest.approx((0.3, centre - half, centre + half), rel=1e-5)
    assert rate_ci(0, 8)[1] == 0.0 and rate_ci(8, 8)[2] == 1.0
    # 0/1 rewards: Wilson inside [0, 1], where mean ± std ran past both ends
    assert reward_interval([0.0] * 15 + [1.0])[1] >= 0.0 and reward_interval([1.0] * 15 + [0.0])[2] <= 1.0
    m, lo, hi = reward_interval([0.0, 0.5, 1.0, 0.0])  # not 0/1: the t interval, clipped
    assert m == 0.375 and lo == 0.0 and hi <= 1.0


def test_validations_sit_on_the_rl_step():
    """Warm start: v0 is the base model (step −1), v1 the warm start (step 0), v(s + 1) step s."""
    assert rl_step_of({"policy_version": 0, "rl_step": -1}, 1) == -1
    assert rl_step_of({"policy_version": 5}, 1) == 4  # a record written before rl_step existed
    assert rl_step_of({"step": 3}, 0) == 3


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
    validations = [{"after": "step 2", "policy_version": 2, "per_purpose": {
        "Create a task.": {"tasks": 2, "mean_at_1": 0.5, "ci_low": 0.0, "ci_high": 1.0}}}]
    pngs = plot_learning_curves(records, tmp_path / "plots", validations)
    assert {p.name for p in pngs} == {"training_score.png", "trajectory_reward.png", "validation.png",
                                      "validation_families.png", "learner.png"}
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    table = summary_table(records)
    assert table.row_count == 3
    assert not math.isnan(records[-1]["mean_at_1"])


def test_metrics_keep_ints_as_ints(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=False)
    w.write("val", 3, {"policy_version": 4, "tasks": 64, "mean_at_1": 0.5, "ci_low": 1})
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert '"policy_version": 4,' in line and '"tasks": 64,' in line and '"ci_low": 1}' in line
    record = json.loads(line)
    assert type(record["policy_version"]) is int and type(record["mean_at_1"]) is float and record["step"] == 3


def test_summary_table_puts_each_validation_on_the_step_that_produced_its_version():
    """Warm start = v1, RL step s produces v(s + 1): the warm start's validation is its own row
    (before the steps), step 4's is on the row of step 4, step 8's on step 8's (it used to
    land on step 5's row and drop off the end: validations were keyed by version, rows by step)."""
    from rich.console import Console

    records = [dict(kind="val", step=0, policy_version=0, mean_at_1=0.0, ci_low=0.0, ci_high=0.0),
               dict(kind="val", step=1, policy_version=1, mean_at_1=0.25, ci_low=0.17, ci_high=0.33)]
    records += [dict(kind="train", step=s, policy_version=s + 1, reward_mean=0.5, loss=0.1, groups=10) for s in range(1, 9)]
    records += [dict(kind="val", step=5, policy_version=5, mean_at_1=0.414, ci_low=0.3, ci_high=0.5),
                dict(kind="val", step=9, policy_version=9, mean_at_1=0.547, ci_low=0.45, ci_high=0.65)]
    table = summary_table(records)
    assert table.row_count == 2 + 8
    console = Console(width=200, record=True)
    console.print(table)
    lines = [line for line in console.export_text().splitlines() if "│" in line]
    rows = {tuple(c.strip() for c in line.split("│")[1:3]): line for line in lines}
    assert "0.000 [0.000, 0.000]" in rows[("-", "0")] and "0.250 [0.170, 0.330]" in rows[("-", "1")]
    assert "0.414" in rows[("4", "5")] and "0.547" in rows[("8", "9")]
    assert "0.414" not in rows[("5", "6")] and "0.250" not in rows[("1", "2")]


def test_a_run_folder_with_records_cut_short_still_resumes_and_summarises(tmp_path, caplog):
    """Found by a bad-input pass over run folders: a metrics.jsonl line cut short (the driver or the
    learner killed mid-write, a full disk) made `read_metrics` raise, which the resume reads
    (`Controller`, recovered train records) and the summary too, so every later run of that folder
    ended in a traceback; the next record was even glued onto the cut line. Now the cut line is
    skipped with a warning, the writer starts a new line after it, and a validation file cut short
    is skipped the same way; a generate.json stamp cut short is a refusal naming it, not a traceback."""
    from sinkflex.reporting import MetricsWriter, read_metrics
    from sinkflex_rl.controller import read_validations, validation_dir

    w = MetricsWriter(tmp_path, tensorboard=False)
    w.write("train", 1, {"loss": 0.5})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 2, "lo')  # killed mid-write
    w.write("train", 2, {"loss": 0.25})  # the resumed run's next record
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write("[1, 2]\n\n")  # JSON, but not a record
    w.write("val", 2, {"mean_at_1": 0.5})
    with caplog.at_level("WARNING"):
        records = read_metrics(tmp_path)
    assert [(r["kind"], r["step"]) for r in records] == [("train", 1), ("train", 2), ("val", 2)]
    assert records[1]["loss"] == 0.25
    assert "skipped 2 line(s)" in caplog.text and "line 2, 4" in caplog.text

    vdir = validation_dir(tmp_path)
    vdir.mkdir()
    (vdir / "base.json").write_text(json.dumps({"after": "base", "policy_version": 0, "per_task": {}}))
    (vdir / "step_4.json").write_text('{"after": "step_4", "policy_ver')
    (vdir / "other.json").write_text("[]")
    assert [v["after"] for v in read_validations(tmp_path)] == ["base"]


def test_a_generate_stamp_cut_short_is_a_refusal_naming_it(tmp_path):
    from sinkflex.config import ConfigError
    from sinkflex_rl.config import TrainConfig
    from sinkflex_rl.local import prepare_task_files

    cfg = TrainConfig.model_validate({"run": {"output_dir": str(tmp_path)}, "task": {"env": "mock", "solo_mode": True,
                                      "generate": {"train": 4, "test": 2}}, "models": {"user_simulator": None}})
    prepare_task_files(cfg)
    assert prepare_task_files(cfg) == [str(tmp_path / "tasks")]  # a re-run reuses them
    (tmp_path / "tasks" / "generate.json").write_text('{"domain": "mo')
    with pytest.raises(ConfigError, match="holds tasks generated with an unreadable generate.json"):
        prepare_task_files(cfg)
