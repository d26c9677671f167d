"""The fuzz tier: hostile input against a real ``mcp-broker serve`` whose log is kept and read.

Every example is sent to the broker and its answer checked (no 5xx, a well-formed JSON-RPC
reply); the part of the log that example produced must hold no traceback, and neither may
the whole log once the broker has stopped. Budget: ``EXAMPLES`` derandomized examples per
target, so each run sends the same requests.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis.errors import InvalidArgument

from tests.fuzz.strategies import KEYS, Deep
from tests.support import BrokerProcess

#: Examples per target; the whole tier stays well under a minute on a shared two-core machine.
EXAMPLES = 200
#: No explain phase: it reruns a failing example hundreds of times to list lines, slow and of little use here.
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, phases=[Phase.explicit, Phase.generate, Phase.shrink],
                database=None, deadline=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
LOG_MARKERS = ("Traceback", "Exception in ASGI application", "Task exception was never retrieved")


def depth(value: Any) -> int:
    if isinstance(value, Deep):
        return value.depth + depth(value.leaf)
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    if isinstance(value, list | tuple):
        return 1 + max(map(depth, value), default=0)
    return 0


def _changes(request: Request) -> list[Any]:
    if request.method != "POST" or request.path != "/changes":
        return []
    return request.value if isinstance(request.value, list) else [request.value]


# Hostile inputs known to fail, each with what goes wrong: examples that match are not sent.
# Empty: the tier holds for every input it generates. An entry is a bug report, never a fix.
KNOWN_UNFIXED: list[tuple[str, Callable[[Request], bool]]] = []


def _event(text: str) -> None:
    """Count an outcome for ``--hypothesis-show-statistics`` (fixtures send requests too, outside any example)."""
    with contextlib.suppress(InvalidArgument):
        event(text)


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str | None]
    value: Any = None  # what the body encodes (for the allow-list); None with ``body`` None
    body: bytes | None = None

    def known_failure(self) -> str | None:
        return next((name for name, matches in KNOWN_UNFIXED if matches(self)), None)


@dataclass
class Answer:
    status: int
    content_type: str
    body: bytes | None  # None: an SSE stream, closed unread

    def json(self) -> Any:
        assert self.body is not None
        return orjson.loads(self.body)


class Target:
    """The broker under fuzz: sends a request, checks the answer and the log it left."""

    def __init__(self, broker: BrokerProcess, log: Path) -> None:
        self.broker = broker
        self.log = log
        self.offset = 0
        self.client = httpx.Client(base_url=broker.url, timeout=30)

    def new_log(self) -> str:
        with self.log.open("rb") as file:
            file.seek(self.offset)
            text = file.read()
        self.offset += len(text)
        return text.decode("utf-8", "replace")

    def send(self, request: Request) -> Answer | None:
        """The answer, checked for status and log; None when the example is a known, unfixed failure."""
        known = request.known_failure()
        if known is not None:
            _event(f"not sent, known: {known}")
            return None
        headers = {k: v.encode("latin-1") for k, v in request.headers.items() if v is not None}
        with self.client.stream(request.method, request.path, headers=headers, content=request.body) as response:
            content_type = response.headers.get("content-type", "")
            body = None if content_type.startswith("text/event-stream") else response.read()
        answer = Answer(response.status_code, content_type, body)
        _event(f"{request.method} {answer.status}")
        assert answer.status < 500, f"{answer.status}: {(body or b'')[:300]!r}"
        log = self.new_log()
        assert not any(marker in log for marker in LOG_MARKERS), log[-3000:]
        return answer

    def close(self) -> None:
        self.client.close()


@pytest.fixture(scope="session")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    log = tmp_path_factory.mktemp("fuzz") / "broker.log"
    env = {"MCP_BROKER_API_KEYS": orjson.dumps(KEYS).decode()}
    with BrokerProcess(env=env, log=log) as broker:
        fuzz = Target(broker, log)
        try:
            yield fuzz
        finally:
            fuzz.close()
            code = broker.terminate()
        # Tracebacks that no single example was charged with (a task that failed later, shutdown).
        text = log.read_text("utf-8", "replace")
        assert code in (0, -signal.SIGTERM), text[-3000:]
        assert not any(marker in text for marker in LOG_MARKERS), text[-3000:]
