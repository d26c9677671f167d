"""The shipped container settings keep the DNS-rebinding defence on, and ``serve`` says when it is off."""

from __future__ import annotations

import logging
import shlex
from collections.abc import Callable

import pytest
import yaml

from broker import cli
from broker.config import Settings
from broker.runtime.server import BrokerServer
from broker.transport.guards import HostPolicy
from tests.support import ROOT


def image_env() -> dict[str, str]:
    """Every ``ENV`` of the Dockerfile, read the way Docker's lexer reads it."""
    env: dict[str, str] = {}
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("ENV "):
            env.update(word.partition("=")[::2] for word in shlex.split(line[4:]))
    return env


def compose_env() -> dict[str, str]:
    """A compose worker's environment: the image's, with the compose file's over it."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    return {**image_env(), **{k: str(v) for k, v in services["broker1"]["environment"].items()}}


def settings_from(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return Settings()


@pytest.mark.parametrize("env", [image_env, compose_env], ids=["image", "compose"])
def test_the_shipped_containers_answer_only_to_the_names_they_are_reached_by(
    env: Callable[[], dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = settings_from(env(), monkeypatch)
    assert settings.host == "0.0.0.0"
    hosts = HostPolicy(settings.allowed_hosts, settings.host)
    assert hosts.allows("localhost") and hosts.allows("localhost:8080") and hosts.allows("127.0.0.1:8080")
    assert not hosts.allows("rebound.attacker.example") and not hosts.allows("rebound.attacker.example:8080")
    assert cli.rebinding_warning(settings) is None


@pytest.mark.parametrize("bind", ["0.0.0.0", "::", "10.0.0.5", "broker.internal"])
def test_a_non_loopback_bind_open_to_any_host_without_keys_is_warned_about(bind: str) -> None:
    warning = cli.rebinding_warning(Settings(host=bind))
    assert warning is not None
    assert "MCP_BROKER_ALLOWED_HOSTS" in warning and bind in warning


@pytest.mark.parametrize("settings", [
    Settings(host="127.0.0.1"),
    Settings(host="localhost"),
    Settings(host="::1"),
    Settings(host="0.0.0.0", allowed_hosts=["broker.example.com"]),
    Settings(host="0.0.0.0", allowed_hosts=["*"]),  # an explicit choice
    Settings(host="0.0.0.0", api_keys={"k": "acme/alice"}),
], ids=["loopback", "localhost", "ipv6-loopback", "host-list", "explicit-any", "api-keys"])
def test_no_warning_when_the_host_check_or_keys_protect_the_server(settings: Settings) -> None:
    assert cli.rebinding_warning(settings) is None


def test_serve_warns_once_at_start_when_open_to_rebinding(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name in ("MCP_BROKER_HOST", "MCP_BROKER_PORT", "MCP_BROKER_ALLOWED_HOSTS", "MCP_BROKER_API_KEYS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MCP_BROKER_HOST", "0.0.0.0")  # restored after the test, which serve overwrites
    monkeypatch.setenv("MCP_BROKER_PORT", "8080")
    monkeypatch.setattr(BrokerServer, "run", lambda self, sockets=None: None)
    with caplog.at_level(logging.WARNING, logger="broker.cli"):
        assert cli.main(["serve", "--host", "0.0.0.0"]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == "broker.cli"]
    assert len(warnings) == 1 and "MCP_BROKER_ALLOWED_HOSTS" in warnings[0], warnings


def test_a_bad_serve_setting_stops_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MCP_BROKER_HOST", "127.0.0.1")
    monkeypatch.setenv("MCP_BROKER_PORT", "8080")
    monkeypatch.setenv("MCP_BROKER_SHUTDOWN_DRAIN", "-1")
    monkeypatch.setattr(BrokerServer, "run", lambda self, sockets=None: pytest.fail("served with a bad setting"))
    assert cli.main(["serve"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "MCP_BROKER_SHUTDOWN_DRAIN" in err
