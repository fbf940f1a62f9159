"""``open_store``: the one place a run's URI becomes a store backend."""

from __future__ import annotations

from refpipe.storage.config import StorageConfig
from refpipe.storage.local_store import LocalStore
from refpipe.storage.store import Store
from refpipe.storage.uri import RunPrefix


def open_store(config: StorageConfig) -> Store:
    """The store of ``config``'s run prefix (``<root>/<run_id>``): ``S3Store`` for ``s3://`` roots,
    else ``LocalStore``. Creates nothing (a local run directory appears with its first put).

    Raises:
        ConfigError: unknown scheme, malformed root, or an invalid ``run_id``.
    """
    prefix = RunPrefix.from_root(config.root, config.run_id)
    if prefix.scheme == "s3":
        from refpipe.storage.s3_store import S3Store  # s3fs, aiobotocore: imported only by runs on S3

        return S3Store(prefix, config)
    return LocalStore(prefix, config)
