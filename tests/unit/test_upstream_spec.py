"""``MCP_BROKER_UPSTREAMS`` read once: every mistake is one line naming the setting and what to write."""

from __future__ import annotations

from typing import Any

import pytest

from broker.upstreams.spec import UpstreamsError, parse_upstreams


def test_a_good_map_is_read_with_its_defaults() -> None:
    [spec] = parse_upstreams({"notes": {"url": "https://notes.internal/mcp"}})
    assert spec.tenants == ("default",) and spec.prefixes is None and spec.auth.type == "none"
    assert spec.timeout == 30.0 and spec.concurrency == 32 and spec.caller == frozenset()


@pytest.mark.parametrize(("raw", "said"), [
    ([], "write a JSON object of upstream name"),
    ({"Notes!": {"url": "http://x/mcp"}}, "is not one; write lower-case letters"),
    ({"n": {"url": "ftp://x/mcp"}}, "not an http(s) URL with a host"),
    ({"n": {"url": "http:///mcp"}}, "not an http(s) URL with a host"),
    ({"n": {"url": "http://x:port/mcp"}}, "whose port is not a number"),
    ({"n": {}}, 'write one of "url"'),
    ({"n": {"url": "http://x/mcp", "command": ["x"]}}, 'write one of "url"'),
    ({"n": {"url": "http://x/mcp", "tenant": ["acme"]}}, "tenant is not a field"),
    ({"n": {"url": "http://x/mcp", "tenants": ["bad tenant"]}}, "is not a valid tenant name"),
    ({"n": {"url": "http://x/mcp", "prefixes": ["no-scheme"]}}, "is not the beginning of a URI"),
    ({"n": {"url": "http://x/mcp", "timeout": 0}}, '"timeout" is 0'),
    ({"n": {"url": "http://x/mcp", "concurrency": 1.5}}, "must be an integer"),
    ({"n": {"url": "http://x/mcp", "auth": {"type": "magic"}}}, "none, bearer or client_credentials"),
    ({"n": {"url": "http://x/mcp", "auth": {"type": "bearer"}}}, 'one of "token_file"'),
    ({"n": {"url": "http://x/mcp", "auth": {"type": "bearer", "token": "s3cret"}}}, "takes no token"),
    ({"n": {"url": "http://x/mcp", "auth": {"type": "client_credentials", "client_id": "b"}}},
     'one of "client_secret_file"'),
    ({"n": {"url": "http://x/mcp", "caller": ["email"]}}, "not email"),
    ({"a": {"url": "http://x/mcp", "prefixes": ["note://"]}, "b": {"url": "http://y/mcp", "prefixes": ["note://a/"]}},
     "overlaps 'note://' of upstream 'a' for tenant 'default'"),
])
def test_a_mistake_is_one_line_naming_the_setting(raw: Any, said: str) -> None:
    with pytest.raises(UpstreamsError) as refused:
        parse_upstreams(raw)
    message = str(refused.value)
    assert message.startswith("MCP_BROKER_UPSTREAMS: ") and said in message and "\n" not in message
    assert "s3cret" not in message


def test_one_prefix_for_two_upstreams_of_different_tenants_is_no_overlap() -> None:
    specs = parse_upstreams({"a": {"url": "http://x/mcp", "prefixes": ["note://"], "tenants": ["acme"]},
                             "b": {"url": "http://y/mcp", "prefixes": ["note://"], "tenants": ["globex"]}})
    assert [spec.name for spec in specs] == ["a", "b"]


def test_a_stdio_upstreams_process_gets_the_variables_named_and_none_of_the_brokers_secrets(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from broker.upstreams.stdio import StdioUpstream

    [spec] = parse_upstreams({"local": {"command": ["notes-server"], "env": ["NOTES_DB"], "prefixes": ["note://"]}})
    monkeypatch.setenv("NOTES_DB", "postgresql://notes")
    monkeypatch.setenv("MCP_BROKER_REDIS_URL", "redis://:secret@redis:6379/0")
    environment = StdioUpstream(spec.name, spec.command or (), 1024, spec.env).environment()
    assert environment["NOTES_DB"] == "postgresql://notes" and "PATH" in environment
    assert not any(name.startswith("MCP_BROKER_") for name in environment)
    with pytest.raises(UpstreamsError, match='"env" names variables for a "command"'):
        parse_upstreams({"web": {"url": "http://x/mcp", "env": ["NOTES_DB"]}})
