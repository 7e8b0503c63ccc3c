"""The short version of the fault-injection run (benchmarks/faults.py, docs/reliability.md "Faults"):
SIGKILL the reward service of a tiny `sinkflex-rl train` while a step's rollouts are in flight.
The launcher must restart it and the run go on by itself (one in-run recovery, no re-run), finish,
and lose no group nor train one twice; the policy version, its published folder and the last
checkpoint agree."""

from __future__ import annotations

import pytest

from benchmarks.faults import run_campaign

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000)]


def test_sigkill_reward_service_mid_rollout_recovers_in_run(tmp_path, smollm2_dir):
    (row,) = run_campaign("reward-kill", [("reward", "SIGKILL", "mid-rollout")], tmp_path, str(smollm2_dir),
                          moment_timeout=1200, recover_timeout=600, run_timeout=1200)
    assert row["recovered_in_run"] is True, row
    assert row["evidence"].startswith("rollout service:") and "in flight" in row["evidence"], row
    assert any(f"reward service (pid {row['pid']})" in note and "restarted" in note for note in row["restarted"]), row
    assert row["groups_lost"] == 0 and row["groups_trained_twice"] == 0, row
    assert row["consistent"] is True, row
    assert "TRACEBACK" not in row["outcome"], row
