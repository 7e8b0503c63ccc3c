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


class LocalLauncher:
    """Starts services as local processes and stops them all on exit. A context manager.

    Example::

        with LocalLauncher(run_dir) as launcher:
            launcher.start(ManagedProcess("env", [sys.executable, "-m", "env_service", "--port", "50051"],
                                          health="grpc:sinkflex.api.env.v1.EnvService", address="127.0.0.1:50051"))
            ...
    """

    def __init__(self, run_dir: str | Path, grace_seconds: float = 20.0):
        self.log_dir = Path(run_dir) / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.grace_seconds = grace_seconds
        self.processes: list[ManagedProcess] = []

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
        return specs

    def _spawn(self, spec: ManagedProcess) -> None:
        spec.log_path = self.log_dir / f"{spec.name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
        log.info("starting %s: %s", spec.name, " ".join(spec.argv))
        with open(spec.log_path, "ab") as out:
            spec.proc = subprocess.Popen(  # noqa: S603 - our own services
                spec.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )
        self.processes.append(spec)

    def check_alive(self) -> None:
        """Raises RuntimeError if a launched process has died."""
        for p in self.processes:
            if p.proc is not None and p.proc.poll() is not None:
                raise RuntimeError(f"{p.name} died with code {p.proc.returncode}:\n{p.log_tail()}")

    def stop_all(self) -> None:
        """SIGTERM every process group (reverse start order), SIGKILL after the grace period."""
        for p in reversed(self.processes):
            if p.proc is not None and p.proc.poll() is None:
                log.info("stopping %s (pid %d)", p.name, p.proc.pid)
                try:
                    os.killpg(p.proc.pid, signal.SIGTERM)
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
        self.processes.clear()

    def __enter__(self) -> "LocalLauncher":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()


def python_module(module: str, *args: str) -> list[str]:
    """argv for `python -m module args...` with this interpreter."""
    return [sys.executable, "-m", module, *args]
