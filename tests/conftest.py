"""Shared fixtures: a real moto S3 server on 127.0.0.1 (port 0) and run configs per backend.

The S3 server runs for the whole session; each test gets a fresh bucket. Throwaway
credentials are set in ``os.environ`` so subprocesses (distributed tests) inherit them.
"""

from __future__ import annotations

import os
import uuid

import boto3
import pytest
from refpipe.storage.config import StorageConfig
from refpipe.storage.store import open_store

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
