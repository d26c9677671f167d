"""A private PostgreSQL for the tests: ``initdb`` into a temporary directory, ``pg_ctl start`` on a
free loopback port with trust authentication, stopped and removed at the end.

PostgreSQL refuses to run as root: as root the server runs as the ``postgres`` OS user when there
is one, else as a throwaway system user created for the purpose (``mcpb-pgtest``). The binaries
are found on the PATH or in Debian's ``/usr/lib/postgresql/<version>/bin``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.support import free_port

__all__ = ["PostgresProcess", "postgres_binary"]

THROWAWAY_USER = "mcpb-pgtest"


def postgres_binary(name: str) -> str | None:
    """``initdb``, ``pg_ctl``...: on the PATH, or the newest of Debian's versioned directories."""
    found = shutil.which(name)
    if found:
        return found
    candidates = glob.glob(f"/usr/lib/postgresql/*/bin/{name}")
    candidates.sort(key=lambda path: int(Path(path).parts[-3]) if Path(path).parts[-3].isdigit() else 0)
    return candidates[-1] if candidates else None


def _server_user() -> str | None:
    """The OS user the server runs as: None (this one) unless this is root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", THROWAWAY_USER):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", THROWAWAY_USER],
                   check=True, capture_output=True)
    return THROWAWAY_USER


class PostgresProcess:
    """A PostgreSQL server of its own; ``url`` reaches its ``postgres`` database as superuser ``postgres``."""

    def __init__(self) -> None:
        initdb, pg_ctl = postgres_binary("initdb"), postgres_binary("pg_ctl")
        if initdb is None or pg_ctl is None:
            raise RuntimeError("PostgreSQL is not installed (initdb, pg_ctl); apt-get install postgresql")
        self.pg_ctl = pg_ctl
        self.user = _server_user()
        # Not under pytest's tmp_path: that is private to root, and the server's user must reach it.
        self.dir = Path(tempfile.mkdtemp(prefix="mcpb-pg-"))
        self.data = self.dir / "data"
        self.port = free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            os.chown(self.dir, entry.pw_uid, entry.pw_gid)
        try:
            self._run([initdb, "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync"])
            self.start()
        except BaseException:
            self.remove()
            raise

    def _run(self, command: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(command, user=self.user, capture_output=True, text=True, timeout=60,
                                cwd=self.dir, env={**os.environ, "LC_ALL": "C"})
        if check and result.returncode != 0:
            log = (self.dir / "log").read_text() if (self.dir / "log").exists() else ""
            raise RuntimeError(f"{command[0]} failed: {result.stdout}{result.stderr}{log}")
        return result

    def start(self) -> None:
        options = f"-p {self.port} -k {self.dir} -h 127.0.0.1 -F -c fsync=off"
        self._run([self.pg_ctl, "-D", str(self.data), "-o", options, "-l", str(self.dir / "log"), "-w", "-t", "30",
                   "start"])

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run([self.pg_ctl, "-D", str(self.data), "-m", "immediate", "-w", "stop"], check=False)

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PostgresProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
