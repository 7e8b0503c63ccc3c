"""The short version of the fault-injection run (benchmarks/faults.py, docs/reliability.md "Faults"):
SIGKILL the reward service of a tiny `sinkflex-rl train` after its first step. The run must
stop with one line naming the reward service and its pid (exit 3, no traceback), the same
command must resume and finish, and no group may be lost or trained twice; the policy version,
its published folder and the last checkpoint agree."""

from __future__ import annotations

import pytest

from benchmarks.faults import run_fault

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000)]


def test_sigkill_reward_service_then_resume(tmp_path, smollm2_dir):
    row = run_fault("reward", "SIGKILL", tmp_path, str(smollm2_dir), steps=3, step_timeout=1200, run_timeout=1200)
    assert row["outcome"].startswith("stopped (exit 3)"), row
    assert row.get("named") is True, row
    assert row.get("stop_set_aside") is True, row  # stopped.json renamed to stopped-<time>.json by the re-run
    assert "re-run resumed and finished" in row["outcome"], row
    assert row["groups_lost"] == 0 and row["groups_trained_twice"] == 0, row
    assert row["consistent"] is True, row
