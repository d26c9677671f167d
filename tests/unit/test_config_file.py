"""Settings from a TOML file: the environment over it, every key a setting, secrets masked when shown."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic_settings import SettingsError

from broker import cli
from broker.cli.config import effective_settings, masked
from broker.config import Settings


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A settings file named by MCP_BROKER_CONFIG, and no MCP_BROKER_ variable of the caller's."""
    import os

    for name in [name for name in os.environ if name.startswith("MCP_BROKER_")]:
        monkeypatch.delenv(name)
    path = tmp_path / "broker.toml"
    monkeypatch.setenv("MCP_BROKER_CONFIG", str(path))
    return path


def test_a_setting_written_in_the_file_is_read_and_the_environment_wins_over_it(
        config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config.write_text('max_sessions = 77\nredis_prefix = "from-file"\nallowed_hosts = ["broker.example.com"]\n'
                      '[quotas.acme]\nsessions = 5\n')
    settings = Settings()
    assert (settings.max_sessions, settings.redis_prefix) == (77, "from-file")
    assert settings.allowed_hosts == ["broker.example.com"] and settings.quotas == {"acme": {"sessions": 5}}
    monkeypatch.setenv("MCP_BROKER_MAX_SESSIONS", "88")
    settings = Settings()
    assert (settings.max_sessions, settings.redis_prefix) == (88, "from-file")


def test_a_key_that_is_not_a_setting_is_refused_in_one_line_never_ignored(config: Path) -> None:
    config.write_text('redis_ur = "redis://127.0.0.1:6379"\n')
    assert cli._settings_problems() == [f"{config}: redis_ur is not a setting; did you mean redis_url?"]
    with pytest.raises(SettingsError, match="redis_ur is not a setting"):
        Settings()


def test_a_bad_value_in_the_file_is_named_by_the_file_and_its_key(config: Path) -> None:
    config.write_text('port = 99999\napi_keys = {k3y = "alice"}\n')
    problems = cli._settings_problems()
    assert len(problems) == 2, problems
    assert any(line.startswith(f"{config}: port: ") for line in problems)
    assert any(line.startswith(f"{config}: api_keys: the binding 'alice' names no subject") for line in problems)


def test_a_file_that_is_not_toml_or_not_there_is_one_line(config: Path) -> None:
    config.write_text("redis_url = \n")
    [line] = cli._settings_problems()
    assert line.startswith(f"{config}: not TOML")
    config.unlink()
    assert cli._settings_problems() == [f"MCP_BROKER_CONFIG: cannot read {config}: No such file or directory"]


def test_secrets_are_masked_where_the_settings_are_shown(config: Path) -> None:
    config.write_text('api_keys = {"s3cr3t-key" = "acme/alice"}\noauth_client_secret = "cl13nt"\n'
                      'redis_url = "redis://user:pa55@db:6379/0"\n'
                      'postgres_url = "postgresql://app:pg-pa55@pg/db?sslmode=require&password=pg-pa55"\n')
    shown = effective_settings(Settings())
    for secret in ("s3cr3t-key", "cl13nt", "pa55"):
        assert secret not in shown
    assert 'redis_url = "redis://user:***@db:6379/0"' in shown and '"acme/alice"' in shown
    assert f"# {config}: oauth_client_secret" in shown
    assert masked("postgres_url", "host=pg password='a b' dbname=x") == "host=pg password=*** dbname=x"
    assert masked("webhook_allow", ["10.0.0.0/8"]) == ["10.0.0.0/8"]


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:p#w@h:6379", "redis://:***@h:6379"),
    ("redis://u:p?w@h:6379/0", "redis://u:***@h:6379/0"),
    ("postgresql://app:p/w@pg/db?sslmode=require", "postgresql://app:***@pg/db?sslmode=require"),
    ("rediss://:a@b#c?d/e@h:6380/1", "rediss://:***@h:6380/1"),
    ("redis://h:6379/0", "redis://h:6379/0"),
])
def test_a_url_password_is_masked_whatever_raw_characters_it_holds(url: str, shown: str) -> None:
    assert masked("redis_url", url) == shown


def test_help_never_shows_a_default_of_none() -> None:
    parser = cli.build_parser()
    parsers = [parser]
    for current in parsers:  # every command and action, however deep
        for action in current._actions:
            if action.choices and isinstance(action.choices, dict):
                parsers.extend(action.choices.values())
    assert len(parsers) > 10
    for current in parsers:
        assert "(default: None)" not in " ".join(current.format_help().split()), current.prog


def test_a_key_is_the_setting_name_as_written_in_the_code(config: Path) -> None:
    config.write_text('REDIS_URL = "redis://127.0.0.1:6379"\n')
    assert cli._settings_problems() == [f"{config}: REDIS_URL is not a setting; did you mean redis_url?"]


def test_a_bad_quota_in_the_file_is_named_by_the_file(config: Path) -> None:
    config.write_text("[quotas.default]\nsesions = 5\n")
    [line] = cli._settings_problems()
    assert line.startswith(f"{config}: quotas: "), line
