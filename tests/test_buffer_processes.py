"""Trajectory buffer across processes: a consumer killed before acknowledging, a producer in
another process, and the embedded server's lifecycle. Real Redis, real child processes.
"""

from __future__ import annotations

import os
import time

import pytest
import redis

from sinkflex.buffer import TrajectoryBuffer
from tests.fixtures.redis import make_group, run_python

CLAIM_MS = 200


def _pid_running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_consumer_dies_before_ack_group_is_used_exactly_once(redis_url, unique_stream):
    """Must-show of issue 5: with the embedded Redis and with an external one."""
    producer = TrajectoryBuffer(redis_url, stream=unique_stream, max_pending_groups=4, maxlen=8)
    put_id = producer.put(make_group("g-orphan"), timeout=5)

    # A consumer in its own process takes the group and is SIGKILLed before acknowledging.
    child = run_python(
        f"""
        import os, signal
        from sinkflex.buffer import TrajectoryBuffer
        buf = TrajectoryBuffer(stream={unique_stream!r}, max_pending_groups=4, maxlen=8, claim_idle_ms={CLAIM_MS})
        [entry] = buf.read("learner-dead", count=1, block_ms=5000)
        print(entry.entry_id, entry.group.group_id, entry.deliveries, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # dies mid-step: no ack
        """,
        env={"REDIS_URL": redis_url},  # the child finds Redis through the environment
    )
    assert child.returncode == -9, child.stderr
    assert child.stdout.split() == [put_id, "g-orphan", "1"]
    [pending] = producer._redis.xpending_range(unique_stream, "learner", "-", "+", 10)
    assert pending["consumer"] == b"learner-dead" and pending["message_id"].decode() == put_id

    # Two live consumers keep reading; after the idle timeout one of them reclaims the group.
    used: dict[str, int] = {}
    deliveries = []
    live = [
        TrajectoryBuffer(redis_url, stream=unique_stream, max_pending_groups=4, maxlen=8, claim_idle_ms=CLAIM_MS)
        for _ in range(2)
    ]
    deadline = time.monotonic() + 3 * CLAIM_MS / 1000 + 1.0
    while time.monotonic() < deadline:
        for i, buf in enumerate(live):
            for entry in buf.read(f"learner-{i}", count=2, block_ms=50):
                used[entry.group.group_id] = used.get(entry.group.group_id, 0) + 1  # "train"
                deliveries.append((entry.entry_id, entry.deliveries))
                buf.ack([entry])
    assert used == {"g-orphan": 1}
    assert deliveries == [(put_id, 2)]
    stats = producer.stats()
    assert (stats.unconsumed, stats.pending, stats.trained) == (0, 0, 1)
    for buf in live:
        buf.close()
    producer.delete()
    producer.close()


def test_producer_in_another_process_feeds_this_consumer(redis_url, unique_stream):
    child = run_python(
        f"""
        from sinkflex.buffer import TrajectoryBuffer
        from tests.fixtures.redis import make_group
        buf = TrajectoryBuffer(stream={unique_stream!r}, max_pending_groups=4, maxlen=8)
        for i in range(3):
            print(buf.put(make_group(f"g{{i}}", seed=i), timeout=10))
        """,
        env={"REDIS_URL": redis_url},
    )
    assert child.returncode == 0, child.stderr
    put_ids = child.stdout.split()
    consumer = TrajectoryBuffer(redis_url, stream=unique_stream, max_pending_groups=4, maxlen=8)
    entries = consumer.read("learner-0", count=5, block_ms=500)
    assert [e.entry_id for e in entries] == put_ids
    for i, entry in enumerate(entries):
        expected = make_group(f"g{i}", seed=i)
        assert list(entry.group.trajectories) == list(expected.trajectories)
        assert entry.group.created_at.seconds > 0
    consumer.ack(entries)
    assert consumer.stats().unconsumed == 0
    consumer.delete()
    consumer.close()


