"""The local launcher: runs SinkFlex services as local processes on loopback ports.

The embedded default (one CPU machine, no network) starts each service with
`python -m <service> ...` in its own process group, waits until its `grpc.health.v1`
check reports SERVING (or an HTTP endpoint answers, for the user-simulator model
server), writes each process's output to `<run_dir>/logs/<name>.log`, and stops them
all in reverse start order — SIGTERM, then SIGKILL after a grace period — at exit, on an
error, on Ctrl-C, or when the command itself gets SIGTERM (kill, docker stop, timeout). With
addresses given in the config nothing is launched.

Like Kubernetes for the pods of a deployment, it restarts a process that died or stays
frozen (`LocalLauncher.recover`): up to `ManagedProcess.max_restarts` times per process and
run, each after a backoff that doubles (`restart_delay_s`), with the same command and port; a
frozen process (stopped past `freeze_timeout_s`) is killed first, as a failed liveness probe
is. A process out of restarts, or whose restart fails, ends the run with one line naming it
(`ServiceDied`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from sinkflex.buffer.stream import BufferConnectionError
from sinkflex.config import ConfigError
from sinkflex.errors import ServiceError
from sinkflex.retry import poll_until
from sinkflex.serving import make_channel, wait_for_serving

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def renice_self(n: int) -> None:
    """Adds `n` to this process's niceness (`os.nice`) and sets its scheduling autogroup's to the
    same value (`/proc/self/autogroup`, where the kernel has autogroups: a process started in a new
    session gets a group of its own, and CFS shares the CPU between groups by the group's nice, so
    `os.nice` alone would not lower its share against the other services). Runs in the child
    between fork and exec (`subprocess.Popen(preexec_fn=...)`, after its setsid); a kernel without
    autogroups, or one that refuses the write, keeps the process's own niceness only."""
    os.nice(n)
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(max(-20, min(19, n))))
    except OSError:
        pass


