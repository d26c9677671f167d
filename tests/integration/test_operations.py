"""What operators meet first: probes, the SIGTERM order, logs, CORS, settings that fail fast, the CLI.

Real ``mcp-broker`` processes on free ports; Redis where an outage is the point.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.support import BIN, BrokerProcess, RedisProcess, wait_until

ORIGIN = "http://localhost:3000"  # among the default allowed origins (localhost, any port)


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without any MCP_BROKER_ setting of the caller's, plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("MCP_BROKER_")}, **extra}


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN), *args], capture_output=True, text=True, timeout=60, env=clean_env(**env),
                          check=False)


# -- probes -------------------------------------------------------------------------------------
def test_readyz_fails_from_the_first_moment_of_a_sigterm_while_the_worker_still_serves() -> None:
    with BrokerProcess(env={"MCP_BROKER_READINESS_DELAY": "3"}) as broker:
        assert httpx.get(broker.url + "/readyz").status_code == 200
        broker.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(broker.url + "/readyz", timeout=1).status_code == 503, what="readyz 503",
                   timeout=2)
        # Still serving during the delay: liveness, and real work.
        assert httpx.get(broker.url + "/livez").status_code == 200
        put = httpx.put(broker.url + "/collections/c/1", json={"v": 1})
        assert put.status_code == 201
        assert broker.proc.wait(20) in (0, -signal.SIGTERM)  # uvicorn ends by re-raising the signal


def test_livez_stays_up_through_a_redis_outage_and_readyz_follows_redis() -> None:
    redis = RedisProcess()  # started
    try:
        env = {"MCP_BROKER_REDIS_URL": f"redis://127.0.0.1:{redis.port}/0", "MCP_BROKER_REDIS_SOCKET_TIMEOUT": "1",
               "MCP_BROKER_REDIS_CONNECT_TIMEOUT": "0.5"}
        with BrokerProcess(env=env) as broker:
            assert httpx.get(broker.url + "/readyz").status_code == 200
            redis.stop()
            wait_until(lambda: httpx.get(broker.url + "/readyz", timeout=5).status_code == 503, what="readyz 503")
            assert httpx.get(broker.url + "/livez", timeout=5).status_code == 200
            redis.start()
            wait_until(lambda: httpx.get(broker.url + "/readyz", timeout=5).status_code == 200, what="readyz back",
                       timeout=30)
    finally:
        redis.stop()


def test_probes_answer_whatever_the_host_while_the_api_does_not() -> None:
    with BrokerProcess() as broker:
        for path in ("/livez", "/readyz"):
            assert httpx.get(broker.url + path, headers={"host": "10.1.2.3:8080"}).status_code == 200
        assert httpx.get(broker.url + "/collections", headers={"host": "10.1.2.3:8080"}).status_code == 421


# -- logs ---------------------------------------------------------------------------------------
def test_the_recovery_after_a_redis_outage_is_logged(tmp_path: Path) -> None:
    redis = RedisProcess()  # started
    log = tmp_path / "broker.log"
    try:
        env = {"MCP_BROKER_REDIS_URL": f"redis://127.0.0.1:{redis.port}/0", "MCP_BROKER_REDIS_SOCKET_TIMEOUT": "1",
               "MCP_BROKER_REDIS_CONNECT_TIMEOUT": "0.5"}
        with BrokerProcess(env=env, log=log, log_level="info") as broker:
            redis.stop()
            wait_until(lambda: httpx.get(broker.url + "/readyz", timeout=5).status_code == 503, what="the outage")
            redis.start()
            # By fan-out, which every worker runs: a worker with no stream open has no pub/sub
            # connection to re-make.
            wait_until(lambda: b"fan-out resumed" in log.read_bytes(), what="the recovery logged", timeout=30)
    finally:
        redis.stop()
    line = next(line for line in log.read_text().splitlines() if "fan-out resumed" in line)
    assert " INFO " in line and "broker.fanout" in line and "the backend answers again" in line


def test_log_format_json_makes_every_line_a_json_object(tmp_path: Path) -> None:
    log = tmp_path / "broker.log"
    with BrokerProcess(env={"MCP_BROKER_LOG_FORMAT": "json"}, log=log, log_level="info") as broker:
        assert httpx.get(broker.url + "/collections", headers={"origin": "https://evil.example"}).status_code == 403
        wait_until(lambda: b"refused a request" in log.read_bytes(), what="the refusal logged")
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    assert all({"time", "level", "logger", "pid", "message"} <= set(r) for r in records)
    assert any(r["message"].startswith("mcp-broker ") and "backend memory" in r["message"] for r in records)
    assert any("refused a request to api with 403" in r["message"] for r in records)


# -- CORS and the API description ------------------------------------------------------------------
def test_a_preflight_from_an_allowed_origin_is_answered_and_another_is_refused() -> None:
    asked = {"access-control-request-method": "POST",
             "access-control-request-headers": "content-type, mcp-session-id, mcp-protocol-version"}
    with BrokerProcess() as broker:
        ok = httpx.options(broker.url + "/mcp", headers={"origin": ORIGIN, **asked})
        assert ok.status_code == 204 and ok.headers["access-control-allow-origin"] == ORIGIN
        assert {"mcp-session-id", "mcp-protocol-version", "content-type"} <= {
            h.strip() for h in ok.headers["access-control-allow-headers"].split(",")}
        refused = httpx.options(broker.url + "/mcp", headers={"origin": "https://evil.example", **asked})
        assert refused.status_code == 403 and "access-control-allow-origin" not in refused.headers
        headers = {"origin": ORIGIN, "accept": "application/json, text/event-stream",
                   "content-type": "application/json"}
        answer = httpx.post(broker.url + "/mcp", headers=headers,
                            json={"jsonrpc": "2.0", "id": 1, "method": "initialize",
                                  "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                                             "clientInfo": {"name": "t", "version": "1"}}})
        assert answer.headers["access-control-allow-origin"] == ORIGIN
        assert "Mcp-Session-Id" in answer.headers["access-control-expose-headers"]


def test_the_api_description_is_served_only_when_asked_for() -> None:
    with BrokerProcess() as broker:
        assert httpx.get(broker.url + "/openapi.json").status_code == 404
        assert httpx.get(broker.url + "/docs").status_code == 404
    with BrokerProcess(env={"MCP_BROKER_DOCS": "true"}) as broker:
        assert httpx.get(broker.url + "/openapi.json").status_code == 200


# -- settings that fail fast ------------------------------------------------------------------------
@pytest.mark.parametrize(("env", "named"), [
    ({"MCP_BROKER_API_KEYS": "{not json"}, "MCP_BROKER_API_KEYS"),
    ({"MCP_BROKER_API_KEYS": '{"k": "alice"}'}, "MCP_BROKER_API_KEYS"),
    ({"MCP_BROKER_REDIS_URL": "mysql://db:3306"}, "MCP_BROKER_REDIS_URL"),
    ({"MCP_BROKER_ALLOWED_ORIGINS": '["app.example.com"]'}, "MCP_BROKER_ALLOWED_ORIGINS"),
    ({"MCP_BROKER_REDISURL": "redis://127.0.0.1:6379"}, "did you mean MCP_BROKER_REDIS_URL"),
    ({"MCP_BROKER_LOG_FORMAT": "xml"}, "MCP_BROKER_LOG_FORMAT"),
])
def test_a_bad_setting_stops_every_command_with_one_line_per_setting(env: dict[str, str], named: str) -> None:
    for command in (["serve"], ["stdio"], ["publish", "x:y"]):
        done = run_cli(*command, **env)
        assert done.returncode == 2, (command, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and named in lines[0] and "Traceback" not in done.stderr, done.stderr


def test_two_bad_settings_get_a_line_each() -> None:
    done = run_cli("serve", MCP_BROKER_PORT="abc", MCP_BROKER_SHUTDOWN_DRAIN="-1")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 2
    assert any("MCP_BROKER_PORT" in line for line in lines) and any("MCP_BROKER_SHUTDOWN_DRAIN" in line
                                                                   for line in lines)


# -- the CLI ----------------------------------------------------------------------------------------
def test_publish_never_reports_success_for_a_change_nobody_could_receive() -> None:
    done = run_cli("publish", "x:y")  # the memory backend: a private broker in this command's own process
    assert done.returncode == 2 and done.stdout == ""
    assert "--url" in done.stderr and "MCP_BROKER_REDIS_URL" in done.stderr
    assert run_cli("fanout").returncode == 2


def test_publish_through_a_running_server_reaches_its_subscribers() -> None:
    with BrokerProcess() as broker:
        done = run_cli("publish", "x:y", "--url", broker.url, "--meta", '{"v": 1}')
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip()  # the change's id
        refused = run_cli("publish", "mcpb://other/c/1", "--url", broker.url)
        assert refused.returncode == 2 and "namespace of tenant 'other'" in refused.stderr
    unreachable = run_cli("publish", "x:y", "--url", broker.url)
    assert unreachable.returncode == 75 and unreachable.stdout == ""


def test_version_and_help_name_the_settings() -> None:
    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("mcp-broker ")
    helped = " ".join(run_cli("serve", "--help").stdout.split())
    assert "(env MCP_BROKER_HOST) (default: 127.0.0.1)" in helped and "(env MCP_BROKER_PORT)" in helped


def test_a_started_worker_says_its_configuration_in_one_line_with_no_secret(tmp_path: Path) -> None:
    log = tmp_path / "broker.log"
    keys = '{"s3cr3t-key": "acme/alice"}'
    with BrokerProcess(env={"MCP_BROKER_API_KEYS": keys}, log=log, log_level="info"):
        wait_until(lambda: b"backend memory" in log.read_bytes(), what="the startup line")
    text = log.read_text()
    line = next(line for line in text.splitlines() if "backend memory" in line)
    assert "1 API keys" in line and "s3cr3t" not in text
