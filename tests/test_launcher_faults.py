"""The launcher names a dead or frozen process in one line (sinkflex_rl/launcher.py), and a restarted
consumer takes back the groups delivered to its previous incarnation (sinkflex/buffer/stream.py)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from sinkflex_rl.launcher import LocalLauncher, ManagedProcess, ServiceDied

SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


def test_dead_process_is_named_with_pid_and_signal(tmp_path):
    with LocalLauncher(tmp_path) as launcher:
        env, reward = launcher.start_all([ManagedProcess("env", SLEEP), ManagedProcess("reward", SLEEP)])
        launcher.check_alive()
        pids = json.loads((tmp_path / "pids.json").read_text())
        assert pids["env"] == env.proc.pid and pids["reward"] == reward.proc.pid and pids["driver"] == os.getpid()
        os.kill(reward.proc.pid, signal.SIGKILL)
        message = launcher.diagnose(settle_s=5.0)
        assert message is not None
        assert message.startswith(f"reward service (pid {reward.proc.pid}) died (exit -9, signal SIGKILL)")
        assert "OOM killer" in message  # a SIGKILL nobody in the run sent: say where to look
        assert message.endswith("re-run the same command to resume") and "\n" not in message
        with pytest.raises(ServiceDied, match="reward service"):
            launcher.check_alive()


def test_a_watched_zombie_is_named_with_how_it_ended(tmp_path):
    """A watched process that is not our child (a learner rank under torchrun) and became a
    zombie: the message reads its exit status from /proc/<pid>/stat (the walkthrough's OOM-killed
    rank was reported as only 'died (zombie)')."""
    import subprocess

    with LocalLauncher(tmp_path) as launcher:
        killed = subprocess.Popen(SLEEP)  # left unreaped below: a zombie, as under a busy torchrun
        exited = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
        try:
            launcher.watch("learner_rank_0", killed.pid)
            os.kill(killed.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while launcher.diagnose() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            message = launcher.diagnose()
            assert message.startswith(f"learner rank (pid {killed.pid}) died (zombie, signal SIGKILL: likely the "
                                      "kernel's OOM killer")
            assert message.endswith("re-run the same command to resume") and "\n" not in message
            launcher.watched.pop("learner_rank_0")
            launcher.watch("learner_rank_1", exited.pid)
            deadline = time.monotonic() + 10
            while launcher.diagnose() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert launcher.diagnose() == (f"learner rank (pid {exited.pid}) died (zombie, exit 3); "
                                           "re-run the same command to resume")
        finally:
            for proc in (killed, exited):
                proc.kill()
                proc.wait()


def test_watched_and_frozen_processes_are_named(tmp_path):
    with LocalLauncher(tmp_path, freeze_timeout_s=0.5) as launcher:
        (env,) = launcher.start_all([ManagedProcess("env", SLEEP)])
        import subprocess

        other = subprocess.Popen(SLEEP)  # e.g. the embedded Redis: not launched here, watched
        try:
            launcher.watch("redis", other.pid)
            assert json.loads((tmp_path / "pids.json").read_text())["redis"] == other.pid
            os.kill(env.proc.pid, signal.SIGSTOP)
            import psutil

            deadline = time.monotonic() + 10
            while psutil.Process(env.proc.pid).status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
                time.sleep(0.05)
            assert launcher.diagnose() is None  # stopped, not yet past the freeze timeout
            time.sleep(0.7)
            message = launcher.diagnose()
            assert message is not None and message.startswith(f"env service (pid {env.proc.pid}) is frozen")
            os.kill(env.proc.pid, signal.SIGCONT)
            assert launcher.diagnose() is None
            other.kill()
            other.wait()
            assert launcher.diagnose() == f"embedded Redis (pid {other.pid}) died; re-run the same command to resume"
        finally:
            other.kill()
            other.wait()
    assert env.proc.poll() is not None  # stop_all stopped it


#: a service with a child it does not reap (the vLLM engine of the rollout service): on SIGTERM it
#: kills the child, which stays a zombie, and exits 0 a moment later (a graceful stop)
PARENT = [sys.executable, "-c", """
import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(str(child.pid))
def stop(*_):
    os.kill(child.pid, signal.SIGKILL)
    time.sleep(1.0)
    os._exit(0)
