"""Redis ACL users of the trajectory buffer, one per role (least privilege).

- ``producer`` (the rollout service): adds groups (the put script: XADD, XTRIM, SADD, SET,
  HINCRBY ...) and reads the buffer's sizes; it cannot read or acknowledge an entry.
- ``consumer`` (the learner): reads (XREADGROUP, XAUTOCLAIM), acknowledges (the ack script:
  XACK, XDEL of acknowledged history, the trained-id set) and dead-letters (XADD to
  ``<stream>:dead`` only, on Redis >= 7, where ACL selectors can say so); it cannot add a group.
- ``reader`` (the driver, dashboards): the read-only commands `TrajectoryBuffer.stats` needs.

Every user is limited to the buffer's keys (``<stream>`` and ``<stream>:*``) and to no pub/sub
channel; none may run FLUSHALL, CONFIG, KEYS, DEBUG, ACL or anything else outside its list.
Passwords are never on a command line: `acl_file` writes an ACL file (``aclfile`` in
redis.conf, or ``--aclfile``) holding only their SHA-256 hashes, and a process gives its user
with `TrajectoryBuffer(username=..., password_file=...)` or the environment variables
REDIS_USERNAME and REDIS_PASSWORD_FILE (a mounted secret). `apply_acl` creates the users on a
running server through an admin connection (tests, the embedded server).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

ROLES = ("producer", "consumer", "reader")

#: Commands every role needs: connection set-up, scripts (their commands are checked against
#: the same user), and the reads of `TrajectoryBuffer.stats` and the constructor.
_COMMON = ["+ping", "+multi", "+exec", "+discard", "+hello", "+auth", "+client|setname", "+client|setinfo", "+client|id", "+select", "+info",
           "+time", "+exists", "+type", "+xlen", "+xinfo|groups", "+xinfo|stream", "+smembers", "+scard",
           "+sismember", "+smismember", "+zcard", "+zmscore", "+zscore", "+hget", "+hgetall", "+get"]
_SCRIPTS = ["+evalsha", "+eval", "+script|load", "+script|exists"]
_PRODUCER = ["+xadd", "+xtrim", "+sadd", "+set", "+hincrby", "+xgroup|create"]
_CONSUMER = ["+xreadgroup", "+xautoclaim", "+xclaim", "+xpending", "+xrange", "+xack", "+xdel", "+srem", "+zadd",
             "+zremrangebyscore", "+zremrangebyrank", "+del", "+xgroup|create"]


def has_client_setinfo(redis_major: int, redis_minor: int) -> bool:
    """Whether an ACL may name CLIENT SETINFO (redis-py sends it on connect and ignores its
    error): the command exists from Redis 7.2; 7.0 and 7.1 refuse an ACL naming it ("Unknown
    command or category name in ACL": Debian 12's redis-server is 7.0); 6.x does not check
    subcommand names."""
    return not (redis_major == 7 and redis_minor < 2)


def acl_rules(role: str, stream: str = "sinkflex:groups", redis_major: int = 7, redis_minor: int = 4) -> list[str]:
    """The ACL SETUSER rules (without password) of `role` on the buffer `stream`.

    `redis_major` >= 7: the consumer's XADD is confined to the dead-letter stream with a
    selector; on 6.2 (the embedded server) XADD is allowed on the buffer's keys. CLIENT
    SETINFO is allowed where the server knows it (`has_client_setinfo`).

    Raises:
        ValueError: an unknown role.
    """
    if role not in ROLES:
        raise ValueError(f"unknown buffer role {role!r}; one of {', '.join(ROLES)}")
    common = _COMMON if has_client_setinfo(redis_major, redis_minor) else [r for r in _COMMON if r != "+client|setinfo"]
    rules = ["reset", "on", f"~{stream}", f"~{stream}:*", "resetchannels", "-@all", *common]
    if role == "producer":
        rules += [*_SCRIPTS, *_PRODUCER]
    elif role == "consumer":
        rules += [*_SCRIPTS, *_CONSUMER]
        rules += [f"(+xadd ~{stream}:dead)"] if redis_major >= 7 else ["+xadd"]
    return rules


def password_hash(password: str) -> str:
    """The ACL file's form of a password: ``#`` + its SHA-256 in hex."""
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def acl_file(passwords: Mapping[str, str], stream: str = "sinkflex:groups", admin_password: str | None = None,
             redis_major: int = 7, redis_minor: int = 4) -> str:
    """An ACL file: one line per role in `passwords` (role -> password, stored hashed), and the
    ``default`` user: all rights with `admin_password` (hashed), or off when None."""
    lines = []
    if admin_password is None:
        lines.append("user default off")
    else:
        lines.append(f"user default on {password_hash(admin_password)} ~* &* +@all")
    for role, password in passwords.items():
        rules = [r for r in acl_rules(role, stream, redis_major, redis_minor) if r != "reset"]
        lines.append(f"user {role} {' '.join(rules)} {password_hash(password)}")
    return "\n".join(lines) + "\n"


def apply_acl(admin_client, passwords: Mapping[str, str], stream: str = "sinkflex:groups") -> None:
    """Creates (or resets) the role users on a running server through `admin_client` (a
    `redis.Redis` with ACL rights)."""
    major, minor = (int(x) for x in str(admin_client.info("server")["redis_version"]).split(".")[:2])
    for role, password in passwords.items():
        admin_client.execute_command("ACL", "SETUSER", role, *acl_rules(role, stream, major, minor), f">{password}")
