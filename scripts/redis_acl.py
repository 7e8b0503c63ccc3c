"""`python scripts/redis_acl.py DIR [--stream S] [--redis-major N] [--redis-minor M]`: Redis users per role for the trajectory buffer.

Writes, with random passwords (32 characters, `secrets`), DIR/admin-password,
DIR/producer-password, DIR/consumer-password, DIR/reader-password (mode 0644: the containers'
uids read them; keep DIR private) and DIR/users.acl, the ACL file that holds only their SHA-256
hashes (`sinkflex.buffer.acl.acl_file`): the `default` user with the admin password and all
rights, `producer` (the rollout service), `consumer` (the learner), `reader` (the driver). An
existing password file is kept, so re-running rewrites users.acl without changing passwords.

Run Redis with `--aclfile DIR/users.acl` (no `--requirepass`: no password on a command line)
and give each process its user: REDIS_USERNAME=<role>, REDIS_PASSWORD_FILE=<its password file>,
REDIS_URL=redis://host:6379/0. The Helm chart makes the same from its Secret.
--redis-major / --redis-minor: the server's version (default 7.4, compose's redis:7.4-alpine);
`--redis-minor 0` for Debian 12's redis-server 7.0 (scripts/build_images.sh's Redis image),
which refuses an ACL naming CLIENT SETINFO (sinkflex.buffer.acl.has_client_setinfo).
"""

from __future__ import annotations

import argparse
import os
import secrets
import string
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sinkflex.buffer.acl import ROLES, acl_file  # noqa: E402


def _password(path: Path) -> str:
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    value = "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(32))
    path.write_text(value + "\n")
    os.chmod(path, 0o644)
    return value


def write_acl(folder: Path, stream: str = "sinkflex:groups", redis_major: int = 7, redis_minor: int = 4) -> dict[str, str]:
    """Writes the password files and users.acl into `folder`; returns role -> password (admin included)."""
    folder.mkdir(parents=True, exist_ok=True)
    passwords = {role: _password(folder / f"{role}-password") for role in ("admin", *ROLES)}
    text = acl_file({r: passwords[r] for r in ROLES}, stream, admin_password=passwords["admin"], redis_major=redis_major,
                    redis_minor=redis_minor)
    (folder / "users.acl").write_text(text)
    os.chmod(folder / "users.acl", 0o644)
    return passwords


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--stream", default="sinkflex:groups", help="the buffer's stream (learner.buffer.stream)")
    parser.add_argument("--redis-major", type=int, default=7, help="the Redis server's major version (7: ACL selectors)")
    parser.add_argument("--redis-minor", type=int, default=4,
                        help="the Redis server's minor version (7.0 and 7.1 have no CLIENT SETINFO)")
    args = parser.parse_args(argv)
    write_acl(args.folder, args.stream, args.redis_major, args.redis_minor)
    print(f"wrote {args.folder}/users.acl and " + ", ".join(f"{r}-password" for r in ("admin", *ROLES)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
