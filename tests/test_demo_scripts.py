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
