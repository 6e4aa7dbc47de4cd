"""A standalone Spark cluster on 127.0.0.1: one master and one worker, started from the pyspark
install of the running venv (``spark-class org.apache.spark.deploy.master.Master`` / ``...worker.Worker``)
as child processes of their own process group, so that :meth:`SparkCluster.stop` ends them and the
executors the worker started, and removes their folders.

The worker runs in a folder of its own (its work dir, where each executor runs and fetches the
application's jars from the driver, and its local dirs), with the credentials of the object store
in its environment (what an instance role gives a cluster's nodes). Where this process may create
a mount namespace (root, ``unshare``), the worker and its executors run in one in which every folder
named in ``hidden`` is an empty tmpfs: the driver's folders (its config, its working and temporary
directories) do not exist for them, so anything an executor reads must come through the network
(the lake on the object store, the jars from the driver's file server).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pg2delta.source.throwaway import _free_port

SPARK_CLASS = Path(sys.executable).parent / "spark-class"
# Small JVMs on a shared 2-core machine: the daemons only schedule; one executor does the work.
DAEMON_MEMORY = "256m"
WORKER_MEMORY = "1g"
EXECUTOR_MEMORY = "768m"
JVM_OPTS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
_HIDE = 'for d in $PG2DELTA_HIDDEN; do mount -t tmpfs -o size=64k,mode=0755 pg2delta-hidden "$d" || exit 97; done; exec "$@"'


def class_data() -> tuple[str, str] | None:
    """``(-XX:SharedArchiveFile=<archive>, <empty conf dir>)`` when this process's Spark JVMs start
    fast (the Makefile's ``FAST_JVM``: ``SPARK_SUBMIT_OPTS`` names the class-data archive of
    tools/spark_setup.py and ``SPARK_CONF_DIR`` is the empty folder it was trained beside), else None.
    The daemons and executors then start from the same archive: the JVM maps it only where the class
    path is the one it was built with (that conf folder, then the install's jars), so they take that
    (empty) folder as their ``SPARK_CONF_DIR``."""
    opts = [o for o in os.environ.get("SPARK_SUBMIT_OPTS", "").split() if o.startswith("-XX:SharedArchiveFile=")]
    conf = os.environ.get("SPARK_CONF_DIR", "")
    if not opts or not conf or not Path(conf).is_dir() or any(Path(conf).iterdir()):
        return None
    if not Path(opts[-1].split("=", 1)[1]).is_file():
        return None
    return opts[-1], conf


def spark_home() -> Path | None:
    """The installed pyspark's folder when it is a full Spark (its jars), else None (pyspark-client)."""
    spec = importlib.util.find_spec("pyspark")
    if spec is None or spec.origin is None:
        return None
    home = Path(spec.origin).parent
    return home if (home / "jars").is_dir() and SPARK_CLASS.exists() else None


def can_hide() -> bool:
    """Whether a child can run in a mount namespace of its own (``unshare --mount``: root, or
    a user namespace's capability)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    return probe.returncode == 0


@dataclass
class SparkCluster:
    """A running master and worker; ``master`` is the URL to submit to."""

    root: Path
    port: int
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    hidden: tuple[str, ...] = ()
    started_in: float = 0.0
    jvm_opts: str = JVM_OPTS  # the daemons' and the executors' (with the class-data archive where there is one)

    @property
    def master(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    @property
    def work_dir(self) -> Path:
        return self.root / "work"

    def submit_args(self, **conf: str) -> list[str]:
        """What a driver on this machine adds to ``spark-submit``: the master, client mode,
        loopback addresses, the executor's size (and ``conf``, as ``--conf`` settings)."""
        settings = {
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.executor.memory": EXECUTOR_MEMORY,
            "spark.executor.extraJavaOptions": self.jvm_opts,  # an executor lives for one short application
            **conf,
        }
        args = ["--master", self.master, "--deploy-mode", "client"]
        for key, value in settings.items():
            args += ["--conf", f"{key}={value}"]
        return args

    @classmethod
    def start(cls, env: Mapping[str, str], *, cores: int = 2, hidden: Sequence[Path] = (), timeout: float = 120.0) -> SparkCluster:
        """Master, then the worker once the master listens; returns when the worker is registered.
        ``env`` is the daemons' environment (JAVA_HOME, the store's credentials); ``hidden``: folders
        the worker and its executors must not see (only where :func:`can_hide`)."""
        root = Path(tempfile.mkdtemp(prefix="pg2delta-spark-cluster-"))
        for sub in ("conf", "work", "local", "logs"):
            (root / sub).mkdir()
        fast = class_data()
        cluster = cls(
            root, _free_port(), hidden=tuple(str(h) for h in hidden) if hidden and can_hide() else (),
            jvm_opts=f"{fast[0]} {JVM_OPTS}" if fast else JVM_OPTS,
        )
        home = spark_home()
        if home is None:
            raise RuntimeError("no full pyspark install (its jars and spark-class) in this venv")
        daemon_env = {
            **env,
            "SPARK_HOME": str(home),
            "SPARK_CONF_DIR": fast[1] if fast else str(root / "conf"),  # empty: none of the driver's settings
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_LOCAL_DIRS": str(root / "local"),
            "SPARK_DAEMON_MEMORY": DAEMON_MEMORY,
            "SPARK_DAEMON_JAVA_OPTS": cluster.jvm_opts,
        }
        t0 = time.monotonic()
        try:
            cluster._spawn("master", daemon_env, [
                str(SPARK_CLASS), "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(cluster.port),
                "--webui-port", str(_free_port()),
            ])
            cluster._wait(lambda: _listens(cluster.port), "the master to listen", timeout)
            worker = [
                str(SPARK_CLASS), "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--webui-port", str(_free_port()),
                "--cores", str(cores), "--memory", WORKER_MEMORY, "--work-dir", str(cluster.work_dir), cluster.master,
            ]
            if cluster.hidden:
                daemon_env["PG2DELTA_HIDDEN"] = " ".join(cluster.hidden)
                worker = ["unshare", "--mount", "--propagation", "private", "sh", "-c", _HIDE, "hide", *worker]
            cluster._spawn("worker", daemon_env, worker, cwd=cluster.work_dir)
            cluster._wait(lambda: "Successfully registered with master" in cluster.log("worker"), "the worker to register", timeout)
        except BaseException:
            cluster.stop()
            raise
        cluster.started_in = time.monotonic() - t0
        return cluster

    def _spawn(self, name: str, env: Mapping[str, str], argv: list[str], *, cwd: Path | None = None) -> None:
        """``argv`` in a process group of its own (spark-class, and unshare and sh, exec the JVM:
        the group is the daemon and the processes it starts)."""
        with open(self.root / "logs" / f"{name}.log", "wb") as log:
            self.procs.append(subprocess.Popen(
                argv, env=dict(env), cwd=str(cwd or self.root), stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            ))

    def _wait(self, ready: Callable[[], bool], what: str, timeout: float) -> None:
        t0 = time.monotonic()
        while not ready():
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"a Spark daemon exited ({proc.returncode}) waiting for {what}: {self.logs()[-3000:]}")
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"timed out waiting for {what}: {self.logs()[-3000:]}")
            time.sleep(0.2)

    def log(self, name: str) -> str:
        path = self.root / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self) -> str:
        return self.log("master") + self.log("worker")

    def executor_logs(self) -> dict[str, str]:
        """``<app id>/<executor id>`` -> the executor's stderr, of every application the worker ran."""
        return {
            f"{p.parent.parent.name}/{p.parent.name}": p.read_text(errors="replace")
            for p in sorted(self.work_dir.glob("app-*/*/stderr"))
        }

    def stop(self) -> None:
        """SIGTERM to each daemon's process group (the worker's holds its executors), SIGKILL to
        what is left after 20 s; then the folders go."""
        for proc in reversed(self.procs):
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in reversed(self.procs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
            _signal_group(proc, signal.SIGKILL)  # executors left behind by a worker that went first
            proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def _listens(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
