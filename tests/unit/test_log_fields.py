"""The request fields of a log line are a client's headers: escaped and cut, in text and JSON alike."""

from __future__ import annotations

import json
import logging

import pytest

from broker.config import Settings
from broker.ops import logs

FORGED = "abc tenant=victim\x85 2026-01-01 ERROR forged line\n" + "x" * 30_000


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_forged_request_ids_and_session_ids_cannot_add_fields_lines_or_bulk(
        fmt: str, capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure(Settings(_env_file=None), fmt=fmt)  # type: ignore[call-arg]
    try:
        logs.bind(tenant="acme", session=FORGED, request=FORGED)
        logging.getLogger("broker.test").warning("served")
    finally:
        logs.bind()
        logging.getLogger().removeHandler(next(h for h in logging.getLogger().handlers
                                               if h.get_name() == "mcp-broker"))
    out = capsys.readouterr().err
    lines = out.splitlines()  # splitlines breaks at NEL too
    assert len(lines) == 1 and len(out) < 1500, out[:300]
    if fmt == "text":
        assert lines[0].count("tenant=") == 1 and " session=abc%20tenant%3Dvictim%C2%85%20" in lines[0]
    else:
        record = json.loads(lines[0])
        assert record["tenant"] == "acme" and record["request"].startswith("abc%20tenant%3Dvictim%C2%85%20")
        assert len(record["request"]) < 3 * 6 * logs.MAX_FIELD
