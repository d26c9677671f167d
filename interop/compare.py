"""Compare conformance results with interop/baseline.txt.

Reads the per-scenario ``checks.json`` files the suite writes under ``<out>/<revision>/`` and the
scenario lists under ``<out>/<revision>.scenarios.txt``. Exit status 0 when every failure is in the
baseline and every baseline entry still fails, 1 otherwise, 2 on unusable input.

Ids: ``<revision>/<scenario>`` names a whole scenario, ``<revision>/<scenario>:<check-id>`` one check.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

RESULT_DIR = re.compile(r"^server-(?P<scenario>.+)-\d{4}-\d\d-\d\dT\d\d-\d\d-\d\d-\d{3}Z$")
LIST_ENTRY = re.compile(r"^\s+- (?P<name>\S+)(?: \[(?P<role>\w+)\])?\s*$")


@dataclass
class Scenario:
    revision: str
    name: str
    checks: list[dict[str, object]] = field(default_factory=list)
    ran: bool = False

    @property
    def id(self) -> str:
        return f"{self.revision}/{self.name}"

    def count(self, status: str) -> int:
        return sum(1 for c in self.checks if c.get("status") == status)

    def failed_checks(self) -> set[str]:
        return {str(c.get("id")) for c in self.checks if c.get("status") == "FAILURE"}

    def check_ids(self) -> set[str]:
        return {str(c.get("id")) for c in self.checks}

    def error_of(self, check: str) -> str:
        for c in self.checks:
            if c.get("id") == check and c.get("status") == "FAILURE":
                return str(c.get("errorMessage", ""))
        return ""

    def summary(self) -> str:
        counts = f"{self.count('SUCCESS')} ok, {self.count('FAILURE')} failed"
        return counts + (f", {self.count('WARNING')} warnings" if self.count("WARNING") else "")


@dataclass
class Verdicts:
    """What the comparison found, scenario by scenario."""

    whole: set[str]
    per_check: dict[str, set[str]]
    unexpected: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    passed: int = 0
    known: int = 0

    def judge(self, sc: Scenario) -> str:
        fails = sc.failed_checks()
        if not sc.ran:
            self.unexpected.append(f"{sc.id}: no result")
            return "FAIL (no result: the scenario did not run or crashed)"
        if sc.id in self.whole:
            if fails:
                self.known += 1
                return "known failure (baseline)"
            self.stale.append(f"{sc.id}: passes now; remove it from the baseline")
            return "STALE BASELINE: passes now"
        excused = self.per_check.get(sc.id, set())
        for check in sorted(excused - fails):
            if check in sc.check_ids() or not fails:
                self.stale.append(f"{sc.id}:{check}: passes now; remove it from the baseline")
        news = sorted(fails - excused)
        if news:
            self.unexpected.extend(f"{sc.id}:{c}: {sc.error_of(c)}" for c in news)
            return "FAIL: " + ", ".join(news)
        if fails:
            self.known += 1
            return "known failure (baseline: " + ", ".join(sorted(fails)) + ")"
        self.passed += 1
        return "pass"


def expected_scenarios(listing: Path) -> list[str]:
    """Server scenarios named by `list --server --requirements REV` (scored and not scored)."""
    names: list[str] = []
    section = ""
    for line in listing.read_text().splitlines():
        if line and not line.startswith(" "):
            section = line
            continue
        m = LIST_ENTRY.match(line)
        if not m:
            continue
        if section.startswith("Server scenarios") or m.group("role") == "server":
            names.append(m.group("name"))
    return names


def load(out: Path, revision: str) -> dict[str, Scenario]:
    scenarios = {n: Scenario(revision, n) for n in expected_scenarios(out / f"{revision}.scenarios.txt")}
    rev_dir = out / revision
    for d in sorted(rev_dir.iterdir()) if rev_dir.is_dir() else []:
        m = RESULT_DIR.match(d.name)
        checks_file = d / "checks.json"
        if not m or not checks_file.is_file():
            continue
        sc = scenarios.setdefault(m.group("scenario"), Scenario(revision, m.group("scenario")))
        sc.checks = json.loads(checks_file.read_text())
        sc.ran = True
    return scenarios


def read_baseline(path: Path) -> dict[str, str]:
    entries: dict[str, str] = {}
    if not path.exists():
        return entries
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line, _, reason = raw.partition("#")
        line = line.strip()
        if not line:
            continue
        if "/" not in line or " " in line:
            raise SystemExit(f"{path}:{n}: expected '<revision>/<scenario>[:<check-id>]  # reason', got {raw!r}")
        if not reason.strip():
            raise SystemExit(f"{path}:{n}: entry {line!r} needs a '# reason'")
        if line in entries:
            raise SystemExit(f"{path}:{n}: duplicate entry {line!r}")
        entries[line] = reason.strip()
    return entries


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--baseline", type=Path, required=True)
    ap.add_argument("--revisions", required=True)
    args = ap.parse_args()

    baseline = read_baseline(args.baseline)
    revisions = args.revisions.split()
    whole = {e for e in baseline if ":" not in e}
    per_check: dict[str, set[str]] = {}
    for e in baseline:
        if ":" in e:
            sid, _, check = e.partition(":")
            if sid in whole:
                raise SystemExit(f"{args.baseline}: {sid} is listed both whole and per check ({e})")
            per_check.setdefault(sid, set()).add(check)

    verdicts = Verdicts(whole, per_check)
    seen: set[str] = set()
    for rev in revisions:
        print(f"\n== {rev} ==")
        for sc in load(args.out, rev).values():
            seen.add(sc.id)
            print(f"  {sc.name:50} {sc.summary():28} {verdicts.judge(sc)}")

    for e in sorted(baseline):
        sid = e.partition(":")[0]
        if sid.split("/", 1)[0] in revisions and sid not in seen:
            verdicts.stale.append(f"{e}: no such scenario in this run; remove or fix it")

    unexpected, stale = verdicts.unexpected, verdicts.stale
    print()
    if unexpected:
        print("Unexpected failures (fix them, or add them to interop/baseline.txt with a reason):")
        for u in unexpected:
            print(f"  {u}")
    if stale:
        print("Stale baseline entries (they pass now: delete them from interop/baseline.txt):")
        for s in stale:
            print(f"  {s}")
    failed = len({u.partition(':')[0] for u in unexpected} | {s.partition(':')[0] for s in stale})
    print(f"details: {args.out}/<revision>/server-<scenario>-<time>/checks.json")
    print(f"interop: {verdicts.passed} passed, {failed} failed, {verdicts.known} skipped")
    return 1 if unexpected or stale else 0


if __name__ == "__main__":
    sys.exit(main())