signal.signal(signal.SIGTERM, stop)
time.sleep(120)
"""]


def test_a_service_that_stops_is_named_not_the_child_it_took_with_it(tmp_path):
    """SIGTERM to the rollout service: its engine dies first; the line names the service and its exit."""
    with LocalLauncher(tmp_path) as launcher:
        launcher.CHILD_EXIT_SETTLE_S = 10.0
        pid_file = tmp_path / "child.pid"
        (rollout,) = launcher.start_all([ManagedProcess("rollout", PARENT + [str(pid_file)])])
        deadline = time.monotonic() + 20
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(pid_file.read_text())
        launcher.watch("engine", child)
        assert launcher.diagnose() is None
        os.kill(rollout.proc.pid, signal.SIGTERM)
        time.sleep(0.3)  # the child is a zombie now, its parent still running
        message = launcher.diagnose(settle_s=5.0)
        assert message == (f"rollout service (pid {rollout.proc.pid}) exited (exit 0) and its child, the vLLM engine of "
                           f"the rollout service (pid {child}), with it (log: {tmp_path / 'logs' / 'rollout.log'}); "
                           "re-run the same command to resume")
        # reaped already (the service waited for its engine): the launcher's record of whose child it was
        launcher.watched_parent[child] = rollout.proc.pid
        assert launcher._exiting_parent(child + 10**6, "x") is None  # unknown pid: no parent to name
        launcher.watched_parent[child + 10**6] = rollout.proc.pid
        assert launcher._exiting_parent(child + 10**6, "x").startswith(f"rollout service (pid {rollout.proc.pid}) exited")


def test_restarted_consumer_takes_back_its_pending_groups():
    from sinkflex.api.common.v1 import common_pb2
    from sinkflex.buffer import TrajectoryBuffer, embedded_redis_url

    url = embedded_redis_url()
    stream = f"faults-{os.getpid()}-{time.monotonic_ns()}"
    first = TrajectoryBuffer(url=url, stream=stream)
    first.put(common_pb2.TrajectoryGroup(group_id="g1", task_id="t"))
    (entry,) = first.read("learner-0", count=1, block_ms=100)
    assert entry.group.group_id == "g1"  # delivered, then the consumer "dies" before its ack
    first.put(common_pb2.TrajectoryGroup(group_id="g2", task_id="t"))
    restarted = TrajectoryBuffer(url=url, stream=stream)  # claim_idle_ms (5 min) has not passed
    got = restarted.read("learner-0", count=1, block_ms=100)
    assert [e.group.group_id for e in got] == ["g1"]
    restarted.ack(got)
    assert [e.group.group_id for e in restarted.read("learner-0", count=1, block_ms=100)] == ["g2"]


def test_rollout_retries_a_restarting_reward_service():
    """ScoreBatch is idempotent: UNAVAILABLE (a reward service restarting) is asked again with backoff;
    a non-retryable error, or the last try's, propagates."""
    import asyncio
    import types

    import grpc

    from rollout_service.agent import AgentLoop
    from sinkflex.errors import ServiceError

    class Flaky:
        def __init__(self, fails, code=grpc.StatusCode.UNAVAILABLE):
            self.fails, self.code, self.calls = fails, code, 0

        def score_batch(self, reqs):
            self.calls += 1
            if self.calls <= self.fails:
                raise ServiceError(self.code, "connection refused")
            return ["ok"] * len(reqs)

    me = types.SimpleNamespace(totals={}, SCORE_RETRY_DELAYS_S=(0.0, 0.0, 0.0))
    retrying = AgentLoop._score_batch_retrying
    client = Flaky(2)
    assert asyncio.run(retrying(me, client, [1, 2])) == ["ok", "ok"] and client.calls == 3
    assert me.totals["reward_retries"] == 2
    with pytest.raises(ServiceError):
        asyncio.run(retrying(me, Flaky(9), [1]))
    bad = Flaky(1, grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(ServiceError):
        asyncio.run(retrying(me, bad, [1]))
    assert bad.calls == 1


def test_dead_service_with_restarts_left_is_restarted(tmp_path):
    """local.restart_services: a dead stateless service is started again (same argv) up to max_restarts
    times; then its death stops the run like any other."""
    with LocalLauncher(tmp_path) as launcher:
        (reward,) = launcher.start_all([ManagedProcess("reward", SLEEP, max_restarts=1, ready_timeout_s=30)])
        first = reward.proc.pid
        os.kill(first, signal.SIGKILL)
        reward.proc.wait()
        launcher.check_alive()  # restarted, not raised
        assert reward.proc.pid != first and reward.proc.poll() is None
        assert json.loads((tmp_path / "pids.json").read_text())["reward"] == reward.proc.pid
        assert launcher.restart_log == [f"reward service (pid {first}) died (exit -9, signal SIGKILL)"]
        assert len(launcher.processes) == 1
        os.kill(reward.proc.pid, signal.SIGKILL)
        reward.proc.wait()
        with pytest.raises(ServiceDied, match=f"reward service \\(pid {reward.proc.pid}\\) died"):
            launcher.check_alive()


def test_restart_config_defaults_off():
    from sinkflex_rl.config import LocalConfig

    assert LocalConfig().restart_services == [] and LocalConfig(restart_services=["reward"]).max_restarts == 2
    with pytest.raises(Exception):
        LocalConfig(restart_services=["learner"])


def test_a_process_starts_at_its_niceness(tmp_path):
    """ManagedProcess.nice is added to the child's niceness (the CPU engine's `ENGINE_NICE`)."""
    import os
    import sys
    import time

    from sinkflex_rl.launcher import LocalLauncher, ManagedProcess

    launcher = LocalLauncher(tmp_path)
    code = ("import os, time; g = open('/proc/self/autogroup').read().split()[-1] if os.path.exists('/proc/self/autogroup') "
            "else '7'; print(g, os.nice(0), flush=True); time.sleep(30)")
    spec = ManagedProcess("niced", [sys.executable, "-c", code], nice=7)
    launcher.start_all([spec], ready_timeout=10)
    try:
        deadline = time.monotonic() + 10
        while not spec.log_path.read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.1)
        group, own = spec.log_path.read_text().split()[-2:]
        assert int(own) == min(os.nice(0) + 7, 19)  # 19: the ceiling
        assert group == "7"  # its session's autogroup: what CFS shares the cores by
    finally:
        launcher.stop_all()
