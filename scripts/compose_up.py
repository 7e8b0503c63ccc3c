#!/usr/bin/env python3
"""`compose up` with health checks on hosts where podman cannot run them itself.

    python scripts/compose_up.py [--compose CMD] [-f FILE ...] [--profile P ...]
                                 [--events FILE] [--timeout S] TARGET ...

podman runs a container's health check from a systemd timer; on a host without systemd
(containers, CI runners) none runs ("unable to get systemd connection to add healthchecks"),
the container stays `starting` for ever, and podman-compose cannot honour
`depends_on: {condition: service_healthy}` (podman-compose 1.6.0 skips the condition on
podman < 4.6 and waits with `podman wait --condition=healthy` above it, which never returns
without the timer). This script is that timer: it runs `podman healthcheck run` itself.

1. It reads the resolved compose file (`CMD config`) and takes TARGET and everything it
   depends on, transitively, in dependency order.
2. It starts each service with `CMD up -d --no-deps SERVICE` once every `depends_on` of it
   holds: `service_healthy` (its health check passed, run here every `healthcheck.interval`),
   `service_started` (running) or `service_completed_successfully` (exited 0; a one-shot
   job that exits non-zero ends this script with its exit code, as Docker Compose stops:
   "service X didn't complete successfully").
3. It then keeps running every started container's health check at its interval and
   waits until every TARGET whose `restart` is "no" has exited (the others: until
   interrupted), and exits with the first non-zero exit code of those, else 0.
   Compose's restart policies act on their own (podman restarts a container whose
   process exits, no systemd needed); this script only reports what it sees.

--events FILE appends one JSON object per line: {"t": unix seconds, "event": "started" |
"healthy" | "unhealthy" | "exited" | "restarted", "service", ...}; "up" and "all_healthy"
mark the start and the moment every started service with a health check first passed it.

CMD is the compose command, "podman-compose" by default (any that has `config` and
`up -d --no-deps`); containers are found by their `com.docker.compose.project` and
`com.docker.compose.service` labels. Needs PyYAML (podman-compose's own dependency).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import yaml

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|us|ns|h|m|s)")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def duration_s(value: str | int | float | None, default: float) -> float:
    """Compose duration ("1m30s", "15s", "500ms", or seconds) -> seconds; None -> default.

    Raises:
        ValueError: not a compose duration.
    """
    if value is None:
        return default
    if isinstance(value, (int, float)):
        return float(value)
    parts = _DURATION.findall(value)
    if not parts or "".join(n + u for n, u in parts) != value.replace(" ", ""):
        raise ValueError(f"not a compose duration: {value!r}")
    return sum(float(n) * _UNIT_S[u] for n, u in parts)


def has_healthcheck(service: dict) -> bool:
    """The service has a health check that runs (not `disable: true`, not test NONE)."""
    hc = service.get("healthcheck")
    return bool(hc) and not hc.get("disable") and (hc.get("test") or [None])[0] != "NONE"


def dependencies(service: dict) -> dict[str, str]:
    """{dependency: condition} of a service's depends_on (list form: service_started)."""
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return {d: "service_started" for d in deps}
    return {d: (c or {}).get("condition", "service_started") for d, c in deps.items()}


def start_order(services: dict[str, dict], targets: list[str]) -> list[str]:
    """TARGETS and their transitive dependencies, each after everything it depends on.

    Raises:
        ValueError: an unknown service or a dependency cycle.
    """
    order: list[str] = []
    state: dict[str, str] = {}

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name not in services:
            raise ValueError(f"unknown service {name!r} (enabled: {', '.join(sorted(services))})")
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            raise ValueError(f"dependency cycle: {' -> '.join((*path, name))}")
        state[name] = "visiting"
        for dep in dependencies(services[name]):
            visit(dep, (*path, name))
        state[name] = "done"
        order.append(name)

    for target in targets:
        visit(target, ())
    return order


