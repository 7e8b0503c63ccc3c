"""bin/demo-dual runs the user-simulator warm start as its child before it execs `sinkflex-rl
train`: a signal to the script (kill, docker stop and timeout send SIGTERM, a terminal SIGINT,
a closed terminal SIGHUP) stops that child too, and the script exits with the child's status."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _default_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def _is_warm_start(proc: psutil.Process) -> bool:
    try:
        return "sinkflex_rl.user_sim_warm_start" in proc.cmdline()
    except psutil.Error:  # bootstrap.sh's steps come and go
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_to_demo_dual_stops_its_user_simulator_warm_start(tmp_path, sig):
    env = {**os.environ, "OUT": str(tmp_path / "run")}
    # the signals as a terminal delivers them: a suite started in the background passes SIGINT down
    # as ignored, one under nohup SIGHUP, and bash cannot trap a signal ignored when it started
    log = tmp_path / "demo-dual.log"  # a file, not a pipe: a child that outlived the script would hold a pipe open
    with log.open("wb") as out:
        script = subprocess.Popen([str(ROOT / "bin" / "demo-dual")], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  preexec_fn=_default_signals)
    deadline = time.monotonic() + 120
    warm_start = None
    while warm_start is None and time.monotonic() < deadline and script.poll() is None:
        warm_start = next((p for p in psutil.Process(script.pid).children() if _is_warm_start(p)), None)
        time.sleep(0.1)
    assert warm_start is not None, f"no warm start under bin/demo-dual (exit {script.poll()})"
    script.send_signal(sig)
    try:
        assert script.wait(timeout=60) == 128 + signal.SIGTERM, log.read_text()[-2000:]
        warm_start.wait(timeout=30)  # psutil.TimeoutExpired if it outlived the script
    finally:
        if warm_start.is_running():
            warm_start.kill()
    assert not (tmp_path / "run" / "user-sim" / "user_sim_warm_start.json").exists()


@pytest.mark.parametrize("args, says", [
    (["--set", "run.steps=abc"], "run.steps: Input should be a valid integer"),
    (["--steps", "0"], "run.steps: Input should be greater than or equal to 1 (got 0)"),
    (["--set", "no_such_section.x=1"], "no_such_section: Extra inputs are not permitted"),
], ids=["set", "steps", "unknown"])
def test_demo_dual_refuses_a_bad_train_argument_before_its_user_simulator_warm_start(tmp_path, args, says):
    """The arguments bin/demo-dual passes to `sinkflex-rl train` are checked (`config show`, with
    train's --steps and --output-dir) before the minutes of the user-simulator warm start: exit 2,
    the field named, nothing written."""
    out = tmp_path / "run"
    r = subprocess.run([str(ROOT / "bin" / "demo-dual"), *args], cwd=ROOT, env={**os.environ, "OUT": str(out)},
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert says in r.stderr, r.stderr[-2000:]
    assert "warm start" not in r.stdout + r.stderr and not out.exists()


def test_demo_dual_refuses_an_output_folder_it_cannot_create(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = subprocess.run([str(ROOT / "bin" / "demo-dual")], cwd=ROOT, env={**os.environ, "OUT": str(blocker / "run")},
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2 and f"cannot create the output folder OUT={blocker / 'run'}" in r.stderr, r.stderr[-2000:]
