"""`stopped.json`: a run that stops with an error (exit 3) writes it; the next run in the same
folder renames it to ``stopped-<UTC time of the stop>.json`` as it starts, so a run that
resumes and finishes does not leave a folder that claims it stopped (the stop's record is kept).

`sinkflex-rl train` runs here in-process against external service addresses with a fake
Controller (the first run's dies, the re-run's finishes): no service is started."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sinkflex_rl.cli import app
from sinkflex_rl.commands.train import set_aside_stopped

ROOT = Path(__file__).resolve().parent.parent
#: the demo against running services (none runs: the Controller is fake), so nothing is launched
SETS = ["services.env_address=127.0.0.1:1", "services.reward_address=127.0.0.1:2", "services.rollout_address=127.0.0.1:3",
        "services.learner_address=127.0.0.1:4", "warm_start.enabled=false", "task.generate=null",
        "task.task_ids=[create_task_1]"]
DIED = "reward service (pid 4242) died (exit -9, signal SIGKILL); re-run the same command to resume"


class _Metrics:
    def add_trackers(self, trackers):
        pass


def _fake_controller(outcomes: list):
    """A Controller whose run() raises (or returns) the next of `outcomes` on each construction."""

    class FakeController:
        groups_published = 0
        groups_retried = 0

        def __init__(self, cfg, clients, alive_check=None):
            self.outcome = outcomes.pop(0)
            self.metrics = _Metrics()

        def run(self):
            if isinstance(self.outcome, BaseException):
                raise self.outcome
            return self.outcome

        def close(self):
            pass

    return FakeController


@pytest.mark.filterwarnings("ignore:No artists with labels found")  # the plots of a run with no records
def test_a_resumed_run_that_finishes_sets_the_stop_aside(tmp_path, monkeypatch):
    import sinkflex_rl.clients
    import sinkflex_rl.controller
    from sinkflex_rl.launcher import ServiceDied

    monkeypatch.setattr(sinkflex_rl.clients, "connect", lambda addresses, reward=None: None)
    import sinkflex_rl.local

    monkeypatch.setattr(sinkflex_rl.local, "wait_for_running_services", lambda cfg: None)  # none runs: nothing to wait for
    monkeypatch.setattr(sinkflex_rl.controller, "Controller", _fake_controller([ServiceDied(DIED), 3]))
    run_dir = tmp_path / "run"
    args = ["train", "-c", str(ROOT / "configs" / "demo.yaml"), "--output-dir", str(run_dir)]
    for a in SETS:
        args += ["--set", a]

    first = CliRunner().invoke(app, args)
    assert first.exit_code == 3, first.output
    stop = json.loads((run_dir / "stopped.json").read_text())
    assert stop["message"] == DIED and stop["error"] == f"ServiceDied: {DIED}"
    assert not (run_dir / "summary.json").exists()

    second = CliRunner().invoke(app, args)
    assert second.exit_code == 0, second.output
    assert not (run_dir / "stopped.json").exists()
    kept = sorted(run_dir.glob("stopped-*.json"))
    assert [p.name for p in kept] == [time.strftime("stopped-%Y%m%dT%H%M%SZ.json", time.gmtime(stop["time"]))]
    assert json.loads(kept[0].read_text()) == stop
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] is False
    # both sessions counted: the stopped one and the resumed one (wall_seconds is the last alone)
    sessions = [json.loads(line) for line in (run_dir / "sessions.jsonl").read_text().splitlines()]
    assert [x["outcome"] for x in sessions] == ["stopped", "finished"] and summary["sessions"] == 2
    assert summary["wall_seconds_all_sessions"] == pytest.approx(sum(x["wall_seconds"] for x in sessions), abs=0.11)
    assert summary["wall_seconds_all_sessions"] >= summary["wall_seconds"]
    assert summary["groups_trained"] == 0  # the fake controller trained nothing


def test_set_aside_names_the_stop_time_and_keeps_earlier_stops(tmp_path):
    assert set_aside_stopped(tmp_path) is None and list(tmp_path.iterdir()) == []
    t = 1_780_000_000.5  # 2026-05-28T20:26:40Z
    body = json.dumps({"message": "m", "error": "e", "time": t})
    (tmp_path / "stopped.json").write_text(body)
    first = set_aside_stopped(tmp_path)
    assert first == tmp_path / "stopped-20260528T202640Z.json" and first.read_text() == body
    (tmp_path / "stopped.json").write_text(body)  # the same second again: not overwritten
    second = set_aside_stopped(tmp_path)
    assert second == tmp_path / "stopped-20260528T202640Z-1.json" and first.read_text() == second.read_text() == body
    assert not (tmp_path / "stopped.json").exists()


@pytest.mark.parametrize("body", ["not json", "[1, 2]", '{"message": "m"}', '{"time": "soon"}'])
def test_a_stopped_json_without_a_readable_time_is_named_by_its_mtime(tmp_path, body):
    path = tmp_path / "stopped.json"
    path.write_text(body)
    os.utime(path, (1_780_000_000, 1_780_000_000))
    out = set_aside_stopped(tmp_path)
    assert out == tmp_path / "stopped-20260528T202640Z.json" and out.read_text() == body


def test_sessions_accumulate_and_a_bad_line_is_skipped(tmp_path):
    from sinkflex_rl.commands.train import append_session

    start = time.time() - 10
    assert [x["outcome"] for x in append_session(tmp_path, start, "stopped")] == ["stopped"]
    with (tmp_path / "sessions.jsonl").open("a") as f:
        f.write("{not json\n[1]\n")
    sessions = append_session(tmp_path, start, "finished")
    assert [x["outcome"] for x in sessions] == ["stopped", "finished"]
    assert all(x["wall_seconds"] >= 10 for x in sessions)