@dataclass
class ManagedProcess:
    """One launched service.

    Attributes:
        name: short name, used for the log file.
        argv: the command (argv[0] is usually sys.executable).
        health: "grpc:<service name>" (health-checked on `address`), "http:<url>" (any
            2xx answer), or "" (no readiness check).
        address: "host:port" the service listens on ("" when not a gRPC service).
        env: extra environment variables.
        stop_grace_s: seconds from SIGTERM to SIGKILL (the learner needs time to checkpoint).
    """

    name: str
    argv: list[str]
    health: str = ""
    address: str = ""
    env: dict[str, str] = field(default_factory=dict)
    stop_grace_s: float | None = None
    """Seconds between SIGTERM and SIGKILL (None: the launcher's default)."""
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    max_restarts: int = 0
    """How often the launcher restarts it when it dies or freezes (`LocalLauncher.recover`); 0: never."""
    restarts: int = 0
    ready_timeout_s: float = 300.0
    """How long a restart waits for it to be ready."""
    nice: int = 0
    """Added to the process's scheduling niceness at start, its autogroup's set to it too
    (`renice_self`; 0: as the launcher's)."""

    def wait_ready(self, timeout: float) -> None:
        """Blocks until the process is ready.

        Raises:
            RuntimeError: the process exited first (its log tail is in the message).
            TimeoutError: not ready within `timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        kind, _, target = self.health.partition(":")

        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} before it was ready:\n{self.log_tail()}")
            remaining = max(0.1, deadline - time.monotonic())
            try:
                if kind == "grpc":
                    channel = make_channel(self.address)
                    try:
                        wait_for_serving(channel, target, timeout=min(5.0, remaining))
                    finally:
                        channel.close()
                    return True
                if kind == "http":
                    with urllib.request.urlopen(target, timeout=min(5.0, remaining)) as resp:  # noqa: S310 - loopback
                        return 200 <= resp.status < 300
                return True
            except (TimeoutError, OSError):
                return False

        if not poll_until(ready, timeout, every_s=0.5):
            raise TimeoutError(f"{self.name} not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


class ServiceDied(RuntimeError):
    """A launched process (or a process it depends on) died or stays frozen: the message is one line
    naming it, its pid and its exit status, and saying how to resume."""


RESUME_HINT = "re-run the same command to resume"

#: The first restart's backoff (seconds), doubled for each restart of the same process, at most
#: `RESTART_BACKOFF_MAX_S` (Kubernetes' CrashLoopBackOff: 10 s doubling to 5 min; shorter here,
#: where a restart costs a model load).
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0


def restart_delay_s(restarts: int) -> float:
    """Seconds to wait before restart number `restarts` + 1 of one process: 1, 2, 4, ... s, at most 30 s."""
    return min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** max(0, restarts))


class ServiceRestarted(RuntimeError):
    """`LocalLauncher.check_alive` found a process dead or frozen with restarts left: the caller's
    current operation (a step's rollouts, a wait) is abandoned, `LocalLauncher.recover` restarts it,
    and the work is taken up again from the learner's policy version. The message is the problem's line."""


@dataclass(frozen=True)
class Problem:
    """A process that died or stays frozen.

    Attributes:
        line: one line naming it, its pid and how it ended, ending with `RESUME_HINT`.
        target: the name of the process that a restart starts again: a launched process's name,
            the launched parent of a watched child (`engine` -> rollout, `learner_rank` -> learner),
            or a watched process with a restart function of its own (`redis`).
        frozen: stopped (SIGSTOP) past the freeze timeout rather than dead.
    """

    line: str
    target: str
    frozen: bool = False


def exit_description(returncode: int) -> str:
    """`exit -9, signal SIGKILL` for a negative Popen return code, `exit 1` otherwise."""
    if returncode < 0:
        try:
            return f"exit {returncode}, signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"exit {returncode}"
    return f"exit {returncode}"


#: Added to a SIGKILL nobody in the run sent: on a machine short of memory it is the kernel's OOM killer.
OOM_HINT = "likely the kernel's OOM killer (`dmesg | grep -i oom`): free memory first"


def zombie_exit_description(pid: int) -> str:
    """How a zombie process `pid` that is not our child ended, read from the exit-status field
    of /proc/<pid>/stat (the last field, the waitpid(2) status; Linux >= 3.5, proc(5)):
    `zombie, signal SIGKILL: <OOM_HINT>`, `zombie, exit 1`, or `zombie` when unreadable."""
    try:
        status = int(Path(f"/proc/{pid}/stat").read_text().rsplit(None, 1)[-1])
    except (OSError, ValueError, IndexError):
        return "zombie"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        return f"zombie, signal {name}" + (f": {OOM_HINT}" if sig == signal.SIGKILL else "")
    return f"zombie, exit {os.WEXITSTATUS(status)}"


#: The readiness check of each service (`ManagedProcess.health`): its gRPC health service name.
HEALTH = {
    "env": "grpc:sinkflex.api.env.v1.EnvService",
    "reward": "grpc:sinkflex.api.reward.v1.RewardService",
    "rollout": "grpc:sinkflex.api.rollout.v1.RolloutService",
    "learner": "grpc:sinkflex.api.learner.v1.LearnerService",
}

#: What each launched process is called in a message (its `ManagedProcess.name` otherwise).
LABELS = {"env": "env service", "reward": "reward service", "rollout": "rollout service", "learner": "learner (torchrun)",
          "user_sim": "user simulator", "engine": "vLLM engine of the rollout service", "learner_rank": "learner rank",
          "redis": "embedded Redis"}


def _kill_group(pgid: int, deadline: float) -> None:
    """Waits until process group `pgid` is empty or `deadline` (time.monotonic()) passed, then SIGKILLs
    what is left of it and waits for that (at most 10 s). The group of a launched process outlives its
    leader while a child it started lives on (a SIGKILLed vLLM server's engine process)."""

    def alive() -> bool:
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not alive():
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    end = time.monotonic() + 10.0
    while alive() and time.monotonic() < end:
        time.sleep(0.05)


class LocalLauncher:
    """Starts services as local processes and stops them all on exit. A context manager.

    Example::

        with LocalLauncher(run_dir) as launcher:
            launcher.start(ManagedProcess("env", [sys.executable, "-m", "env_service", "--port", "50051"],
                                          health="grpc:sinkflex.api.env.v1.EnvService", address="127.0.0.1:50051"))
            ...
    """

    #: a watched child found dead while its launched parent runs: how long to wait for the parent to
    #: exit too (then the parent, the process that stopped, is named), in seconds
    CHILD_EXIT_SETTLE_S = 15.0

    def __init__(self, run_dir: str | Path, grace_seconds: float = 20.0, freeze_timeout_s: float = 30.0):
        self.run_dir = Path(run_dir)
        self.log_dir = self.run_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.grace_seconds = grace_seconds
        self.processes: list[ManagedProcess] = []
        #: processes that are not launched here but watched like them: name -> pid (the embedded
        #: Redis, the rollout service's vLLM engine process, the learner's ranks)
        self.watched: dict[str, int] = {}
        #: watched child pid -> the pid of the launched process it is a child of
        self.watched_parent: dict[int, int] = {}
        #: a process stopped (SIGSTOP, state T) for longer than this is reported as frozen
        self.freeze_timeout_s = freeze_timeout_s
        self._stopped_since: dict[int, float] = {}
        self._sigterm_before = None  # the SIGTERM handler __enter__ replaced
        #: one line per restart (`recover`): what died or froze, and that it was restarted
        self.restart_log: list[str] = []
        #: watched processes that `recover` restarts itself: name -> (restart function returning
        #: the new pid, max restarts); and how often each was restarted
        self.restarters: dict[str, tuple] = {}
        self.watched_restarts: dict[str, int] = {}

    def start(self, spec: ManagedProcess, ready_timeout: float = 300.0) -> ManagedProcess:
        """Starts `spec` in a new process group and waits until it is ready."""
        return self.start_all([spec], ready_timeout)[0]

    def start_all(self, specs: list[ManagedProcess], ready_timeout: float = 300.0) -> list[ManagedProcess]:
        """Starts every spec at once (they load in parallel), then waits until each is ready.

        Raises:
            RuntimeError / TimeoutError: a process exited or was not ready in time (see
            `ManagedProcess.wait_ready`); the processes already started are stopped on exit.
        """
        for spec in specs:
            self._spawn(spec)
        deadline = time.monotonic() + ready_timeout
        for spec in specs:
            spec.wait_ready(max(1.0, deadline - time.monotonic()))
            log.info("%s ready (pid %d%s)", spec.name, spec.proc.pid, f", {spec.address}" if spec.address else "")
        self._watch_children()
        self.write_pids()
        return specs

    def watch(self, name: str, pid: int, restart=None, max_restarts: int = 0) -> None:
        """Watches `pid` (not launched here) like a launched process; recorded in pids.json.

        Args:
            restart: called (no arguments) by `recover` to start it again once it died or was killed
                frozen; returns the new pid. None: its death ends the run.
            max_restarts: how often `recover` may call `restart` in this run.
        """
        self.watched[name] = pid
        if restart is not None:
            self.restarters[name] = (restart, max_restarts)
        self.write_pids()

    def _watch_children(self) -> None:
        """Records the child processes that matter: the rollout service's engine process(es) and the
        learner's ranks (torchrun's children)."""
        try:
            import psutil
        except ImportError:  # pragma: no cover - psutil ships with the project
            return
        for p in self.processes:
            if p.proc is None or p.name not in ("rollout", "learner"):
                continue
            try:
                kids = psutil.Process(p.proc.pid).children(recursive=False)
            except psutil.Error:
                continue
            if p.name == "rollout":  # vLLM's engine core runs in a child process (not the resource tracker)
                kids = [k for k in kids if "resource_tracker" not in " ".join(_cmdline(k))]
                for i, k in enumerate(kids):
                    self.watched["engine" if i == 0 else f"engine_{i}"] = k.pid
            else:  # the ranks only: torchrun also runs short-lived helpers whose zombies are not a dead rank
                kids = [k for k in kids if "learner_service" in " ".join(_cmdline(k))]
                for i, k in enumerate(kids):
                    self.watched["learner_rank" if i == 0 else f"learner_rank_{i}"] = k.pid
            self.watched_parent.update({k.pid: p.proc.pid for k in kids})

    def pids(self) -> dict[str, int]:
        """name -> pid of every launched and watched process, and this (the driver) process."""
        out = {"driver": os.getpid()}
        out.update({p.name: p.proc.pid for p in self.processes if p.proc is not None})
        out.update(self.watched)
        return out

    def write_pids(self) -> Path:
        """Writes `pids()` to <run_dir>/pids.json (for fault injection and operators)."""
        path = self.run_dir / "pids.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.pids(), indent=1) + "\n")
        os.replace(tmp, path)
        return path

    def _spawn(self, spec: ManagedProcess, register: bool = True) -> None:
        spec.log_path = self.log_dir / f"{spec.name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
        log.info("starting %s: %s", spec.name, " ".join(spec.argv))
        with open(spec.log_path, "ab") as out:
            spec.proc = subprocess.Popen(  # noqa: S603 - our own services
                spec.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                preexec_fn=(lambda n=spec.nice: renice_self(n)) if spec.nice else None,  # noqa: PLW1509 - no locks taken
            )
        if register:
            self.processes.append(spec)

    def check_alive(self) -> None:
        """Raises when a launched or watched process has died, or has been stopped (SIGSTOP) for longer
        than `freeze_timeout_s`: `ServiceRestarted` when `recover` can restart it (restarts left),
        else `ServiceDied`. Both carry one line naming it. Restarts nothing itself (it is called
        from the controller's threads; `recover` runs once they have unwound)."""
        problem = self._problem()
        if problem is None:
            return
        if self._restarts_left(problem.target) > 0:
            raise ServiceRestarted(problem.line.removesuffix(f"; {RESUME_HINT}") + "; restarting it")
        raise ServiceDied(self._out_of_restarts(problem))

    def recover(self, settle_s: float = 0.0) -> list[str]:
        """Restarts every process that died or stays frozen, until none does, each after its backoff
        (`restart_delay_s`): a frozen one is SIGKILLed first; a dead watched child restarts its
        launched parent (the rollout service for its vLLM engine, torchrun for a learner rank); the
        embedded Redis is started again on its database file and socket by its restart function
        (`watch(restart=...)`). `settle_s`: after a failed call, wait up to this long for a dying
        process to exit. Returns one line per restart ([] when nothing was dead or frozen).

        Raises:
            ServiceDied: a process out of restarts (`ManagedProcess.max_restarts`), or whose restart
                failed; one line naming it, ending with `RESUME_HINT`.
        """
        notes: list[str] = []
        problem = self._settled_problem(settle_s)
        while problem is not None:
            if self._restarts_left(problem.target) <= 0:
                raise ServiceDied(self._out_of_restarts(problem))
            notes.append(self._restart(problem))
            problem = self._settled_problem(self.RECOVER_SETTLE_S)
        return notes

    #: after a restart, how long `recover` waits for another process to show a problem (a killed
    #: Redis takes the learner down a few seconds later), in seconds
    RECOVER_SETTLE_S = 2.0

    def restart_dead(self) -> str | None:
        """`recover` without raising: None, or the one line of what could not be restarted."""
        try:
            self.recover()
        except ServiceDied as err:
            return str(err)
        return None

    def _settled_problem(self, settle_s: float) -> Problem | None:
        return poll_until(self._problem, settle_s, every_s=0.2)

    def _spec(self, name: str) -> ManagedProcess | None:
        return next((p for p in self.processes if p.name == name), None)

    def _restarts_left(self, target: str) -> int:
        spec = self._spec(target)
        if spec is not None:
            return spec.max_restarts - spec.restarts
        if target in self.restarters:
            _, max_restarts = self.restarters[target]
            return max_restarts - self.watched_restarts.get(target, 0)
        return 0

    def _out_of_restarts(self, problem: Problem) -> str:
        spec = self._spec(problem.target)
        done = spec.restarts if spec is not None else self.watched_restarts.get(problem.target, 0)
        if done == 0:
            return problem.line
        head = problem.line.removesuffix(f"; {RESUME_HINT}")
        return f"{head}; restarted {done} time{'s' if done != 1 else ''} already (local.max_restarts); {RESUME_HINT}"

    def _restart(self, problem: Problem) -> str:
        """Stops what is left of `problem.target` (and its watched children), waits its backoff, starts it
        again and waits until it is ready. Returns the restart's line (also in `restart_log`)."""
        target = problem.target
        spec = self._spec(target)
        done = spec.restarts if spec is not None else self.watched_restarts.get(target, 0)
        delay = restart_delay_s(done)
        what = problem.line.removesuffix(f"; {RESUME_HINT}")
        log.warning("%s: restarting %s in %.0fs (restart %d)", what, LABELS.get(target, target), delay, done + 1)
        if spec is None:  # a watched process with its own restart function (the embedded Redis)
            self._kill_pid(self.watched.get(target))
            time.sleep(delay)
            restart, _ = self.restarters[target]
            self.watched_restarts[target] = done + 1
            try:
                pid = restart()
            except Exception as err:  # noqa: BLE001 - named in one line
                raise ServiceDied(f"{what}; its restart failed ({type(err).__name__}: {str(err).splitlines()[0][:300]}); "
                                  f"{RESUME_HINT}") from err
            self.watched[target] = pid
            self._stopped_since.clear()
        else:
            self._terminate(spec, grace=0.0 if problem.frozen else self._restart_grace(spec))
            time.sleep(delay)
            spec.restarts += 1
            self._spawn(spec, register=False)
            try:
                spec.wait_ready(spec.ready_timeout_s)
            except (RuntimeError, TimeoutError) as err:
                raise ServiceDied(f"{what}; its restart failed ({str(err).splitlines()[0]}); {RESUME_HINT}") from None
            self._watch_children()
        note = f"{what}; restarted ({LABELS.get(target, target)} restart {done + 1}, after {delay:.0f}s)"
        self.restart_log.append(note)
        log.warning("%s", note)
        self.write_pids()
        return note

    def _restart_grace(self, spec: ManagedProcess) -> float:
        """SIGTERM-to-SIGKILL grace of a restart: a learner whose rank outlived torchrun checkpoints first;
        anything else is already broken (a dead engine, a dead rank) and gets a short one."""
        grace = self.grace_seconds if spec.stop_grace_s is None else spec.stop_grace_s
        return grace if spec.name == "learner" and spec.proc is not None and spec.proc.poll() is not None else min(grace, 10.0)

    def _terminate(self, spec: ManagedProcess, grace: float) -> None:
        """SIGTERM (SIGCONT first) `spec`'s process group and its watched children, SIGKILL what is left
        after `grace` seconds (0: SIGKILL at once); forgets the children."""
        import psutil

        kids = [(n, pid) for n, pid in self.watched.items()
                if self.watched_parent.get(pid) == (spec.proc.pid if spec.proc is not None else None)]
        procs = []
        for _, pid in kids:
            try:
                procs.append(psutil.Process(pid))
            except psutil.Error:
                pass
        sig = signal.SIGTERM if grace > 0 else signal.SIGKILL
        if spec.proc is not None:
            # the whole group, also when its leader is already dead: a SIGKILLed vLLM server leaves its
            # engine process running in the group (2-3 GiB each, found by benchmarks/faults.py)
            for s in (sig, signal.SIGCONT):
                try:
                    os.killpg(spec.proc.pid, s)
                except (ProcessLookupError, PermissionError):
                    pass
        for proc in procs:  # ranks run in a session of their own: the group's signal missed them
            try:
                proc.send_signal(sig)
                proc.send_signal(signal.SIGCONT)
            except psutil.Error:
                pass
        deadline = time.monotonic() + grace
        if spec.proc is not None:
            try:
                spec.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            if spec.proc.poll() is None:
                try:
                    os.killpg(spec.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                spec.proc.wait()
            _kill_group(spec.proc.pid, deadline)  # what outlived its leader
        _, alive = psutil.wait_procs(procs, timeout=max(0.1, deadline - time.monotonic()))
        for proc in alive:
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=10)
        for name, pid in kids:
            self.watched.pop(name, None)
            self.watched_parent.pop(pid, None)
            self._stopped_since.pop(pid, None)
        if spec.proc is not None:
            self._stopped_since.pop(spec.proc.pid, None)

    @staticmethod
    def _kill_pid(pid: int | None) -> None:
        """SIGKILL `pid` (SIGCONT first) and wait until it is gone (at most 10 s)."""
        if not pid:
            return
        import psutil

        try:
            proc = psutil.Process(pid)
            proc.send_signal(signal.SIGKILL)
            proc.send_signal(signal.SIGCONT)
            proc.wait(timeout=10)
        except (psutil.Error, subprocess.TimeoutExpired):
            pass

    def diagnose(self, settle_s: float = 0.0) -> str | None:
        """One line naming the first launched or watched process that died or stays frozen; None if all
        are running. `settle_s`: after a failed call, wait up to this long for a dying process to exit
        (a connection may break a moment before the process is gone)."""
        problem = self._settled_problem(settle_s)
        return None if problem is None else problem.line

    def _parent_name(self, pid: int) -> str | None:
        ppid = self.watched_parent.get(pid)
        return next((p.name for p in self.processes if p.proc is not None and p.proc.pid == ppid), None)

    def _problem(self) -> Problem | None:
        for p in self.processes:
            if p.proc is not None and p.proc.poll() is not None:
                where = f" (log: {p.log_path})" if p.log_path else ""
                # torchrun exits 1 when a rank dies: name the rank's own signal when we know it
                oom = f"; {OOM_HINT}" if p.proc.returncode == -signal.SIGKILL else ""
                return Problem(f"{LABELS.get(p.name, p.name)} (pid {p.proc.pid}) died ({exit_description(p.proc.returncode)})"
                               f"{self._rank_note(p)}{where}{oom}; {RESUME_HINT}", p.name)
        try:
            import psutil
        except ImportError:  # pragma: no cover
            return None
        for name, pid in list(self.watched.items()):
            label = LABELS.get(name.rstrip("_0123456789"), name)
            target = self._parent_name(pid) or name
            try:
                status = psutil.Process(pid).status()
            except psutil.NoSuchProcess:
                parent = self._exiting_parent(pid, label)
                return Problem(parent or f"{label} (pid {pid}) died; {RESUME_HINT}", target)
            except psutil.Error:
                continue
            if status == psutil.STATUS_ZOMBIE:
                parent = self._exiting_parent(pid, label)
                if parent is not None:  # the service is stopping (e.g. SIGTERM) and took its child with it
                    return Problem(parent, target)
                return Problem(f"{label} (pid {pid}) died ({zombie_exit_description(pid)}); {RESUME_HINT}", target)
        now = time.monotonic()
        for name, pid in self.pids().items():
            if name == "driver":
                continue
            try:
                stopped = psutil.Process(pid).status() in (psutil.STATUS_STOPPED, getattr(psutil, "STATUS_TRACING_STOP", "tracing-stop"))
            except psutil.Error:
                continue
            if not stopped:
                self._stopped_since.pop(pid, None)
                continue
            since = self._stopped_since.setdefault(pid, now)
            if now - since >= self.freeze_timeout_s:
                label = LABELS.get(name.rstrip("_0123456789"), name)
                target = name if self._spec(name) is not None else (self._parent_name(pid) or name)
                return Problem(f"{label} (pid {pid}) is frozen (stopped, e.g. SIGSTOP) for over {self.freeze_timeout_s:.0f}s; "
                               f"{RESUME_HINT}", target, frozen=True)
        return None

    def _exiting_parent(self, pid: int, label: str) -> str | None:
        """When watched process `pid` died as part of its launched parent's own stop (a service
        that stops on SIGTERM stops its engine first): the line naming the parent, once it has
        exited within `CHILD_EXIT_SETTLE_S` with status 0 or SIGTERM; None when the parent goes on
        running or fails (then the child's death is what to report)."""
        import psutil

        try:
            ppid = psutil.Process(pid).ppid()
        except psutil.Error:  # reaped already
            ppid = self.watched_parent.get(pid)
        parent = next((p for p in self.processes if p.proc is not None and p.proc.pid == ppid), None)
        if parent is None:
            return None
        try:
            code = parent.proc.wait(timeout=self.CHILD_EXIT_SETTLE_S)
        except subprocess.TimeoutExpired:
            return None
        if code not in (0, -signal.SIGTERM):  # the parent failed: the child's death is the news
            return None
        where = f" (log: {parent.log_path})" if parent.log_path else ""
        return (f"{LABELS.get(parent.name, parent.name)} (pid {ppid}) exited ({exit_description(parent.proc.returncode)}) "
                f"and its child, the {label} (pid {pid}), with it{where}; {RESUME_HINT}")

    def _rank_note(self, p: ManagedProcess) -> str:
        if p.name != "learner":
            return ""
        import psutil

        gone = [pid for name, pid in self.watched.items() if name.startswith("learner_rank") and not psutil.pid_exists(pid)]
        return f" after its rank (pid {gone[0]}) died" if gone else ""

    def stop_all(self) -> None:
        """SIGTERM every process group (reverse start order), SIGKILL after the grace period."""
        for p in reversed(self.processes):
            if p.proc is not None and p.proc.poll() is None:
                log.info("stopping %s (pid %d)", p.name, p.proc.pid)
                try:
                    os.killpg(p.proc.pid, signal.SIGTERM)
                    os.killpg(p.proc.pid, signal.SIGCONT)  # a frozen (SIGSTOP) process must see its SIGTERM
                except ProcessLookupError:
                    pass
        t0 = time.monotonic()
        force = False
        for p in reversed(self.processes):
            if p.proc is None:
                continue
            grace = self.grace_seconds if p.stop_grace_s is None else p.stop_grace_s
            try:
                if not force:
                    p.proc.wait(timeout=max(0.1, t0 + grace - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs: SIGKILL", p.name, grace)
            except KeyboardInterrupt:  # a second Ctrl-C: no more grace
                log.warning("interrupted again: killing the remaining services")
                force = True
            if p.proc.poll() is None:
                try:
                    os.killpg(p.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.proc.wait()
            self._stop_orphans(p, max(0.1, t0 + grace - time.monotonic()) if not force else 0.1)
        self.processes.clear()

    def _stop_orphans(self, p: ManagedProcess, timeout: float) -> None:
        """The watched children of `p` (its learner ranks, its engine process) that outlive it — its
        leader was killed, e.g. torchrun by SIGKILL — get the rest of the grace (a rank checkpoints on
        SIGTERM), then SIGKILL, so no process of this run outlives it."""
        try:
            import psutil
        except ImportError:  # pragma: no cover
            return
        kinds = {"learner": "learner_rank", "rollout": "engine"}.get(p.name)
        if kinds is None:
            return
        left = []
        for name, pid in self.watched.items():
            if name.startswith(kinds):
                try:
                    left.append(psutil.Process(pid))
                except psutil.Error:
                    continue
        if not left:
            return
        for proc in left:  # torchrun starts its ranks in their own session: the group's SIGTERM missed them
            try:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(left, timeout=timeout)
        for proc in alive:
            log.warning("%s (pid %d) outlived %s: SIGKILL", kinds, proc.pid, p.name)
            try:
                proc.kill()
            except psutil.Error:
                pass

    def __enter__(self) -> "LocalLauncher":
        """In the main thread, SIGTERM (kill, docker stop, timeout) raises KeyboardInterrupt until
        `__exit__`, as Ctrl-C does, so that the services stop with the command that started them;
        Python's default would end the process at once and leave them running."""
        self._sigterm_before = None
        if threading.current_thread() is threading.main_thread():
            self._sigterm_before = signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop_all()
        finally:
            if self._sigterm_before is not None:
                signal.signal(signal.SIGTERM, self._sigterm_before)


def _sigterm_as_interrupt(signum, _frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _cmdline(proc) -> list[str]:
    try:
        return proc.cmdline()
    except Exception:  # noqa: BLE001 - psutil.Error: gone or not ours
        return []


def python_module(module: str, *args: str) -> list[str]:
    """argv for `python -m module args...` with this interpreter."""
    return [sys.executable, "-m", module, *args]


#: At most this many in-run recoveries per run (each also needs a restart left, `recover`).
MAX_RECOVERIES = 64
#: After a failed call, how long `run_recovering` waits for a process to be found dead or frozen (s):
#: a client of a killed peer (a learner that loses Redis) may die some seconds after the call failed.
RECOVER_SETTLE_S = 15.0
#: Recoveries in a row that restart nothing (`run_recovering` waits for the peers instead).
MAX_PEER_WAITS = 3


def _peer_restarting(err: BaseException) -> bool:
    """A failure a peer's restart explains: a service UNAVAILABLE / DEADLINE_EXCEEDED, Redis unreachable."""
    return (isinstance(err, ServiceError) and err.retryable) or isinstance(err, BufferConnectionError)


def run_recovering(controller, launcher: LocalLauncher, reconnect, wait_for_peers=None) -> int:
    """`controller.run()`, taken up again after each in-run recovery, as Kubernetes restarts a pod:
    when it raises (a `ServiceRestarted` from its liveness checks, or a failed call) the
    controller's clients are closed (cancelling its in-flight calls), `launcher.recover` restarts
    what died or froze, the controller gets fresh clients (`reconnect()`, a `ServiceClients`) and
    runs again from the learner's policy version (`Controller.run` resumes: the engine is brought
    to the learner's version, a step whose rollouts were cut off is rolled out again and counted
    in `Controller.groups_retried`). Each recovery is a line of <run_dir>/recoveries.jsonl.

    With services that run elsewhere (compose, a cluster: nothing launched here, their own
    supervisor restarts them), a call that failed UNAVAILABLE or DEADLINE_EXCEEDED is a peer
    restarting: `wait_for_peers()` (True once every service is SERVING again) is waited for and
    the run taken up again the same way.

    Returns:
        the policy version `controller.run()` returned.

    Raises:
        ServiceDied: a process out of restarts or whose restart failed (one line naming it).
        the controller's exception: when nothing had died or frozen (not a fault this heals), or
            after `MAX_RECOVERIES` recoveries.
    """
    waits = 0  # recoveries in a row that restarted nothing (a peer still coming back)
    for _ in range(MAX_RECOVERIES):
        try:
            return controller.run()
        except Exception as err:  # noqa: BLE001 - recovered, or raised again below
            if isinstance(err, (ConfigError, ServiceDied)):  # not a fault, or out of restarts
                raise
            controller.clients.close()  # cancels the abandoned producer's Rollout stream and polls
            notes = launcher.recover(settle_s=RECOVER_SETTLE_S)
            if notes or isinstance(err, ServiceRestarted):
                waits = 0
            else:
                # nothing died or froze: a peer that is restarting (its own supervisor's, or a client that
                # gave up on a restarted Redis) is waited for, a few times in a row at most
                if not (_peer_restarting(err) and waits < MAX_PEER_WAITS and wait_for_peers is not None
                        and wait_for_peers()):
                    raise
                waits += 1
                what = err.code.name if isinstance(err, ServiceError) else type(err).__name__
                notes = [f"a call failed ({what}); every service SERVING again"]
            retried = controller.abandon_in_flight()
            record = {"time": time.time(), "error": f"{type(err).__name__}: {str(err).splitlines()[0][:500] if str(err) else ''}",
                      "restarted": notes, "groups_retried": retried}
            with open(launcher.run_dir / "recoveries.jsonl", "a") as fh:
                fh.write(json.dumps(record) + "\n")
            log.warning("recovered in-run (%s); %d in-flight group(s) to roll out again; going on from the learner's "
                        "policy version", "; ".join(notes) or str(err).splitlines()[0], retried)
            controller.reconnect(reconnect())
    return controller.run()


#: How long `peers_serving` waits for services that run elsewhere to be SERVING again (seconds).
PEERS_TIMEOUT_S = 600.0


def peers_serving(addresses, timeout_s: float = PEERS_TIMEOUT_S) -> bool:
    """True once every service of `addresses` (a `sinkflex_rl.clients.Addresses`; "" skipped) answers
    its gRPC health check SERVING, within `timeout_s` seconds in all; False otherwise."""
    deadline = time.monotonic() + timeout_s
    for name in ("env", "reward", "rollout", "learner"):
        address = getattr(addresses, name, "")
        if not address:
            continue
        channel = make_channel(address)
        try:
            wait_for_serving(channel, HEALTH[name].partition(":")[2], timeout=max(1.0, deadline - time.monotonic()))
        except TimeoutError:
            return False
        finally:
            channel.close()
    return True
