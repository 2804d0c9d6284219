"""`pagemesh secrets DIR`: the secrets a deployed mesh shares, as files for compose and
Kubernetes secrets (docs/security.md, "Running a shared mesh").

- `redis-password`: the password of the Valkey user `pagemesh`; the services read it from
  the file PAGEMESH_REDIS_PASSWORD_FILE names.
- `valkey.acl`: Valkey's ACL file (`--aclfile`): that user with the password's SHA-256 (no
  secret in it), and a default user that may only PING, for health checks.
- `internal-token`: the token schedulers and workers require of every call
  (PAGEMESH_INTERNAL_TOKEN_FILE).

`pagemesh up` needs none of them: it makes its own for each run.
"""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path

from pagemesh.tools.embedded_valkey import valkey_acl

REDIS_PASSWORD = "redis-password"
VALKEY_ACL = "valkey.acl"
INTERNAL_TOKEN = "internal-token"


def write_secrets(folder: Path) -> dict[str, Path]:
    """Writes the three files in `folder` (made if missing); refuses to replace any."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {name: folder / name for name in (REDIS_PASSWORD, VALKEY_ACL, INTERNAL_TOKEN)}
    present = [str(path) for path in paths.values() if path.exists()]
    if present:
        raise SystemExit(
            f"pagemesh secrets: {', '.join(present)} exist already; a mesh "
            "running with them would be locked out by new ones: remove them first"
        )
    password = secrets.token_urlsafe(32)
    contents = {
        REDIS_PASSWORD: password + "\n",
        VALKEY_ACL: valkey_acl(password),
        INTERNAL_TOKEN: secrets.token_urlsafe(32) + "\n",
    }
    for name, path in paths.items():
        # The ACL holds only a hash: readable by Valkey's own user (uid 999 in its image).
        mode = 0o644 if name == VALKEY_ACL else 0o600
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(descriptor, "w") as file:
            file.write(contents[name])
    return paths


def run_secrets(args: argparse.Namespace) -> int:
    folder = Path(args.folder)
    write_secrets(folder)
    print(
        f"wrote {folder}/{{{REDIS_PASSWORD},{VALKEY_ACL},{INTERNAL_TOKEN}}}\n"
        f"  compose:    SECRETS_DIR={folder.resolve()} in .env (the images run as uid 1000:\n"
        f"              `sudo chown 1000 {folder}/{REDIS_PASSWORD} {folder}/{INTERNAL_TOKEN}`"
        " if yours differs)\n"
        f"  Kubernetes: kubectl -n pagemesh create secret generic pagemesh-mesh "
        f"--from-file={folder}"
    )
    return 0


def add_secrets_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "secrets",
        help="write the secrets a deployed mesh shares (Redis "
        "password and ACL, internal token) for compose or Kubernetes",
    )
    parser.add_argument("folder", help="where to write them (made if missing)")
    parser.set_defaults(func=run_secrets)
