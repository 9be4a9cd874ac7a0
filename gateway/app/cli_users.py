"""`tokenway users token NAME`: a fresh API token for an operator of `server.users`, printed once with
the gateway.yaml entry that holds only its SHA-256 (docs/security.md#roles-and-user-tokens).

Offline on purpose: users live in gateway.yaml (reviewed, versioned, one file for every replica), so
minting a token changes nothing until the entry is added and the gateway restarted.
"""

from __future__ import annotations

import argparse
import hashlib
import secrets
from typing import Any

import yaml

TOKEN_PREFIX = "twu-"  # tells a user token from an API key (tw-) in a log or a secret store


def mint() -> tuple[str, str]:
    """A new token (256 random bits) and its SHA-256 hex digest."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    return token, hashlib.sha256(token.encode("utf-8")).hexdigest()


def users_token(args: argparse.Namespace) -> int:
    token, digest = mint()
    entry: dict[str, Any] = {"name": args.name, "role": args.role}
    if args.teams:
        entry["teams"] = [t.strip() for t in args.teams.split(",") if t.strip()]
    entry["tokens_sha256"] = [digest]
    print(f"token (shown once; give it to {args.name}): {token}")
    print("gateway.yaml, under server.users (or add the digest to an existing user's tokens_sha256):")
    print(yaml.safe_dump([entry], sort_keys=False).rstrip())
    return 0


def add_parsers(sub: Any) -> None:
    users = sub.add_parser("users", help="operators with roles (server.users)")
    users_sub = users.add_subparsers(dest="users_command", required=True)
    token = users_sub.add_parser("token", help="a new API token for a user: prints it once and its YAML entry")
    token.add_argument("name")
    token.add_argument("--role", choices=["admin", "team_admin", "viewer"], default="viewer")
    token.add_argument("--teams", help="comma-separated teams of a team_admin")
    token.set_defaults(func=users_token)
