"""The launcher names a dead or frozen process in one line (sinkflex_rl/launcher.py), and a restarted
consumer takes back the groups delivered to its previous incarnation (sinkflex/buffer/stream.py)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from sinkflex_rl.launcher import (
    LocalLauncher,
    ManagedProcess,
    ServiceDied,
    ServiceRestarted,
    restart_delay_s,
    run_recovering,
)

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

    me = types.SimpleNamespace(totals={}, SCORE_ATTEMPTS=4, SCORE_RETRY_WAIT_S=0.0)
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
    """A dead service with restarts left: check_alive raises ServiceRestarted (the controller unwinds),
    recover starts it again (same argv) after its backoff; out of restarts, its death is ServiceDied
    naming it and how often it was restarted."""
    with LocalLauncher(tmp_path) as launcher:
        (reward,) = launcher.start_all([ManagedProcess("reward", SLEEP, max_restarts=1, ready_timeout_s=30)])
        first = reward.proc.pid
        os.kill(first, signal.SIGKILL)
        reward.proc.wait()
        with pytest.raises(ServiceRestarted, match=f"reward service \\(pid {first}\\) died .*; restarting it$"):
            launcher.check_alive()
        notes = launcher.recover()
        assert reward.proc.pid != first and reward.proc.poll() is None
        assert json.loads((tmp_path / "pids.json").read_text())["reward"] == reward.proc.pid
        assert len(notes) == 1 and notes == launcher.restart_log
        assert notes[0].startswith(f"reward service (pid {first}) died (exit -9, signal SIGKILL)")
        assert notes[0].endswith("restarted (reward service restart 1, after 1s)")
        assert len(launcher.processes) == 1
        launcher.check_alive()
        assert launcher.recover() == []  # nothing dead: nothing restarted
        os.kill(reward.proc.pid, signal.SIGKILL)
        reward.proc.wait()
        with pytest.raises(ServiceDied, match=f"reward service \\(pid {reward.proc.pid}\\) died .*restarted 1 time "
                                              "already \\(local.max_restarts\\); re-run the same command to resume$"):
            launcher.check_alive()
        with pytest.raises(ServiceDied, match="restarted 1 time already"):
            launcher.recover()


def test_a_restart_kills_what_the_dead_leader_left_in_its_group(tmp_path):
    """A SIGKILLed vLLM server leaves its engine process running in its process group (found by
    benchmarks/faults.py: 2.6 GiB per killed user simulator, still running after the run). The restart
    SIGKILLs what is left of the old group before starting the process again."""
    child_file = tmp_path / "child.pid"
    leader = [sys.executable, "-c", "import subprocess, sys, time; "
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
              f"open({str(child_file)!r}, 'w').write(str(c.pid)); time.sleep(300)"]
    with LocalLauncher(tmp_path) as launcher:
        (user_sim,) = launcher.start_all([ManagedProcess("user_sim", leader, max_restarts=1, ready_timeout_s=30)])
        deadline = time.monotonic() + 30
        while not (child_file.exists() and child_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(child_file.read_text())
        assert os.getpgid(child) == user_sim.proc.pid  # in the leader's group
        first = user_sim.proc.pid
        os.kill(first, signal.SIGKILL)
        user_sim.proc.wait()
        os.kill(child, 0)  # the child outlived its leader
        child_file.unlink()
        with pytest.raises(ServiceRestarted):
            launcher.check_alive()
        launcher.recover()
        assert user_sim.proc.pid != first and user_sim.proc.poll() is None
        gone = time.monotonic() + 5
        while time.monotonic() < gone:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        with pytest.raises(ProcessLookupError):
            os.kill(child, 0)


def test_restart_backoff_doubles_up_to_its_cap():
    assert [restart_delay_s(n) for n in range(7)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_a_frozen_process_is_killed_and_restarted(tmp_path):
    """SIGSTOP past the freeze timeout: like a failed liveness probe, SIGKILL and start again."""
    import psutil

    with LocalLauncher(tmp_path, freeze_timeout_s=0.3) as launcher:
        (env,) = launcher.start_all([ManagedProcess("env", SLEEP, max_restarts=2, ready_timeout_s=30)])
        first = env.proc.pid
        os.kill(first, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while psutil.Process(first).status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
            time.sleep(0.05)
        launcher.check_alive()  # stopped, not yet past the freeze timeout
        time.sleep(0.5)
        with pytest.raises(ServiceRestarted, match=f"env service \\(pid {first}\\) is frozen"):
            launcher.check_alive()
        (note,) = launcher.recover()
        assert "is frozen" in note and env.proc.pid != first and env.proc.poll() is None
        assert not psutil.pid_exists(first) or psutil.Process(first).status() == psutil.STATUS_ZOMBIE


def test_a_dead_watched_child_restarts_its_parent_and_a_restart_function_restarts_redis(tmp_path):
    """A dead vLLM engine (a watched child of the rollout service) restarts the rollout service; a
    watched process with a restart function (the embedded Redis) is started again by it."""
    import subprocess

    with LocalLauncher(tmp_path) as launcher:
        launcher.CHILD_EXIT_SETTLE_S = 1.0
        pid_file = tmp_path / "child.pid"
        (rollout,) = launcher.start_all([ManagedProcess("rollout", PARENT + [str(pid_file)], max_restarts=1, ready_timeout_s=30)])
        deadline = time.monotonic() + 20
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        child, first = int(pid_file.read_text()), rollout.proc.pid
        launcher.watch("engine", child)
        launcher.watched_parent[child] = first
        fakes = [subprocess.Popen(SLEEP)]

        def restart_redis() -> int:
            fakes.append(subprocess.Popen(SLEEP))
            return fakes[-1].pid

        try:
            launcher.watch("redis", fakes[0].pid, restart=restart_redis, max_restarts=1)
            os.kill(child, signal.SIGKILL)
            os.kill(fakes[0].pid, signal.SIGKILL)
            fakes[0].wait()
            with pytest.raises(ServiceRestarted):
                launcher.check_alive()
            notes = launcher.recover(settle_s=1.0)
            assert len(notes) == 2 and sorted(n.split(" ")[0] for n in notes) == ["embedded", "vLLM"], notes
            assert rollout.proc.pid != first and rollout.proc.poll() is None
            assert launcher.watched["redis"] == fakes[1].pid and "engine" not in launcher.watched
            assert json.loads((tmp_path / "pids.json").read_text())["redis"] == fakes[1].pid
        finally:
            for f in fakes:
                f.kill()
                f.wait()


class _FlakyController:
    """A controller whose first run is cut off by a restart (the learner's liveness check)."""

    def __init__(self, launcher):
        self.launcher, self.runs, self.reconnected, self._in_flight, self.groups_retried = launcher, 0, [], 2, 0
        self.clients = type("C", (), {"close": lambda self: None})()

    def run(self) -> int:
        self.runs += 1
        if self.runs == 1:
            self.launcher.check_alive()
        return 7

    def abandon_in_flight(self) -> int:
        n, self._in_flight = self._in_flight, 0
        self.groups_retried += n
        return n

    def reconnect(self, clients) -> None:
        self.reconnected.append(clients)


def test_run_recovering_restarts_and_runs_again(tmp_path):
    with LocalLauncher(tmp_path) as launcher:
        (env,) = launcher.start_all([ManagedProcess("env", SLEEP, max_restarts=1, ready_timeout_s=30)])
        os.kill(env.proc.pid, signal.SIGKILL)
        env.proc.wait()
        controller = _FlakyController(launcher)
        assert run_recovering(controller, launcher, lambda: "fresh clients") == 7
        assert controller.runs == 2 and controller.reconnected == ["fresh clients"] and controller.groups_retried == 2
        (record,) = [json.loads(x) for x in (tmp_path / "recoveries.jsonl").read_text().splitlines()]
        assert record["error"].startswith("ServiceRestarted: env service") and record["groups_retried"] == 2
        assert len(record["restarted"]) == 1 and "restarted (env service restart 1" in record["restarted"][0]


def test_run_recovering_raises_what_no_restart_heals(tmp_path):
    class Broken(_FlakyController):
        def run(self) -> int:
            raise ValueError("a bug, not a fault")

    with LocalLauncher(tmp_path) as launcher:
        launcher.start_all([ManagedProcess("env", SLEEP, max_restarts=1, ready_timeout_s=30)])
        with pytest.raises(ValueError, match="a bug"):
            run_recovering(Broken(launcher), launcher, lambda: None)
        assert not (tmp_path / "recoveries.jsonl").exists()


def test_restart_config_defaults_on():
    from sinkflex_rl.config import LocalConfig

    assert LocalConfig().restart_services == ["env", "reward", "rollout", "learner", "user_sim", "redis"]
    assert LocalConfig().max_restarts == 3
    with pytest.raises(Exception):
        LocalConfig(restart_services=["driver"])


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


def test_embedded_redis_keeps_every_answered_write_across_a_sigkill(tmp_path):
    """PERSISTENCE["kill"]: every write Redis answered survives a SIGKILL of redis-server; the restart
    (`restart_embedded_redis`) keeps the URL (same socket) and replays the AOF: stream entries, the
    consumer group's pending entries and the trained-id set are all there. PERSISTENCE["power_loss"]
    rests on `appendfsync always` (fsync before the reply), checked on the running server."""
    import dataclasses

    import psutil
    import redis

    from sinkflex.api.common.v1 import common_pb2
    from sinkflex.buffer import TrajectoryBuffer
    from sinkflex.buffer.embedded import (
        PERSISTENCE,
        embedded_redis_pid,
        embedded_redis_url,
        restart_embedded_redis,
    )

    url = embedded_redis_url(path=str(tmp_path / "redis" / "buffer.db"))
    with redis.Redis.from_url(url) as r:
        assert r.config_get("appendonly")["appendonly"] == "yes"
        assert r.config_get("appendfsync")["appendfsync"] == "always"
    buf = TrajectoryBuffer(url=url, stream="persist")
    ids = [f"p{i}" for i in range(20)]
    for gid in ids:
        group = common_pb2.TrajectoryGroup(group_id=gid, task_id="t", env="mock")
        group.trajectories.add(token_ids=[1, 2], loss_mask=[0, 1], logprobs=[0.0, -1.0], reward=1.0)
        buf.put(group)
    got = buf.read("learner-0", count=3, block_ms=100)
    buf.ack(got[:1])  # one trained and acknowledged, two delivered and pending
    before = buf.stats()
    pid = embedded_redis_pid(url)
    os.kill(pid, signal.SIGKILL)  # answered writes go to the AOF before the reply: none is lost
    psutil.Process(pid).wait(timeout=10) if psutil.pid_exists(pid) else None
    new_pid = restart_embedded_redis(url)
    assert new_pid != pid and embedded_redis_pid(url) == new_pid
    after = TrajectoryBuffer(url=url, stream="persist")
    data = ("stream_length", "unconsumed", "pending", "undelivered", "consumers", "trained", "dead_letters", "added")
    kept = lambda st: {k: v for k, v in dataclasses.asdict(st).items() if k in data}  # noqa: E731 - not ages, not memory
    assert kept(after.stats()) == kept(before) and before.pending == 2 and before.unconsumed == 19
    pending = after.read("learner-0", count=10, block_ms=100)  # the pending two come back first
    assert [e.group.group_id for e in pending][:2] == ids[1:3]
    assert set(PERSISTENCE) == {"kill", "power_loss"}
    buf.close()
    after.close()


def test_run_recovering_waits_for_services_that_run_elsewhere(tmp_path, monkeypatch):
    """Nothing launched here (compose, a cluster): a call that failed UNAVAILABLE is a peer restarting;
    once every service is SERVING again the run is taken up again. A real env server on loopback."""
    import grpc

    from sinkflex.errors import ServiceError
    from sinkflex_rl.clients import Addresses
    from sinkflex_rl.launcher import peers_serving

    class Unavailable(_FlakyController):
        def run(self) -> int:
            self.runs += 1
            if self.runs == 1:
                raise ServiceError(grpc.StatusCode.UNAVAILABLE, "connection refused")
            return 4

    import sinkflex_rl.launcher
    from sinkflex_rl.launcher import free_port

    monkeypatch.setattr(sinkflex_rl.launcher, "RECOVER_SETTLE_S", 0.5)
    port = free_port()
    with LocalLauncher(tmp_path) as servers:
        servers.start_all([ManagedProcess("env", [sys.executable, "-m", "env_service", "--domains", "mock", "--port", str(port),
                                                  "--no-metrics"], health="grpc:sinkflex.api.env.v1.EnvService",
                                          address=f"127.0.0.1:{port}")], ready_timeout=120)
        addresses = Addresses(env=f"127.0.0.1:{port}", reward="", rollout="", learner="")
        assert peers_serving(addresses, timeout_s=10)
        launcher = LocalLauncher(tmp_path / "driver")  # launches nothing
        controller = Unavailable(launcher)
        assert run_recovering(controller, launcher, lambda: "fresh", wait_for_peers=lambda: peers_serving(addresses)) == 4
        assert controller.reconnected == ["fresh"]
        (record,) = [json.loads(x) for x in (tmp_path / "driver" / "recoveries.jsonl").read_text().splitlines()]
        assert "UNAVAILABLE" in record["restarted"][0]
        with pytest.raises(ServiceError):  # nobody comes back: the error stands
            run_recovering(Unavailable(launcher), launcher, lambda: "fresh", wait_for_peers=lambda: False)
    assert not peers_serving(addresses, timeout_s=1)


DRIVER = """
import sys, time
from pathlib import Path
from sinkflex_rl.launcher import LocalLauncher, ManagedProcess
run_dir = Path(sys.argv[1])
with LocalLauncher(run_dir) as launcher:
    (service,) = launcher.start_all([ManagedProcess("env", [sys.executable, "-c", "import time; time.sleep(120)"])])
    (run_dir / "service.pid").write_text(str(service.proc.pid))
    time.sleep(120)
"""


def test_sigterm_to_the_driver_stops_its_services(tmp_path):
    """kill, docker stop and timeout send SIGTERM: the launcher stops every service as on Ctrl-C
    (Python's default would end the driver at once and leave them running), and the driver exits."""
    import subprocess

    import psutil

    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path)], stderr=subprocess.PIPE)
    pid_file = tmp_path / "service.pid"
    deadline = time.monotonic() + 60
    while not pid_file.is_file() and time.monotonic() < deadline and driver.poll() is None:
        time.sleep(0.1)
    assert pid_file.is_file(), driver.stderr.read().decode()
    service = psutil.Process(int(pid_file.read_text()))
    assert service.is_running()
    driver.send_signal(signal.SIGTERM)
    assert driver.wait(timeout=60) != 0
    assert b"KeyboardInterrupt: signal 15" in driver.stderr.read()
    service.wait(timeout=30)  # psutil.TimeoutExpired if it outlived the driver
    assert not service.is_running()