def test_embedded_server_is_started_once_and_stopped_at_exit():
    child = run_python(
        """
        from sinkflex.buffer import TrajectoryBuffer, embedded_redis_url
        from sinkflex.buffer.embedded import _SERVERS
        url = embedded_redis_url()
        assert embedded_redis_url() == url
        buf = TrajectoryBuffer(stream="s")  # no URL, no REDIS_URL: the embedded server
        assert buf.url == url
        print(url, _SERVERS[None].client.pid)
        """,
        env={"REDIS_URL": ""},
    )
    assert child.returncode == 0, child.stderr
    url, pid = child.stdout.split()
    socket_path = url.removeprefix("unix://")
    assert not os.path.exists(socket_path)
    assert not os.path.exists(os.path.dirname(socket_path))
    assert not _pid_running(int(pid))


def test_embedded_server_with_path_survives_its_owner_sigkill(tmp_path):
    db = tmp_path / "buffer.db"
    owner = run_python(
        f"""
        import os, signal
        from sinkflex.buffer import TrajectoryBuffer, embedded_redis_url
        from sinkflex.buffer.embedded import _SERVERS
        from tests.fixtures.redis import make_group
        url = embedded_redis_url({str(db)!r})
        TrajectoryBuffer(url, stream="s").put(make_group("g-kept"), timeout=5)
        print(url, _SERVERS[{str(db)!r}].client.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    assert owner.returncode == -9, owner.stderr
    url, pid = owner.stdout.split()
    with redis.Redis.from_url(url) as client:
        assert client.ping()  # orphaned but alive, data in it
    heir = run_python(
        f"""
        from sinkflex.buffer import TrajectoryBuffer, embedded_redis_url
        url = embedded_redis_url({str(db)!r})
        buf = TrajectoryBuffer(url, stream="s")
        entries = buf.read("learner-0", block_ms=1000)
        buf.ack(entries)
        print(url, [e.group.group_id for e in entries][0])
        """
    )
    assert heir.returncode == 0, heir.stderr
    assert heir.stdout.split() == [url, "g-kept"]  # attached to the same server, data intact
    assert not _pid_running(int(pid))  # the heir adopted it and stopped it at exit
    assert not (tmp_path / "buffer.db.owner").exists()


@pytest.mark.parametrize("count", [1, 3])
def test_consumer_killed_holding_several_groups_loses_none(redis_embedded_url, unique_stream, count):
    producer = TrajectoryBuffer(redis_embedded_url, stream=unique_stream, max_pending_groups=8, maxlen=16)
    for i in range(4):
        producer.put(make_group(f"g{i}"), timeout=5)
    child = run_python(
        f"""
        import os, signal
        from sinkflex.buffer import TrajectoryBuffer
        buf = TrajectoryBuffer(stream={unique_stream!r}, max_pending_groups=8, maxlen=16, claim_idle_ms={CLAIM_MS})
        entries = buf.read("learner-dead", count={count}, block_ms=5000)
        print(len(entries), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """,
        env={"REDIS_URL": redis_embedded_url},
    )
    assert child.returncode == -9 and child.stdout.split() == [str(count)], child.stderr
    live = TrajectoryBuffer(
        redis_embedded_url, stream=unique_stream, max_pending_groups=8, maxlen=16, claim_idle_ms=CLAIM_MS
    )
    seen = []
    deadline = time.monotonic() + 2.0
    while len(seen) < 4 and time.monotonic() < deadline:
        entries = live.read("learner-1", count=4, block_ms=100)
        seen += [(e.group.group_id, e.deliveries) for e in entries]
        live.ack(entries)
    # The never-delivered groups come first, then the dead consumer's after the idle timeout.
    assert sorted(seen) == sorted([(f"g{i}", 2 if i < count else 1) for i in range(4)])
    assert live.stats().unconsumed == 0
    live.delete()
    live.close()
