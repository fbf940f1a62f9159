"""Helpers for the orchestrator tests: real kept episodes, chunk listings, a counting store."""

from __future__ import annotations

import numpy as np

from refpipe.pipeline.fields import FieldsConfig, spread_expert_rows
from refpipe.pipeline.keep import Branch, Keeper
from refpipe.pipeline.samples import BranchResult, Episode
from refpipe.storage.config import StorageConfig
from refpipe.storage.layout import parse_release_key
from refpipe.storage.ledger import Ledger
from refpipe.storage.ledger_records import read_release_record
from refpipe.storage.local_store import LocalStore
from refpipe.storage.s3_store import S3Store
from refpipe.storage.store import Store
from refpipe.storage.uri import RunPrefix

FIELDS = FieldsConfig(num_layers=2, top_k=2, num_experts=8, logprobs_k=3)


def counting_store(config: StorageConfig) -> Store:
    """A real store of ``config``'s backend that counts its ``get`` and ``get_array`` calls in ``.gets``."""
    prefix = RunPrefix.from_root(config.root, config.run_id)
    base = S3Store if prefix.scheme == "s3" else LocalStore

    class CountingStore(base):
        gets = 0

        def get(self, key, start=None, end=None):
            self.gets += 1
            return super().get(key, start, end)

        def get_array(self, key):
            self.gets += 1
            return super().get_array(key)

    return CountingStore(prefix, config)


def make_keeper(store: Store, config: StorageConfig, actor: str = "env_worker_0") -> Keeper:
    """An env-server keeper writing into ``store``."""
    return Keeper(store, Ledger(store, actor), FIELDS, config)


def branch(keeper: Keeper | None, rng: np.random.Generator, *, num_prompt: int = 4, num_completion: int = 6,
           policy_version: int = 0, routing: bool = True, topk: bool = True, trainable: bool = True,
           branch_id: str | None = None) -> BranchResult:
    """A branch with random tokens; kept through ``keeper`` when it has fields (and a keeper)."""
    n = num_prompt + num_completion
    fields = {}
    if routing:
        fields["routed_experts"] = spread_expert_rows(n, 2, 2, 8, np.uint8)
    if topk:
        fields["topk_ids"] = rng.integers(0, 100, (num_completion, 3), dtype=np.int32)
        fields["topk_logprobs"] = -rng.random((num_completion, 3), dtype=np.float32)
    ref = None
    if keeper is not None and fields:
        ref = keeper.keep(Branch(num_prompt, num_completion, fields, branch_id=branch_id))
    return BranchResult(
        prompt_ids=rng.integers(0, 1000, num_prompt, dtype=np.int32),
        completion_ids=rng.integers(0, 1000, num_completion, dtype=np.int32),
        inference_logprobs=-rng.random(num_completion, dtype=np.float32),
        temperature=0.7, policy_version=policy_version, ref=ref, trainable=trainable,
    )


def episode(keeper: Keeper | None, rng: np.random.Generator, episode_id: str, group_id: str, reward,
            *, branches: int = 1, env_name: str = "reverse", is_eval: bool = False, **branch_kwargs) -> Episode:
    """An episode of ``branches`` kept branches (ids ``<episode_id>-b<i>``)."""
    return Episode(
        episode_id=episode_id, group_id=group_id, env_name=env_name, reward=reward, is_eval=is_eval,
        branches=[branch(keeper, rng, branch_id=f"{episode_id}-b{i}", **branch_kwargs) for i in range(branches)],
    )


def chunks(store: Store) -> set[str]:
    """Branch ids of every chunk (commit marker) under the run prefix."""
    return {k.split("/")[-2] for k in store.list_prefix("payloads") if k.endswith("/zarr.json")}


def tombstones(store: Store) -> set[str]:
    """Branch ids with a delete record: their own, or a release or (a filesystem) delete batch record listing them."""
    ids: set[str] = set()
    for key in store.list_prefix("ledger/deletes"):
        if parse_release_key(key):
            ids.update(read_release_record(store.get(key), key).branch_ids)
        else:
            ids.add(key.split("/")[-1].removesuffix(".json"))
    return ids
