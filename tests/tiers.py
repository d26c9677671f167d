"""Tier markers from what a test needs, and a guard that keeps them honest.

``process``: the test starts another process (``mcp-broker serve``, a CLI run, a server binary).
``redis``: one of those is a real ``redis-server``. A test needs what its own code and the code of
every fixture it uses reach: the helpers of ``tests/`` are followed down to ``subprocess`` or
``asyncio.create_subprocess_*`` (``process``) and to ``RedisProcess`` (``redis``); a fixture
parametrized by backend needs a ``redis-server`` for the parameter ``"redis"`` alone. The tiers
whose every test runs against real servers (client, distributed, fuzz) are marked by their folder.
A marker is written by hand only where a library starts the process out of the walk's sight.

The guard: while a test that is not marked ``process`` runs (set-up, call, tear-down), starting a
process fails it. Under ``-m "not process and not redis"`` no marked test runs first to start a
shared fixture, so every process an unmarked test needs would be started under the guard.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import CodeType, FunctionType
from typing import Any

import pytest

from tests.support import RedisProcess

MARKERS = {  # as registered in pyproject.toml
    "process": "starts another process or server (a broker, a CLI run, redis-server, PostgreSQL, nginx...)",
    "redis": "starts a real redis-server (every such test is marked process too)",
}
#: Tiers (folders under tests/) that run against real servers, every test of them.
OUT_OF_PROCESS_TIERS = {"client": {"process"}, "distributed": {"process", "redis"}, "fuzz": {"process"}}
#: The backends a fixture may be parametrized by.
BACKENDS = {"memory", "fakeredis", "redis"}
#: Names that start a process whatever they are looked up on (``subprocess`` also when imported in a function).
_SPAWNERS = {"subprocess", "Popen", "create_subprocess_exec", "create_subprocess_shell"}
_TESTS = Path(__file__).resolve().parent


def _is_test_code(obj: object) -> bool:
    return str(getattr(obj, "__module__", "") or "").startswith("tests.")


def _code_needs(code: CodeType, names: dict[str, Any], seen: set[int]) -> set[str]:
    found: set[str] = set()
    for name in code.co_names:
        if name in _SPAWNERS:
            found.add("process")
        target = names.get(name)
        if _is_test_code(target):
            found |= needs(target, seen)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            found |= _code_needs(const, names, seen)
    return found


def needs(obj: object, seen: set[int] | None = None) -> set[str]:
    """What test code ``obj`` (a test, a fixture, a helper function or class) starts, through the helpers it names."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return set()
    seen.add(id(obj))
    if obj is RedisProcess:
        return {"process", "redis"}
    if isinstance(obj, type):
        found: set[str] = set()
        for member in vars(obj).values():
            member = getattr(member, "__func__", member)
            found |= needs(member.fget if isinstance(member, property) else member, seen)
        return found
    func = getattr(obj, "_get_wrapped_function", lambda: obj)()  # a fixture definition: the function it wraps
    if not callable(func):
        return set()
    func = inspect.unwrap(func)  # a context manager: the generator it wraps
    if not isinstance(func, FunctionType) or not _is_test_code(func):
        return set()
    return _code_needs(func.__code__, func.__globals__, seen)


def item_needs(item: pytest.Item) -> set[str]:
    found: set[str] = set()
    tier = Path(str(item.path)).resolve().relative_to(_TESTS).parts[0]
    found |= OUT_OF_PROCESS_TIERS.get(tier, set())
    if not isinstance(item, pytest.Function):
        return found
    found |= needs(item.function)
    params = item.callspec.params if hasattr(item, "callspec") else {}
    for name in item.fixturenames:
        backend = params.get(name)
        for fixturedef in item._fixtureinfo.name2fixturedefs.get(name, ()):
            fixture_needs = needs(fixturedef.func)
            if isinstance(backend, str) and backend in BACKENDS:  # the parameter says whether it is Redis
                fixture_needs -= {"redis"}
            found |= fixture_needs
    if "redis" in params.values():
        found |= {"process", "redis"}
    return found


def mark_items(items: list[pytest.Item]) -> None:
    for item in items:
        for name in sorted(item_needs(item) - {m.name for m in item.iter_markers()}):
            item.add_marker(name)


class ProcessStarted(AssertionError):
    pass


def _refuse(*args: object, **kwargs: object) -> Any:
    raise ProcessStarted("this test starts a process but is not marked 'process': the tier markers "
                         "(tests/tiers.py) did not see it; name the helper it reaches or mark it by hand")


async def _refuse_async(*args: object, **kwargs: object) -> Any:
    _refuse()


@contextlib.contextmanager
def process_guard(item: pytest.Item) -> Iterator[None]:
    """Starting a process fails while ``item`` runs, unless it is marked ``process``."""
    if item.get_closest_marker("process") is not None:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "_execute_child", _refuse)
        patch.setattr(asyncio, "create_subprocess_exec", _refuse_async)
        patch.setattr(asyncio, "create_subprocess_shell", _refuse_async)
        yield
