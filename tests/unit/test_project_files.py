"""What a fresh clone shows before any code runs: the license it is under, how long its tests take."""

from __future__ import annotations

import re
import tomllib

from tests.support import ROOT


def test_the_license_file_is_the_license_the_package_declares() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]
    assert declared == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text) > 11_000


def test_the_test_commands_say_how_long_they_take() -> None:
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"make test +# .*about \d+ minutes", readme)
    assert re.search(r"make test-fast +# .*about \d+ s", readme)
    make_test = (ROOT / "Makefile").read_text().split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert re.search(r"echo .*about \d+ minutes", make_test)