class Stack:
    """The compose project's containers, through the compose command and podman."""

    def __init__(self, compose_cmd: list[str], files: list[str], profiles: list[str], events: Path | None):
        self.base = [*compose_cmd, *(a for f in files for a in ("-f", f)),
                     *(a for p in profiles for a in ("--profile", p))]
        self.events = events
        config = yaml.safe_load(self._run([*self.base, "config"]).stdout)
        self.project = config.get("name") or Path(files[0] if files else ".").resolve().parent.name
        self.services: dict[str, dict] = config["services"]
        self.secrets: dict[str, dict] = config.get("secrets") or {}
        self.healthy: set[str] = set()
        self.last_check: dict[str, float] = {}
        self.known_ids: dict[str, str] = {}

    @staticmethod
    def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, check=check, capture_output=True, text=True)

    def emit(self, event: str, service: str | None = None, **fields) -> None:
        record = {"t": round(time.time(), 3), "event": event, **({"service": service} if service else {}), **fields}
        print(f"compose_up: {json.dumps(record)}", file=sys.stderr, flush=True)
        if self.events:
            with self.events.open("a") as f:
                f.write(json.dumps(record) + "\n")

    def container(self, service: str) -> dict | None:
        """podman inspect of the service's container (None: none exists)."""
        out = self._run(["podman", "ps", "-a", "--format", "{{.ID}}",
                         "--filter", f"label=com.docker.compose.project={self.project}",
                         "--filter", f"label=com.docker.compose.service={service}"]).stdout.split()
        if not out:
            return None
        return json.loads(self._run(["podman", "inspect", out[0]]).stdout)[0]

    def up(self, service: str) -> None:
        cmd = [*self.base, "up", "-d", "--no-deps", service]
        print(f"compose_up: {shlex.join(cmd)}", file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True)
        self.emit("started", service)

    def check(self, service: str, force: bool = False) -> bool | None:
        """Run the service's health check when its interval has passed (force: now).

        Returns True healthy, False failed, None not run (no container running, no health
        check, or not due).
        """
        if not has_healthcheck(self.services[service]):
            return None
        hc = self.services[service]["healthcheck"]
        now = time.monotonic()
        if not force and now - self.last_check.get(service, -1e9) < duration_s(hc.get("interval"), 30.0):
            return None
        info = self.container(service)
        if not info or not info["State"]["Running"]:
            return None
        self.last_check[service] = now
        ok = self._run(["podman", "healthcheck", "run", info["Id"]], check=False).returncode == 0
        if ok and service not in self.healthy:
            self.healthy.add(service)
            self.emit("healthy", service)
        elif not ok and service in self.healthy:
            self.healthy.discard(service)
            self.emit("unhealthy", service)
        return ok

    def failed_job(self, dep: str, condition: str) -> int | None:
        """The exit code of `dep` when `condition` is service_completed_successfully and it
        exited non-zero (a failed one-shot job: it will never complete); else None."""
        if condition != "service_completed_successfully":
            return None
        info = self.container(dep)
        if info is None or info["State"]["Running"] or info["State"]["Status"] != "exited":
            return None
        return info["State"]["ExitCode"] or None

    def condition_holds(self, dep: str, condition: str) -> bool:
        info = self.container(dep)
        if info is None:
            return False
        state = info["State"]
        if condition == "service_healthy":
            return state["Running"] and (dep in self.healthy or bool(self.check(dep, force=True)))
        if condition == "service_completed_successfully":
            return not state["Running"] and state["Status"] == "exited" and state["ExitCode"] == 0
        return bool(state["Running"])

    def watch(self, started: list[str]) -> None:
        """One round: health checks that are due, restarts and exits seen since the last."""
        for service in started:
            info = self.container(service)
            if info is None:
                continue
            state = info["State"]
            key = f"{state.get('StartedAt')}"
            if service in self.known_ids and self.known_ids[service] != key and state["Running"]:
                self.healthy.discard(service)
                self.emit("restarted", service, restart_count=info.get("RestartCount"))
            if service in self.known_ids and not state["Running"] and self.known_ids[service] != "exited":
                self.emit("exited", service, exit_code=state["ExitCode"])
                self.known_ids[service] = "exited"
                continue
            if state["Running"]:
                self.known_ids[service] = key
            self.check(service)


