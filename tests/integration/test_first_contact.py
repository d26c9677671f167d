"""What a newcomer meets in the first minutes, run for real: publish through a server, the startup line,
the API description, the refusal lines of the log."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.support import BIN, BrokerProcess, wait_until


def clean_env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("MCP_BROKER_")}, **extra}


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN), *args], capture_output=True, text=True, timeout=60, env=clean_env(**env),
                          check=False)


def test_publish_through_a_server_publishes_for_the_tenant_of_the_key() -> None:
    with BrokerProcess(env={"MCP_BROKER_API_KEYS": '{"acme-key": "acme/alice", "beta-key": "beta/bob"}'}) as broker:
        done = run_cli("publish", "--url", broker.url, "--key", "acme-key", "mcpb://acme/notes/1")
        assert done.returncode == 0 and done.stdout.strip(), done.stderr
        # Another tenant's key: the server refuses it, and says why.
        refused = run_cli("publish", "--url", broker.url, "--key", "beta-key", "mcpb://acme/notes/1")
        assert refused.returncode == 2 and "namespace of tenant 'acme'" in refused.stderr
        assert "'beta'" in refused.stderr


def test_the_startup_line_says_stored_keys_are_accepted_when_the_settings_name_none(tmp_path: Path) -> None:
    log = tmp_path / "broker.log"
    with BrokerProcess(env={"MCP_BROKER_AUTH": "keys"}, log=log, log_level="info"):
        wait_until(lambda: b"backend memory" in log.read_bytes(), what="the startup line")
    line = next(line for line in log.read_text().splitlines() if "backend memory" in line)
    assert "auth stored API keys," in line and "0 API keys" not in line
