"""``serve --config FILE`` and ``config check``, run for real: what a process does with a settings file."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx

from tests.support import BIN, BrokerProcess, free_port, wait_until


def clean_env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("MCP_BROKER_")}, **extra}


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN), *args], capture_output=True, text=True, timeout=60, env=clean_env(**env),
                          check=False)


def test_serve_listens_where_the_file_says_and_the_environment_wins_over_it(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "broker.toml"
    config.write_text(f'port = {port}\nserver_name = "from-the-file"\nmax_sessions = 1\n')
    proc = subprocess.Popen([str(BIN), "serve", "--config", str(config)], env=clean_env(MCP_BROKER_MAX_SESSIONS="2"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: httpx.get(url + "/healthz", timeout=1).status_code == 200, what="broker start")
        headers = {"accept": "application/json, text/event-stream", "content-type": "application/json"}
        initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                      "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                                 "clientInfo": {"name": "t", "version": "1"}}}
        answers = [httpx.post(url + "/mcp", headers=headers, json=initialize) for _ in range(3)]
        assert answers[0].json()["result"]["serverInfo"]["name"] == "from-the-file"
        # max_sessions: 2 from the environment, not 1 from the file.
        assert [a.status_code for a in answers] == [200, 200, 503]
    finally:
        proc.terminate()
        proc.wait(15)


def test_a_bad_value_in_the_file_stops_serve_with_one_line_naming_the_file_and_the_key(tmp_path: Path) -> None:
    config = tmp_path / "broker.toml"
    config.write_text('redis_url = "mysql://db:3306"\n')
    for done in (run_cli("serve", "--config", str(config)), run_cli("serve", MCP_BROKER_CONFIG=str(config))):
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr
        assert f"{config}: redis_url: " in lines[0] and "Traceback" not in done.stderr
    config.write_text("max_sesions = 10\n")
    done = run_cli("serve", "--config", str(config))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"mcp-broker: bad setting, not started: {config}: max_sesions is not a setting; did you mean max_sessions?"]


def test_config_check_prints_the_effective_settings_with_secrets_masked(tmp_path: Path) -> None:
    config = tmp_path / "broker.toml"
    config.write_text('api_keys = {"k3y-s3cr3t" = "acme/alice"}\nredis_url = "redis://:r3d1s-pw@db:6379/0"\n'
                      "max_sessions = 5\n")
    done = run_cli("config", "check", "--config", str(config), MCP_BROKER_MAX_SESSIONS="6",
                   MCP_BROKER_OAUTH_CLIENT_SECRET="0auth-s3cr3t")
    assert done.returncode == 0, done.stderr
    assert "k3y-s3cr3t" not in done.stdout and "r3d1s-pw" not in done.stdout and "0auth-s3cr3t" not in done.stdout
    lines = done.stdout.splitlines()
    assert "max_sessions = 6  # MCP_BROKER_MAX_SESSIONS" in lines
    assert f'redis_url = "redis://:***@db:6379/0"  # {config}: redis_url' in lines
    assert 'oauth_client_secret = "***"  # MCP_BROKER_OAUTH_CLIENT_SECRET' in lines
    bad = run_cli("config", "check", "--config", str(config), MCP_BROKER_PORT="abc")
    assert bad.returncode == 2 and bad.stdout == "" and len(bad.stderr.strip().splitlines()) == 1
    assert "MCP_BROKER_PORT" in bad.stderr


def test_serve_options_win_over_the_file(tmp_path: Path) -> None:
    config = tmp_path / "broker.toml"
    config.write_text(f"port = {free_port()}\n")
    with BrokerProcess(args=["--config", str(config)]) as broker:  # it gives --port: that one is served
        assert httpx.get(broker.url + "/healthz").status_code == 200
