"""The local launcher: runs SinkFlex services as local processes on loopback ports.

The embedded default (one CPU machine, no network) starts each service with
`python -m <service> ...` in its own process group, waits until its `grpc.health.v1`
check reports SERVING (or an HTTP endpoint answers, for the user-simulator model
server), writes each process's output to `<run_dir>/logs/<name>.log`, and stops them
all in reverse start order — SIGTERM, then SIGKILL after a grace period — at exit, on an
error, or on Ctrl-C. With addresses given in the config nothing is launched.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

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
    """How often the launcher restarts it when it dies (`LocalLauncher.check_alive`); 0: never."""
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
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} before it was ready:\n{self.log_tail()}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.name} not ready after {timeout:.0f}s:\n{self.log_tail()}")
            try:
                if kind == "grpc":
                    channel = make_channel(self.address)
                    try:
                        wait_for_serving(channel, target, timeout=min(5.0, remaining))
                    finally:
                        channel.close()
                    return
                if kind == "http":
                    with urllib.request.urlopen(target, timeout=min(5.0, remaining)) as resp:  # noqa: S310 - loopback
                        if 200 <= resp.status < 300:
                            return
                else:
                    return
            except (TimeoutError, OSError):
                time.sleep(0.5)

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


class ServiceDied(RuntimeError):
    """A launched process (or a process it depends on) died or stays frozen: the message is one line
    naming it, its pid and its exit status, and saying how to resume."""


RESUME_HINT = "re-run the same command to resume"


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


#: What each launched process is called in a message (its `ManagedProcess.name` otherwise).
LABELS = {"env": "env service", "reward": "reward service", "rollout": "rollout service", "learner": "learner (torchrun)",
          "user_sim": "user simulator", "engine": "vLLM engine of the rollout service", "learner_rank": "learner rank",
          "redis": "embedded Redis"}


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
        #: one line per restart (`restart_dead`): what died
        self.restart_log: list[str] = []

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

    def watch(self, name: str, pid: int) -> None:
        """Watches `pid` (not launched here) like a launched process; recorded in pids.json."""
        self.watched[name] = pid
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
        import json

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
        """Raises `ServiceDied` (one line naming it) if a launched or watched process has died, or has
        been stopped (SIGSTOP) for longer than `freeze_timeout_s`."""
        problem = self.restart_dead() or self.diagnose()
        if problem is not None:
            raise ServiceDied(problem)

    def restart_dead(self) -> str | None:
        """Restarts every dead process with restarts left (same argv, same port) and waits until it is
        ready. Returns None, or one line when a restart failed."""
        for p in self.processes:
            if p.proc is None or p.proc.poll() is None or p.restarts >= p.max_restarts:
                continue
            label, old = LABELS.get(p.name, p.name), p.proc
            note = f"{label} (pid {old.pid}) died ({exit_description(old.returncode)})"
            p.restarts += 1
            log.warning("%s: restarting it (%d of %d)", note, p.restarts, p.max_restarts)
            self.restart_log.append(note)
            self._spawn(p, register=False)
            try:
                p.wait_ready(p.ready_timeout_s)
            except (RuntimeError, TimeoutError) as err:
                first = str(err).splitlines()[0]
                return f"{note}; its restart failed ({first}); {RESUME_HINT}"
            log.warning("%s restarted (pid %d)", label, p.proc.pid)
            self.write_pids()
        return None

    def diagnose(self, settle_s: float = 0.0) -> str | None:
        """One line naming the first launched or watched process that died or stays frozen; None if all
        are running. `settle_s`: after a failed call, wait up to this long for a dying process to exit
        (a connection may break a moment before the process is gone)."""
        deadline = time.monotonic() + settle_s
        while True:
            problem = self._problem()
            if problem is not None or time.monotonic() >= deadline:
                return problem
            time.sleep(0.2)

    def _problem(self) -> str | None:
        for p in self.processes:
            if p.proc is not None and p.proc.poll() is not None:
                where = f" (log: {p.log_path})" if p.log_path else ""
                # torchrun exits 1 when a rank dies: name the rank's own signal when we know it
                oom = f"; {OOM_HINT}" if p.proc.returncode == -signal.SIGKILL else ""
                return (f"{LABELS.get(p.name, p.name)} (pid {p.proc.pid}) died ({exit_description(p.proc.returncode)})"
                        f"{self._rank_note(p)}{where}{oom}; {RESUME_HINT}")
        try:
            import psutil
        except ImportError:  # pragma: no cover
            return None
        for name, pid in self.watched.items():
            label = LABELS.get(name.rstrip("_0123456789"), name)
            try:
                status = psutil.Process(pid).status()
            except psutil.NoSuchProcess:
                return self._exiting_parent(pid, label) or f"{label} (pid {pid}) died; {RESUME_HINT}"
            except psutil.Error:
                continue
            if status == psutil.STATUS_ZOMBIE:
                parent = self._exiting_parent(pid, label)
                if parent is not None:  # the service is stopping (e.g. SIGTERM) and took its child with it
                    return parent
                return f"{label} (pid {pid}) died ({zombie_exit_description(pid)}); {RESUME_HINT}"
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
                return (f"{label} (pid {pid}) is frozen (stopped, e.g. SIGSTOP) for over {self.freeze_timeout_s:.0f}s; "
                        f"{RESUME_HINT}")
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
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()


def _cmdline(proc) -> list[str]:
    try:
        return proc.cmdline()
    except Exception:  # noqa: BLE001 - psutil.Error: gone or not ours
        return []


def python_module(module: str, *args: str) -> list[str]:
    """argv for `python -m module args...` with this interpreter."""
    return [sys.executable, "-m", module, *args]