#: what writes the secret files docker-compose.yml and docker-compose.tls.yml mount
SECRET_HINTS = {"redis-": "python scripts/redis_acl.py redis-auth (or $SINKFLEX_REDIS_AUTH_DIR)",
                "sinkflex-tls-": "python scripts/tls_dev_certs.py tls (or $SINKFLEX_TLS_DIR)"}


def missing_secret_files(services: dict[str, dict], secrets: dict[str, dict], order: list[str],
                         base: Path = Path(".")) -> list[str]:
    """One line per secret file that a service in `order` mounts and that does not exist (a relative
    path is the compose file's folder's, `base`): compose would fail only when it creates that
    container, after the others started."""
    out = []
    for name in dict.fromkeys(s if isinstance(s, str) else s.get("source", "")
                              for svc in order for s in services[svc].get("secrets") or []):
        path = (secrets.get(name) or {}).get("file")
        if path and not (base / path).exists():
            hint = next((h for prefix, h in SECRET_HINTS.items() if name.startswith(prefix)), "")
            out.append(f"secret {name}: {path} does not exist" + (f"; write it with {hint}" if hint else ""))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="+", metavar="TARGET")
    parser.add_argument("--compose", default="podman-compose", help="compose command (default: podman-compose)")
    parser.add_argument("-f", "--file", action="append", default=[], dest="files")
    parser.add_argument("--profile", action="append", default=[], dest="profiles")
    parser.add_argument("--events", type=Path, help="append JSON lines of what happened here")
    parser.add_argument("--timeout", type=float, default=3600.0,
                        help="seconds a service may wait for its dependencies (default 3600)")
    args = parser.parse_args(argv)

    stack = Stack(shlex.split(args.compose), args.files, args.profiles, args.events)
    order = start_order(stack.services, args.targets)
    missing = missing_secret_files(stack.services, stack.secrets, order,
                                   Path(args.files[0]).resolve().parent if args.files else Path.cwd())
    if missing:
        for line in missing:
            print(f"compose_up: {line}", file=sys.stderr)
        return 2
    stack.emit("up", services=order)
    started: list[str] = []
    with_health = {s for s in order if has_healthcheck(stack.services[s])}
    all_healthy_seen = False
    for service in order:
        deadline = time.monotonic() + args.timeout
        waits = dependencies(stack.services[service])
        while not all(stack.condition_holds(d, c) for d, c in waits.items()):
            if time.monotonic() > deadline:
                stack.emit("timeout", service, waiting_for=waits)
                return 1
            for d, c in waits.items():
                code = stack.failed_job(d, c)
                if code is not None:
                    stack.emit("failed", d, exit_code=code, needed_by=service)
                    return code
            stack.watch(started)
            time.sleep(1.0)
        stack.up(service)
        started.append(service)
    finishers = [t for t in args.targets if str(stack.services[t].get("restart", "no")) == "no"]
    while True:
        stack.watch(started)
        if not all_healthy_seen and with_health <= stack.healthy:
            all_healthy_seen = True
            stack.emit("all_healthy", services=sorted(with_health))
        if finishers:
            infos = {t: stack.container(t) for t in finishers}
            if all(i is not None and not i["State"]["Running"] for i in infos.values()):
                codes = {t: i["State"]["ExitCode"] for t, i in infos.items()}
                stack.emit("finished", exit_codes=codes)
                return next((c for c in codes.values() if c), 0)
        time.sleep(1.0)


if __name__ == "__main__":
    sys.exit(main())
