"""A PostgreSQL server from Debian's package for the tests: a cluster made in a temporary
directory, listening on a socket in that directory only (no TCP), with password
authentication; stopped and removed at the end.  As root, its programs run as the
``postgres`` user (``initdb`` refuses root)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import pytest

USER = "titanic"
PASSWORD = "titanic-secret"


def bindir() -> Optional[str]:
    """The directory of Debian's PostgreSQL programs (the newest), or of ``postgres`` on PATH."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"),
                   key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    if found:
        return str(Path(found[-1]).parent)
    postgres = shutil.which("postgres")
    return str(Path(postgres).parent) if postgres else None


def need_bindir() -> str:
    """:func:`bindir`; without one, the test is skipped (failed under CI, which installs it)."""
    found = bindir()
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL is not installed (.ci/run installs Debian's postgresql)")
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql)")
    return found


class PostgresServer:
    """A throwaway cluster: :meth:`start`, :attr:`url`, :meth:`stop`, :meth:`remove`."""

    def __init__(self) -> None:
        self.bin = need_bindir()
        self.root = Path(tempfile.mkdtemp(prefix="mdp-pg-"))
        self.data = self.root / "data"
        self.sockets = self.root / "sockets"
        self.sockets.mkdir()
        self._asPostgres = os.geteuid() == 0
        if self._asPostgres:
            shutil.chown(self.root, "postgres")
            shutil.chown(self.sockets, "postgres")
        secret = self.root / "password"
        secret.write_text(PASSWORD + "\n")
        if self._asPostgres:
            shutil.chown(secret, "postgres")
        self._run("initdb", "-D", str(self.data), "-U", USER, "--auth=scram-sha-256",
                  f"--pwfile={secret}", "-E", "UTF8", "--no-sync")
        secret.unlink()

    def _run(self, program: str, *args: str) -> None:
        command = [os.path.join(self.bin, program), *args]
        if self._asPostgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       timeout=60)

    def url(self, password: str = PASSWORD, database: str = "postgres") -> str:
        return f"postgresql://{USER}:{password}@/{database}?host={self.sockets}"

    @property
    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "log"), "-w", "-t", "30",
                  "-o", f"-c listen_addresses='' -k {self.sockets} -c fsync=off", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "30", "stop")

    def remove(self) -> None:
        with_pid = self.data / "postmaster.pid"
        if with_pid.exists():
            try:
                self.stop()
            except subprocess.SubprocessError:
                pid = int(with_pid.read_text().split()[0])
                os.kill(pid, 9)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def postgres() -> PostgresServer:
    server = PostgresServer()
    try:
        server.start()
        yield server
    finally:
        server.remove()
