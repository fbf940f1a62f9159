"""Property (issue 14 input 5): over generated root paths, two different roots never map to one run prefix, and
every root the configuration accepts keeps, fetches and deletes its chunks; the others are refused up front."""

from __future__ import annotations

import os
import re
import tempfile

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from refpipe.pipeline.fields import FieldsConfig
from refpipe.pipeline.keep import Branch, Keeper
from refpipe.storage.backends import open_store
from refpipe.storage.chunk_read import fetch_arrays
from refpipe.storage.config import StorageConfig
from refpipe.storage.ledger import Ledger
from refpipe.storage.ledger_records import delete_record_of
from refpipe.storage.uri import RunPrefix

SEGMENT = st.text(st.sampled_from(list("ab#?%. :-_é") + ["\n", "\t", "\x7f", "😀"]), min_size=1, max_size=5)
ROOT_PATH = st.lists(SEGMENT, min_size=1, max_size=3).map("/".join)
REFUSED = re.compile(r"[#?%\x00-\x1f\x7f]")
FIELDS = FieldsConfig(logprobs_k=2)


def refused(root: str) -> bool:
    """What the configuration refuses: a character that cannot round-trip through a URI, or (S3, where nothing
    normalises paths) a ``.`` or ``..`` segment."""
    dots = root.startswith("s3://") and bool({".", ".."} & set(root.split("/")))
    return bool(REFUSED.search(root)) or dots


def prefix(root: str) -> RunPrefix | None:
    try:
        return RunPrefix.from_root(root, "run_1")
    except ValueError:
        return None


@settings(max_examples=300, deadline=None)
@given(a=ROOT_PATH, b=ROOT_PATH)
def test_two_roots_share_a_prefix_only_when_they_name_the_same_place(a, b):
    for scheme_root, same in ((lambda p: f"s3://bucket/{p}", a.strip("/") == b.strip("/")),
                              (lambda p: f"/base/{p}", os.path.abspath(f"/base/{a}") == os.path.abspath(f"/base/{b}"))):
        pa, pb = prefix(scheme_root(a)), prefix(scheme_root(b))
        assert (pa is None) == refused(scheme_root(a)) and (pb is None) == refused(scheme_root(b))
        if pa and pb:
            assert (pa.uri == pb.uri) == same, (a, b, pa.uri, pb.uri)


@settings(max_examples=25, deadline=None)
@given(path=ROOT_PATH.filter(lambda p: not REFUSED.search(p)))
def test_every_chunk_kept_under_an_accepted_root_is_fetched_and_deleted(path):
    with tempfile.TemporaryDirectory() as tmp:
        base = f"{tmp}/x/y/z"  # as deep as ROOT_PATH has segments: its ``..`` segments stay inside ``tmp``
        config = StorageConfig(root=f"{base}/{path}", run_id="run_1")
        assert os.path.abspath(config.root).startswith(f"{tmp}/")
        store = open_store(config)
        ledger = Ledger(store, "env_worker_0")
        keeper = Keeper(store, ledger, FIELDS, config)
        topk = np.arange(6, dtype=np.int32).reshape(3, 2)
        ref = keeper.keep(Branch(1, 3, {"topk_ids": topk}, branch_id="b1"))
        assert fetch_arrays(store, ref, 2)["topk_ids"].tobytes() == topk[:1].tobytes()
        assert keeper.discard([ref]).deleted == [ref.uri]
        ledger.wait_freed()
        assert store.list_prefix("payloads") == [] and delete_record_of(store, "b1").holder == "env_worker_0"
