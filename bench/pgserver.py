"""A throwaway PostgreSQL server: its own cluster in a temporary directory (initdb + pg_ctl), on a free port,
reached over a unix socket in that directory; fresh databases on demand. What the tests run the store on
(tests/cloud/conftest.py) and what `apiary bench serve|store --db temp-postgresql` measure against.

The binaries come from PATH or Debian's ``postgresql`` package (/usr/lib/postgresql/<version>/bin, what
``.ci/install`` installs). PostgreSQL refuses to run as root, so under root the cluster runs as the
``postgres`` user (or ``nobody``) through ``runuser``.
"""
from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

SUPERUSER = "apiary"


def find_bin_dir() -> Path | None:
    """Where initdb and pg_ctl are: PATH first, then the newest Debian package's bin folder."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(found).resolve().parent
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]), reverse=True):
        if Path(folder, "initdb").is_file() and Path(folder, "pg_ctl").is_file():
            return Path(folder)
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """``durable=False`` (tests) turns fsync and synchronous commit off; benchmarks keep PostgreSQL's defaults."""

    def __init__(self, bin_dir: Path, *, durable: bool = False) -> None:
        self.bin_dir = bin_dir
        self.durable = durable
        self.dir = Path(tempfile.mkdtemp(prefix="apiary-pg-"))  # short: a unix socket path has ~100 bytes
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        self.port = _free_port()
        self._as: list[str] = []
        if os.geteuid() == 0:
            user = next(u for u in ("postgres", "nobody") if _user_exists(u))
            entry = pwd.getpwnam(user)
            os.chown(self.dir, entry.pw_uid, entry.pw_gid)
            self._as = ["runuser", "-u", user, "--"]
        os.chmod(self.dir, 0o755)
        self._names = itertools.count()

    def _run(self, *args: str) -> None:
        out = subprocess.run([*self._as, *args], capture_output=True, text=True)
        if out.returncode != 0:
            log = self.log.read_text() if self.log.exists() else ""
            raise RuntimeError(f"{' '.join(args[:2])} failed ({out.returncode}): {out.stdout}{out.stderr}{log}")

    def start(self) -> "PostgresServer":
        self._run(str(self.bin_dir / "initdb"), "-D", str(self.data), "-U", SUPERUSER, "--auth=trust",
                  "--no-sync", "-E", "UTF8")
        options = f"-p {self.port} -k {self.dir} -c listen_addresses='' -c max_connections=300"
        if not self.durable:
            options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", options,
                  "-w", "-t", "60", "start")
        return self

    def stop(self) -> None:
        if not (self.data / "postmaster.pid").exists():
            shutil.rmtree(self.dir, ignore_errors=True)
            return
        try:
            self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@/{database}?host={self.dir}&port={self.port}"

    def create_database(self) -> str:
        """A new empty database; its URL."""
        import psycopg

        name = f"apiary_{os.getpid()}_{next(self._names)}"
        with psycopg.connect(host=str(self.dir), port=self.port, user=SUPERUSER, dbname="postgres",
                             autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False
