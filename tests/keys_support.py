"""``mcp-broker keys ...`` run for real, as a subprocess, for the tiers that test runtime API keys."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from typing import Any

from tests.support import BIN


@dataclass(frozen=True)
class Key:
    key: str
    id: str
    view: dict[str, Any]


def keys_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``mcp-broker keys <args>`` with the broker's settings in ``env`` (the Redis its workers use)."""
    return subprocess.run([str(BIN), "keys", *args], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=60, check=False)


def create_key(env: dict[str, str], tenant: str, subject: str, *extra: str) -> Key:
    done = keys_cli(env, "create", "--tenant", tenant, "--subject", subject, "--json", *extra)
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout)
    return Key(view.pop("key"), view["id"], view)


def revoke_key(env: dict[str, str], key_id: str) -> None:
    done = keys_cli(env, "revoke", key_id)
    assert done.returncode == 0, done.stderr
