"""`TrajectoryBuffer`: TrajectoryGroups on a Redis stream read by one consumer group.

Semantics, failure cases and the Redis keys are described in `sinkflex.buffer`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Self, TypeVar
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from tenacity import (
    RetryError,
    Retrying,
    retry_if_exception,
    retry_if_result,
    stop_after_attempt,
    stop_after_delay,
    stop_never,
    wait_exponential,
    wait_random_exponential,
)

from sinkflex.api.common.v1 import common_pb2
from sinkflex.buffer.embedded import redacted, resolve_redis_url
from sinkflex.buffer.lua import ACK_LUA, PUT_LUA, TOUCH_LUA

log = logging.getLogger(__name__)

T = TypeVar("T")

# The `type` field of every entry: the protobuf full name of the payload.
PAYLOAD_TYPE = common_pb2.TrajectoryGroup.DESCRIPTOR.full_name

# Longest single XREADGROUP BLOCK; `read` loops for longer `block_ms`.
_MAX_BLOCK_MS = 10_000


def _retryable(err: BaseException) -> bool:
    """A connection error or timeout that a retry may cure (not a refused password)."""
    return isinstance(err, (redis.ConnectionError, redis.TimeoutError)) and not isinstance(err, redis.AuthenticationError)


def _warn_if_open(url: str) -> None:
    """Logs a warning for a TCP Redis URL with no password to a host that is not loopback."""

    try:
        parts = urlsplit(url)
    except ValueError:
        return
    if parts.scheme in ("redis", "rediss") and not parts.password and parts.hostname not in (
            None, "localhost", "127.0.0.1", "::1"):
        log.warning("Redis at %s has no password in its URL: anyone who reaches it can read and write the "
                    "trajectories; set one (requirepass) and give it as redis://:PASSWORD@host:port/0", url)


def _read_secret(path: str) -> str:
    """The first line of a password file (a Kubernetes Secret or compose secret mounted as a file)."""
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.readline().strip()
    except OSError as err:
        raise ValueError(f"Redis password file {path!r}: cannot read it: {err.strerror or err}") from None


#: Environment variables giving the buffer's Redis user and the file holding its password.
REDIS_USERNAME_ENV = "REDIS_USERNAME"
REDIS_PASSWORD_FILE_ENV = "REDIS_PASSWORD_FILE"


class BufferConnectionError(ConnectionError):
    """Redis could not be reached after the bounded retries; the message names the URL."""


@dataclasses.dataclass(frozen=True)
class BufferEntry:
    """One delivered group.

    Attributes:
        entry_id: the stream entry id (``"<ms>-<seq>"``); pass the entry to `ack`.
        group: the decoded TrajectoryGroup.
        deliveries: how many times the entry has been delivered (1: first delivery; more:
            reclaimed from a consumer that did not acknowledge it in time).
    """

    entry_id: str
    group: common_pb2.TrajectoryGroup
    deliveries: int


@dataclasses.dataclass(frozen=True)
class BufferStats:
    """A snapshot of the buffer, for metrics and backpressure. Counts are groups.

    Attributes:
        stream_length: entries in the stream (XLEN), acknowledged history included; ≤ maxlen.
        unconsumed: groups written and not yet acknowledged (= pending + undelivered).
        pending: delivered to a consumer and not yet acknowledged (XPENDING).
        undelivered: written and never delivered: the queue lag.
        consumers: consumers the consumer group knows (alive or not).
        trained: group ids recorded as trained.
        dead_letters: entries in the dead-letter stream.
        oldest_unconsumed_age_s: age in seconds of the oldest unconsumed group (0: none).
        added: groups ever added to the stream (a counter: trimmed history included).
        memory_used_bytes: Redis `used_memory` (INFO memory); 0 when the user may not read INFO.
        memory_max_bytes: Redis `maxmemory` (0: no limit set, or unknown).
    """

    stream_length: int
    unconsumed: int
    pending: int
    undelivered: int
    consumers: int
    trained: int
    dead_letters: int
    oldest_unconsumed_age_s: float
    added: int = 0
    memory_used_bytes: int = 0
    memory_max_bytes: int = 0

    @property
    def memory_fraction(self) -> float:
        """used / maxmemory (0.0 when no maxmemory is set): `put` fails once Redis reaches 1.0
        with `noeviction`, so alert well before (`TrajectoryBuffer.memory_warn_fraction`)."""
        return self.memory_used_bytes / self.memory_max_bytes if self.memory_max_bytes else 0.0


def _entry_ms(entry_id: str) -> int:
    return int(entry_id.split("-", 1)[0])


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class TrajectoryBuffer:
    """Producer and consumer side of the trajectory buffer (one Redis connection pool).

    Args:
        url: Redis URL; None: env `REDIS_URL`, else the embedded server (`resolve_redis_url`).
        stream: the stream key. Derived keys: ``<stream>:unconsumed`` (set of unacknowledged
            entry ids), ``<stream>:trained`` (set of trained group ids),
            ``<stream>:dead`` (dead-letter stream), ``<stream>:put:<group_id>``.
        consumer_group: the Redis consumer group the learner's consumers belong to.
        max_pending_groups: backpressure bound: `put` waits while this many groups are
            unconsumed (undelivered + delivered-but-unacknowledged).
        maxlen: cap on the stream length; must exceed `max_pending_groups`.
        claim_idle_ms: an entry delivered and not acknowledged for this long is reclaimed
            by the next `read` of any consumer. Must exceed the time a live consumer takes
            from `read` to `ack` (one optimiser step), or a slow consumer's group is trained
            twice.
        retry_attempts: attempts per Redis call on connection errors before
            `BufferConnectionError` (exponential wait 0.1 s .. 2 s between attempts: about 13 s
            in all with the default 10, longer than the launcher takes to restart a killed embedded Redis).
        put_key_ttl_s: how long `put` remembers a group id, making a retried put a no-op.
        dead_letter_maxlen: approximate cap on the dead-letter stream.
        max_deliveries: an entry delivered more than this many times without being
            acknowledged (each attempt to train it raised, or killed the learner) is moved to
            the dead-letter stream with that reason by the next `read`, never delivered again.
        keep_acked: acknowledged entries kept in the stream as history; older acknowledged
            entries are deleted by `ack` (0: each entry is deleted once acknowledged). The
            payloads of a large model's groups are megabytes each: keep this small.
        trained_ttl_s: how long a trained group id is remembered (default `put_key_ttl_s`:
            a producer's retried put within that time is a no-op anyway).
        trained_max: the trained-id set keeps at most this many ids (the newest).
        username: Redis ACL user (default env `REDIS_USERNAME`, else the URL's).
        password_file: a file whose first line is the password (default env
            `REDIS_PASSWORD_FILE`, else the URL's password): keeps it off command lines.
        memory_warn_fraction: `stats()` logs a warning when Redis's used memory passes this
            fraction of its `maxmemory`.

    Raises:
        ValueError: bad bounds (e.g. `max_pending_groups >= maxlen`) or a bad URL.
        BufferConnectionError: Redis unreachable (naming the URL, password redacted) — from
            the constructor and from every method, after `retry_attempts` attempts.
    """

    def __init__(
        self,
        url: str | None = None,
        stream: str = "sinkflex:groups",
        consumer_group: str = "learner",
        max_pending_groups: int = 64,
        maxlen: int = 10_000,
        claim_idle_ms: int = 300_000,
        retry_attempts: int = 10,
        put_key_ttl_s: int = 86_400,
        dead_letter_maxlen: int = 100_000,
        max_deliveries: int = 3,
        keep_acked: int = 64,
        trained_ttl_s: int | None = None,
        trained_max: int = 1_000_000,
        username: str | None = None,
        password_file: str | None = None,
        memory_warn_fraction: float = 0.8,
    ):
        if max_pending_groups < 1:
            raise ValueError(f"max_pending_groups must be >= 1, got {max_pending_groups}")
        if maxlen <= max_pending_groups:
            raise ValueError(
                f"maxlen ({maxlen}) must be greater than max_pending_groups ({max_pending_groups}): "
                "the length cap may only trim acknowledged groups, and up to max_pending_groups "
                "groups can be unacknowledged at once"
            )
        if claim_idle_ms < 1:
            raise ValueError(f"claim_idle_ms must be >= 1, got {claim_idle_ms}")
        if retry_attempts < 1:
            raise ValueError(f"retry_attempts must be >= 1, got {retry_attempts}")
        if max_deliveries < 1:
            raise ValueError(f"max_deliveries must be >= 1, got {max_deliveries}")
        if keep_acked < 0 or trained_max < 1:
            raise ValueError(f"keep_acked must be >= 0 and trained_max >= 1, got {keep_acked}, {trained_max}")
        self.url = resolve_redis_url(url)
        username = username or os.environ.get(REDIS_USERNAME_ENV) or None
        password_file = password_file or os.environ.get(REDIS_PASSWORD_FILE_ENV) or None
        auth: dict = {}
        if username:
            auth["username"] = username
        if password_file:
            auth["password"] = _read_secret(password_file)
        if not auth:
            _warn_if_open(self.url)
        self.stream = stream
        self.consumer_group = consumer_group
        self.max_pending_groups = max_pending_groups
        self.maxlen = maxlen
        self.claim_idle_ms = claim_idle_ms
        self.retry_attempts = retry_attempts
        self.put_key_ttl_s = put_key_ttl_s
        self.dead_letter_maxlen = dead_letter_maxlen
        self.max_deliveries = max_deliveries
        self.keep_acked = keep_acked
        self.trained_ttl_s = put_key_ttl_s if trained_ttl_s is None else trained_ttl_s
        self.trained_max = trained_max
        self.memory_warn_fraction = memory_warn_fraction
        self.counts_key = f"{stream}:counts"
        self._own_cursor: dict[str, str] = {}  # consumer -> last id taken back from its own pending list
        self.unconsumed_key = f"{stream}:unconsumed"
        self._own_pending_taken: set[str] = set()  # consumers whose pending entries were taken back (read)
        self.trained_key = f"{stream}:trained"
        self.dead_letter_stream = f"{stream}:dead"
        # entries `read` moved to the dead-letter stream (malformed, or past max_deliveries) in this
        # process: a consumer that counts groups towards a quota learns from it that some will never come
        self.read_dead_letters = 0
        try:
            # tenacity (`_call`) is the only retry policy: redis-py's own retries are off.
            # A socket timeout above the longest blocking read detects a silent peer.
            self._redis = redis.Redis.from_url(
                self.url,
                socket_connect_timeout=5,
                socket_timeout=_MAX_BLOCK_MS / 1000 + 20,
                health_check_interval=30,
                retry=Retry(NoBackoff(), 0),
                **auth,
            )
        except ValueError as err:
            raise ValueError(f"bad Redis URL {redacted(self.url)!r}: {err}") from err
        self._put_script = self._redis.register_script(PUT_LUA)
        self._touch_script = self._redis.register_script(TOUCH_LUA)
        self._ack_script = self._redis.register_script(ACK_LUA)
        self._call_retrying(self._create_group)
        self._call_retrying(self._migrate_trained)

    # -- plumbing --------------------------------------------------------------------

    def _call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """Runs `fn` retrying connection errors (bounded), then raises BufferConnectionError.

        A stream or consumer group that vanished (a Redis restarted without persistence, a
        manual DEL) is recreated once, with a logged error, and the call retried.
        """
        try:
            return self._call_retrying(fn, *args, **kwargs)
        except redis.ResponseError as err:
            if "NOGROUP" not in str(err) and "no such key" not in str(err):
                raise
            log.error("stream %r or consumer group %r is missing (%s): recreating it", self.stream,
                      self.consumer_group, err)
            self._call_retrying(self._recreate)
            return self._call_retrying(fn, *args, **kwargs)

    def _call_retrying(self, fn: Callable[..., T], *args, **kwargs) -> T:
        try:
            for attempt in Retrying(
                stop=stop_after_attempt(self.retry_attempts),
                wait=wait_exponential(multiplier=0.1, max=2.0),
                retry=retry_if_exception(_retryable),
                reraise=True,
            ):
                with attempt:
                    return fn(*args, **kwargs)
        except redis.AuthenticationError as err:  # a ConnectionError in redis-py, but retrying cannot help
            raise BufferConnectionError(
                f"Redis at {redacted(self.url)} refused the connection: authentication failed ({err}); give its "
                "password in the URL, redis://:PASSWORD@host:port/0 (REDIS_URL, buffer.url)"
            ) from err
        except (redis.ConnectionError, redis.TimeoutError) as err:
            raise BufferConnectionError(
                f"cannot reach Redis at {redacted(self.url)} (stream {self.stream!r}) "
                f"after {self.retry_attempts} attempts: {err}"
            ) from err
        raise AssertionError("unreachable")

    def _create_group(self) -> None:
        try:
            # id 0: the group delivers every entry, including those put before it existed.
            self._redis.xgroup_create(self.stream, self.consumer_group, id="0", mkstream=True)
        except redis.exceptions.NoPermissionError:  # a read-only ACL user (`sinkflex.buffer.acl`): the group is made by others
            pass
        except redis.ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise

    def _migrate_trained(self) -> None:
        """An older buffer kept trained ids in a plain set: turn it into the scored set (ids by time)."""
        try:
            if _s(self._redis.type(self.trained_key)) != "set":
                return
        except redis.exceptions.NoPermissionError:
            return
        ids = [_s(m) for m in self._redis.smembers(self.trained_key)]
        now = time.time()
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(self.trained_key)
        if ids:
            pipe.zadd(self.trained_key, {g: now for g in ids})
        pipe.execute()
        log.info("trained-id set %r converted to a sorted set (%d ids)", self.trained_key, len(ids))

    def _recreate(self) -> None:
        if not self._redis.exists(self.stream):
            # Its entries went with it: none can be consumed, and a re-put must add them again.
            put_keys = list(self._redis.scan_iter(match=f"{self.stream}:put:*", count=1000))
            self._redis.delete(self.unconsumed_key, *put_keys)
        self._create_group()

    def close(self) -> None:
        """Closes the connection pool (the embedded server keeps running)."""
        self._redis.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- producer --------------------------------------------------------------------

    def put(self, group: common_pb2.TrajectoryGroup, timeout: float | None = None) -> str:
        """Appends one group; waits while the buffer is full (backpressure).

        Idempotent by `group.group_id` for `put_key_ttl_s`: putting the same group id again
        returns the first entry id and adds nothing (so retries never duplicate a group).

        Args:
            group: the TrajectoryGroup; `group_id` must be set.
            timeout: seconds to wait for room; None waits forever.

        Returns:
            the stream entry id.

        Raises:
            TypeError: `group` is not a TrajectoryGroup.
            ValueError: empty `group_id`.
            TimeoutError: still full after `timeout` s (the message says which bound).
            BufferConnectionError: Redis unreachable.
        """
        if not isinstance(group, common_pb2.TrajectoryGroup):
            raise TypeError(f"put expects a {PAYLOAD_TYPE}, got {type(group).__name__}")
        if not group.group_id:
            raise ValueError("TrajectoryGroup.group_id is empty: group ids make training idempotent")
        payload = group.SerializeToString()
        keys = [self.stream, self.unconsumed_key, f"{self.stream}:put:{group.group_id}"]
        keys.append(self.counts_key)
        args = [PAYLOAD_TYPE, group.group_id, payload, self.max_pending_groups, self.maxlen, self.put_key_ttl_s]
        # full: asked again after 5 ms, doubling to 100 ms, jittered, until `timeout`
        try:
            ok, value = Retrying(stop=stop_never if timeout is None else stop_after_delay(timeout),
                                 wait=wait_random_exponential(multiplier=0.005, max=0.1),
                                 retry=retry_if_result(lambda r: not r[0]))(self._call, self._put_script, keys=keys, args=args)
        except RetryError as err:
            _, value = err.last_attempt.result()
            raise TimeoutError(f"put of group {group.group_id!r} waited {timeout} s for room: {_s(value)}") from None
        return _s(value)

    # -- consumer --------------------------------------------------------------------

    def read(
        self,
        consumer: str,
        count: int = 1,
        block_ms: int = 1000,
        skip_group_ids: Iterable[str] = (),
    ) -> list[BufferEntry]:
        """Delivers up to `count` groups to `consumer`: reclaimed ones first, then new ones.

        First XAUTOCLAIM takes entries idle for over `claim_idle_ms` (their consumer died
        or stalled); then XREADGROUP ``>`` takes new entries, blocking up to `block_ms`.
        Entries whose group id is in the trained set or in `skip_group_ids` (e.g. from the
        learner's checkpoint) are acknowledged and dropped; so are duplicate group ids
        within one read. Malformed entries, and entries delivered more than `max_deliveries`
        times, go to the dead-letter stream, acknowledged, counted in `read_dead_letters`.

        Returns:
            at most `count` entries; [] when nothing came within `block_ms`.

        Raises:
            BufferConnectionError: Redis unreachable.
        """
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        skip = set(skip_group_ids)
        deadline = time.monotonic() + max(block_ms, 0) / 1000
        while consumer not in self._own_pending_taken:
            # this consumer's first reads in this process (or after `take_back`): entries still pending
            # for its name were delivered to a previous incarnation (a restart after a crash, a step
            # that raised) and are taken back now, oldest first, not after claim_idle_ms (a re-run
            # would otherwise train new groups and leave them behind)
            raw = self._call(self._own_pending, consumer, count)
            if not raw:
                self._own_pending_taken.add(consumer)
                self._own_cursor.pop(consumer, None)
                break
            self._own_cursor[consumer] = raw[-1][0]
            entries = self._accept(consumer, raw, skip)
            if entries:
                return entries
        while True:
            raw = self._call(self._claim, consumer, count)
            if len(raw) < count:
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                # Block at most claim_idle_ms at a time so that stale entries are reclaimed
                # promptly, and under the socket timeout.
                block = min(remaining_ms, self.claim_idle_ms, _MAX_BLOCK_MS) if (not raw and remaining_ms > 0) else None
                raw += self._call(self._read_new, consumer, count - len(raw), block)
            entries = self._accept(consumer, raw, skip)
            if entries or time.monotonic() >= deadline:
                return entries

    def _claim(self, consumer: str, count: int) -> list[tuple[str, dict | None, int]]:
        out: list[tuple[str, dict | None, int]] = []
        start = "0-0"
        while len(out) < count:
            reply = self._redis.xautoclaim(
                self.stream, self.consumer_group, consumer, self.claim_idle_ms, start_id=start, count=count - len(out)
            )
            start, claimed = _s(reply[0]), reply[1]
            for entry_id, fields in claimed:
                if entry_id is None:  # Redis 6.2: a pending entry deleted from the stream (no id)
                    continue
                entry_id = _s(entry_id)
                info = self._redis.xpending_range(self.stream, self.consumer_group, entry_id, entry_id, 1)
                deliveries = int(info[0]["times_delivered"]) if info else 0
                out.append((entry_id, fields, deliveries))
            if any(entry_id is None for entry_id, _ in claimed):
                out += self._deleted_pending(consumer, exclude={e[0] for e in out})
            if start == "0-0":
                break
        if out:
            log.warning("consumer %r reclaimed %d idle entries: %s", consumer, len(out), [e[0] for e in out])
        return out

    def _deleted_pending(self, consumer: str, exclude: set[str]) -> list[tuple[str, None, int]]:
        """Entries pending for `consumer` whose payload was deleted (XDEL) from the stream.

        Redis 6.2's XAUTOCLAIM returns such entries without their id; they are found here by
        id so that `_accept` can dead-letter and acknowledge them instead of reclaiming a
        nameless entry forever.
        """
        out: list[tuple[str, None, int]] = []
        for p in self._redis.xpending_range(self.stream, self.consumer_group, "-", "+", 10_000, consumername=consumer):
            entry_id = _s(p["message_id"])
            if entry_id not in exclude and not self._redis.xrange(self.stream, entry_id, entry_id):
                out.append((entry_id, None, int(p["times_delivered"])))
        return out

    def take_back(self, consumer: str) -> None:
        """The next `read`s of `consumer` deliver again, oldest first, every entry still pending
        for it (their delivery count goes up by one): what a learner calls after it rolled its
        state back to a checkpoint (a step that raised), as a restarted learner does at start."""
        self._own_pending_taken.discard(consumer)
        self._own_cursor.pop(consumer, None)

    def _own_pending(self, consumer: str, count: int) -> list[tuple[str, dict | None, int]]:
        """Entries pending for `consumer` (delivered to it, never acknowledged), oldest first,
        after the last one taken back (`_own_cursor`)."""
        after = self._own_cursor.get(consumer, "0")
        reply = self._redis.xreadgroup(self.consumer_group, consumer, {self.stream: after}, count=count)
        out = []
        for _stream, messages in reply or []:
            for entry_id, fields in messages:
                entry_id = _s(entry_id)
                if not fields:  # deleted from the stream: _claim's dead-letter path handles it
                    out.append((entry_id, None, -1))
                    continue
                info = self._redis.xpending_range(self.stream, self.consumer_group, entry_id, entry_id, 1)
                out.append((entry_id, fields, int(info[0]["times_delivered"]) if info else 1))
        if out:
            log.warning("consumer %r took back %d entries it had been delivered before a restart: %s", consumer,
                        len(out), [e[0] for e in out])
        return out

    def _read_new(self, consumer: str, count: int, block: int | None) -> list[tuple[str, dict | None, int]]:
        reply = self._redis.xreadgroup(self.consumer_group, consumer, {self.stream: ">"}, count=count, block=block)
        out = []
        for _stream, messages in reply or []:
            for entry_id, fields in messages:
                out.append((_s(entry_id), fields, 1))
        return out

    def _accept(self, consumer: str, raw, skip: set[str]) -> list[BufferEntry]:
        """Decodes delivered entries; dead-letters malformed ones; drops trained ones."""
        decoded: list[BufferEntry] = []
        for entry_id, fields, deliveries in raw:
            if deliveries < 0:  # a deleted entry seen while taking back (cursor only)
                continue
            group, reason = _decode(fields)
            if group is not None and deliveries > self.max_deliveries:
                group, reason = None, (
                    f"delivered {deliveries} times without being acknowledged (max_deliveries {self.max_deliveries}): "
                    "each attempt to train group " + repr(group.group_id) + " raised or stopped the learner")
            if group is None:
                self._call(self._dead_letter, consumer, entry_id, fields, reason)
                self.read_dead_letters += 1
            else:
                decoded.append(BufferEntry(entry_id, group, deliveries))
        if not decoded:
            return []
        gids = [e.group.group_id for e in decoded]
        trained = [s is not None for s in self._call(self._redis.zmscore, self.trained_key, gids)]
        keep: list[BufferEntry] = []
        drop: list[BufferEntry] = []
        seen: set[str] = set()
        for entry, is_trained in zip(decoded, trained):
            gid = entry.group.group_id
            if is_trained or gid in skip or gid in seen:
                drop.append(entry)
            else:
                seen.add(gid)
                keep.append(entry)
        if drop:
            log.info("skipping %d already-trained or duplicate groups: %s", len(drop), [e.group.group_id for e in drop])
            self.ack(drop, trained=False)
        return keep

    def _dead_letter(self, consumer: str, entry_id: str, fields: dict | None, reason: str) -> None:
        log.error("entry %s of stream %r is not a usable %s (%s): moved to %r",
                  entry_id, self.stream, PAYLOAD_TYPE, reason, self.dead_letter_stream)
        record: dict = {"source_stream": self.stream, "source_id": entry_id, "consumer": consumer, "reason": reason}
        for key, value in (fields or {}).items():
            record[f"field:{_s(key)}"] = value
        pipe = self._redis.pipeline(transaction=True)
        pipe.xadd(self.dead_letter_stream, record, maxlen=self.dead_letter_maxlen, approximate=True)
        pipe.xack(self.stream, self.consumer_group, entry_id)
        pipe.srem(self.unconsumed_key, entry_id)
        pipe.execute()

    def dead_letter(self, consumer: str, entries: Sequence[BufferEntry], reason: str) -> None:
        """Moves delivered entries the learner cannot train to the dead-letter stream with `reason`
        (their payload, source id and consumer kept), acknowledged: never delivered again, never
        recorded as trained, counted in `BufferStats.dead_letters`."""
        for e in entries:
            fields = {"type": PAYLOAD_TYPE, "group_id": e.group.group_id, "data": e.group.SerializeToString()}
            self._call(self._dead_letter, consumer, e.entry_id, fields, reason[:2000])

    def ack(self, entries: Sequence[BufferEntry], trained: bool = True) -> int:
        """Acknowledges entries and, if `trained`, records their group ids as trained.

        One MULTI/EXEC transaction: XACK + removal from the unconsumed set + SADD to the
        trained set, so a group is never acknowledged without being recorded (or the
        reverse). Call it after the optimiser step that used the groups is durable.

        Returns:
            how many entries were still pending (0 for entries acknowledged before, e.g. by
            a consumer that reclaimed them).
        """
        if not entries:
            return 0
        ids = [e.entry_id for e in entries]
        gids = [e.group.group_id for e in entries] if trained else []
        return int(self._call(
            self._ack_script,
            keys=[self.stream, self.unconsumed_key, self.trained_key],
            args=[self.consumer_group, self.keep_acked, self.trained_ttl_s, self.trained_max, time.time(), len(ids), *ids,
                  *gids],
        ))

    def touch(self, consumer: str, entries: Sequence[BufferEntry]) -> list[bool]:
        """Tells the buffer `consumer` is still working on `entries`; returns which it still owns.

        Resets the idle time of each entry still pending for `consumer`, so a step longer
        than `claim_idle_ms` keeps its groups if it touches them more often than that. An
        entry reported False was reclaimed by another consumer (or acknowledged): drop it
        from the batch before the optimiser step, or it may be trained twice.
        """
        if not entries:
            return []
        flags = self._call(
            self._touch_script,
            keys=[self.stream],
            args=[self.consumer_group, consumer, *[e.entry_id for e in entries]],
        )
        return [bool(f) for f in flags]

    def mark_trained(self, group_ids: Iterable[str]) -> None:
        """Records group ids as trained (e.g. from a restored checkpoint): never delivered again."""
        gids = list(group_ids)
        if gids:
            now = time.time()
            self._call(self._redis.zadd, self.trained_key, {g: now for g in gids})

    def trained(self, group_ids: Iterable[str]) -> set[str]:
        """The subset of `group_ids` recorded as trained."""
        gids = list(group_ids)
        if not gids:
            return set()
        scores = self._call(self._redis.zmscore, self.trained_key, gids)
        return {g for g, f in zip(gids, scores) if f is not None}

    # -- observability ---------------------------------------------------------------

    def stats(self) -> BufferStats:
        """A consistent snapshot (one MULTI/EXEC) of lengths and counts; see `BufferStats`."""

        def run() -> BufferStats:
            pipe = self._redis.pipeline(transaction=True)
            pipe.xlen(self.stream)
            pipe.smembers(self.unconsumed_key)
            pipe.xinfo_groups(self.stream)
            pipe.zcard(self.trained_key)
            pipe.xlen(self.dead_letter_stream)
            pipe.time()
            pipe.hget(self.counts_key, "added")
            length, unconsumed_ids, groups, trained, dead, (now_s, now_us), added = pipe.execute()
            info = next((g for g in groups if _s(g["name"]) == self.consumer_group), None)
            pending = int(info["pending"]) if info else 0
            consumers = int(info["consumers"]) if info else 0
            ids = [_s(i) for i in unconsumed_ids]
            age = 0.0
            if ids:
                age = max(0.0, now_s + now_us / 1e6 - min(_entry_ms(i) for i in ids) / 1000)
            return BufferStats(
                stream_length=int(length),
                unconsumed=len(ids),
                pending=pending,
                undelivered=max(len(ids) - pending, 0),
                consumers=consumers,
                trained=int(trained),
                dead_letters=int(dead),
                oldest_unconsumed_age_s=age,
                added=int(added or 0),
            )

        stats = self._call(run)
        used, limit = self._memory()
        stats = dataclasses.replace(stats, memory_used_bytes=used, memory_max_bytes=limit)
        if limit and used >= self.memory_warn_fraction * limit:
            log.warning("Redis at %s uses %.0f%% of its maxmemory (%d of %d bytes): with noeviction, put() fails "
                        "once it is full; raise maxmemory or lower max_pending_groups / keep_acked",
                        redacted(self.url), 100 * used / limit, used, limit)
        return stats

    def _memory(self) -> tuple[int, int]:
        """(used_memory, maxmemory) from INFO memory; (0, 0) when this user may not run INFO."""
        try:
            info = self._call(self._redis.info, "memory")
        except redis.ResponseError:  # NOPERM: an ACL user without INFO
            return 0, 0
        return int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))

    def dead_letters(self, count: int = 100) -> list[dict[str, str | bytes]]:
        """The oldest `count` dead-letter records: source_id, reason, consumer, raw fields."""
        out = []
        for entry_id, fields in self._call(self._redis.xrange, self.dead_letter_stream, count=count):
            record = {_s(k): (v if _s(k).startswith("field:") else _s(v)) for k, v in fields.items()}
            record["dead_letter_id"] = _s(entry_id)
            out.append(record)
        return out

    def delete(self) -> None:
        """Deletes the stream, its consumer group and every derived key (tests, resets)."""

        def run() -> None:
            put_keys = list(self._redis.scan_iter(match=f"{self.stream}:put:*", count=1000))
            self._redis.delete(self.stream, self.unconsumed_key, self.trained_key, self.dead_letter_stream,
                               self.counts_key, *put_keys)

        self._call(run)


def _decode(fields: dict | None) -> tuple[common_pb2.TrajectoryGroup | None, str]:
    """(group, "") for a well-formed entry, else (None, reason)."""
    if fields is None:
        return None, "entry was deleted from the stream before it was acknowledged (payload lost)"
    fields = {_s(k): v for k, v in fields.items()}
    kind = _s(fields.get("type", b""))
    if kind != PAYLOAD_TYPE:
        return None, f"field 'type' is {kind!r}, expected {PAYLOAD_TYPE!r}"
    if "data" not in fields:
        return None, "no 'data' field"
    group = common_pb2.TrajectoryGroup()
    try:
        group.ParseFromString(fields["data"])
    except Exception as err:  # noqa: BLE001 — DecodeError usually; anything else must not block the stream
        return None, f"'data' is not a serialized {PAYLOAD_TYPE}: {type(err).__name__}: {err}"
    if not group.group_id:
        return None, "decoded group has an empty group_id"
    declared = _s(fields.get("group_id", b""))
    if declared != group.group_id:
        return None, f"field 'group_id' {declared!r} differs from the payload's {group.group_id!r}"
    return group, ""
