"""``MCP_BROKER_FILE_ROOTS``: each tenant's directory its own, once symlinks are resolved."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from broker.config import Settings


def settings(roots: dict[str, str]) -> Settings:
    return Settings(_env_file=None, file_roots=roots)  # type: ignore[call-arg]


def test_roots_of_two_tenants_may_not_nest_or_meet(tmp_path: Path) -> None:
    outer, inner, other = tmp_path / "data", tmp_path / "data" / "b", tmp_path / "other"
    inner.mkdir(parents=True)
    other.mkdir()
    (tmp_path / "alias").symlink_to(inner)
    for roots in ({"acme": str(outer), "beta": str(inner)},
                  {"acme": str(inner), "beta": str(tmp_path / "alias")},  # the same directory, by a link
                  {"acme": str(inner), "beta": str(outer)}):
        with pytest.raises(ValidationError, match="overlap"):
            settings(roots)
    assert settings({"acme": str(inner), "beta": str(other)}).file_roots["beta"] == str(other)


def test_a_providers_entry_is_checked_for_its_form_without_being_imported() -> None:
    with pytest.raises(ValidationError, match="package.module:factory"):
        Settings(_env_file=None, providers=["not a spec"])  # type: ignore[call-arg]
    # Well formed but missing: not imported here (only `serve` and `stdio` import it, at start).
    assert Settings(_env_file=None, providers=["no_such_module:factory"]).providers == [  # type: ignore[call-arg]
        "no_such_module:factory"]
