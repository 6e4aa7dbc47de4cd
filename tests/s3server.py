"""A real S3-compatible server on 127.0.0.1 for the object-store tests: S3Proxy (Maven Central's
``org.gaul:s3proxy``, fetched by ``make s3proxy``) with its filesystem backend, in a JVM of its own.

S3Proxy implements the S3 protocol itself (SigV4 signatures, multipart uploads, listing, and
``If-None-Match: *`` on PUT, which delta-rs's commits rely on), over a temporary folder.
"""

from __future__ import annotations

import datetime
import glob
import hashlib
import hmac
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pg2delta.source.throwaway import _free_port

REPO = Path(__file__).resolve().parent.parent
BUCKET = "lake"
REGION = "us-east-1"
# Test-only credentials of a throwaway server: the tests hand them over the standard variables.
ACCESS_KEY = "pg2delta-test"
SECRET_KEY = "pg2delta-test-secret"


def s3proxy_jar() -> Path | None:
    """The S3Proxy jar: ``PG2DELTA_S3PROXY_JAR``, or the one ``make s3proxy`` put under .cache/."""
    named = os.environ.get("PG2DELTA_S3PROXY_JAR")
    if named:
        return Path(named)
    found = sorted(glob.glob(str(REPO / ".cache" / "s3proxy" / "s3proxy-*-jar-with-dependencies.jar")))
    return Path(found[-1]) if found else None


def _java() -> str:
    home = os.environ.get("JAVA_HOME")
    if home and os.path.exists(os.path.join(home, "bin", "java")):
        return os.path.join(home, "bin", "java")
    out = subprocess.run([str(REPO / "tools" / "java_home.sh")], capture_output=True, text=True, check=True)
    return os.path.join(out.stdout.strip(), "bin", "java")


@dataclass
class S3Server:
    """A running S3Proxy; :meth:`stop` ends it and removes its folder."""

    proc: subprocess.Popen[bytes]
    root: Path
    port: int
    started_in: float  # seconds from the JVM's start to the first answered request

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """The standard variables a client of this server is given (what a user's shell has)."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
        }

    @property
    def storage_options(self) -> dict[str, str]:
        """delta-rs's options for reading this server's tables (a reader independent of pg2delta)."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
        }

    @classmethod
    def start(cls, jar: Path, timeout: float = 120.0) -> S3Server:
        root = Path(tempfile.mkdtemp(prefix="pg2delta-s3-"))
        (root / "data").mkdir()
        port = _free_port()
        props = root / "s3proxy.conf"
        props.write_text(
            f"s3proxy.endpoint=http://127.0.0.1:{port}\n"
            "s3proxy.authorization=aws-v2-or-v4\n"
            f"s3proxy.identity={ACCESS_KEY}\n"
            f"s3proxy.credential={SECRET_KEY}\n"
            "jclouds.provider=filesystem-nio2\n"
            f"jclouds.filesystem.basedir={root / 'data'}\n"
        )
        t0 = time.monotonic()
        with open(root / "s3proxy.log", "wb") as log:
            proc = subprocess.Popen(
                [_java(), "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC", "-Xmx256m", "-jar", str(jar), "--properties", str(props)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        server = cls(proc, root, port, 0.0)
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"S3Proxy exited ({proc.returncode}): {(root / 's3proxy.log').read_text()[-2000:]}")
                try:
                    urllib.request.urlopen(server.endpoint + "/", timeout=2)
                except urllib.error.HTTPError:
                    break  # answered (403 to an anonymous request): up
                except OSError:
                    if time.monotonic() - t0 > timeout:
                        raise RuntimeError("S3Proxy did not answer in time") from None
                    time.sleep(0.05)
                else:
                    break
            server.started_in = time.monotonic() - t0
            status = server.request("PUT", f"/{BUCKET}")
            if status != 200:
                raise RuntimeError(f"S3Proxy refused to create bucket {BUCKET}: HTTP {status}")
        except BaseException:
            server.stop()
            raise
        return server

    def request(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> int:
        """One SigV4-signed request (unsigned payload); returns the HTTP status."""
        now = datetime.datetime.now(datetime.UTC)
        amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        signed = {
            "host": f"127.0.0.1:{self.port}",
            # urllib would add a form content type of its own, which S3Proxy takes into the signature
            "content-type": "application/octet-stream",
            "x-amz-content-sha256": "UNSIGNED-PAYLOAD",
            "x-amz-date": amz_date,
            **{k.lower(): v for k, v in (headers or {}).items()},
        }
        names = ";".join(sorted(signed))
        canonical = "\n".join(
            [method, path, "", *(f"{k}:{signed[k]}" for k in sorted(signed)), "", names, "UNSIGNED-PAYLOAD"]
        )
        scope = f"{day}/{REGION}/s3/aws4_request"
        to_sign = f"AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        key = ("AWS4" + SECRET_KEY).encode()
        for part in (day, REGION, "s3", "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        req = urllib.request.Request(self.endpoint + path, data=body if method == "PUT" else None, method=method)
        for k, v in signed.items():
            if k != "host":
                req.add_header(k, v)
        req.add_header("Authorization", f"AWS4-HMAC-SHA256 Credential={ACCESS_KEY}/{scope}, SignedHeaders={names}, Signature={signature}")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    def check_alive(self) -> None:
        """Fails the test with what became of the server when it no longer answers (a test of the
        object store must not read a dead test server as pg2delta's fault)."""
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=10)
        except urllib.error.HTTPError:
            return  # answered
        except OSError as exc:
            log = (self.root / "s3proxy.log").read_text(errors="replace")[-2000:] if (self.root / "s3proxy.log").exists() else ""
            raise RuntimeError(f"S3Proxy on port {self.port} does not answer ({exc}); exit code {self.proc.poll()}; its log: {log}") from exc

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)
