"""A foreign or damaged ref's routing is checked before anything trains from it: its stored dtype against the
field's declaration, its ids against ``num_experts``; a wrong one fails its micro batch (counted and dropped on
every rank through the failure all-reduce, as every fetch failure), the healthy one beside it trains."""

from __future__ import annotations

import numpy as np
import pytest

from refpipe.pipeline.field_checks import check_bounds
from refpipe.pipeline.fields import FieldsConfig
from refpipe.pipeline.step_file import StepFile
from refpipe.storage.backends import open_store
from refpipe.storage.chunk_codec import encode_chunk
from refpipe.storage.chunk_ref import ArraySpec, PayloadRef
from refpipe.storage.chunk_write import put_chunk
from refpipe.trainer.fetch import fetch_own
from tests.trainer.trainer_helpers import Seq, build_step, keep_all, make_branch

CFG = FieldsConfig(num_layers=2, top_k=2, num_experts=8)
P, C = 2, 3


def _foreign_ref(store, dtype: str, value: int) -> PayloadRef:
    """A chunk written around keep (another writer, or damage): routing of ``dtype`` with one id ``value``."""
    routing = np.tile(np.arange(2), (P + C, 2, 1)).astype(dtype)
    routing[3, 1, 0] = value
    chunk = encode_chunk("foreign", {"routed_experts": routing},
                         {"routed_experts": ArraySpec(routing.dtype.str, routing.shape, "tokens")},
                         num_prompt_tokens=P, num_completion_tokens=C)
    return PayloadRef(uri=put_chunk(store, "foreign", chunk), branch_id="foreign", num_prompt_tokens=P,
                      num_completion_tokens=C, arrays=chunk.arrays, nbytes=chunk.nbytes, checksum=chunk.checksum)


@pytest.mark.parametrize("dtype,value,problem", [
    ("<i4", -1, "stores routed_experts as int32 in the tokens domain: expected one of ['uint8', 'uint16'] in the "
                "tokens domain (its declaration)"),
    ("|i1", -1, "stores routed_experts as int8 in the tokens domain: expected one of ['uint8', 'uint16'] in the "
                "tokens domain (its declaration)"),
    ("<u2", 300, "field 'routed_experts': row 3 [num_layers 1, top_k 0] value 300: expected >= 0, < num_experts=8 "
                 "(a foreign or damaged chunk: the micro batch is not trained)"),
    ("|u1", 200, "field 'routed_experts': row 3 [num_layers 1, top_k 0] value 200: expected >= 0, < num_experts=8 "
                 "(a foreign or damaged chunk: the micro batch is not trained)"),
])
def test_a_foreign_refs_routing_fails_its_micro_batch_only(local_config, dtype, value, problem):
    store = open_store(local_config)
    rng = np.random.default_rng(3)
    branches = {"good": make_branch(rng, P, C, "good", completion=False, cfg=CFG)}
    refs = keep_all(store, local_config, branches, CFG) | {"foreign": _foreign_ref(store, dtype, value)}
    branches["foreign"] = branches["good"]  # build_step reads only which fields a branch carries
    build_step(store, 0, 8, [[[Seq("foreign", P + C)], [Seq("good", P + C)]]], branches, refs, rng, cfg=CFG)
    fetched = fetch_own(store, StepFile.read(store, 0), 0, CFG, max_concurrency=2)
    assert fetched.failed == {0} and sorted(fetched.assembled) == [1]
    assert len(fetched.errors) == 1 and fetched.errors[0].endswith(problem), fetched.errors
    good = fetched.assembled[1].fields["routed_experts"].values
    assert good.tobytes() == branches["good"].fields["routed_experts"].tobytes()


def test_a_bad_id_fails_only_the_micro_batches_whose_rows_hold_it(local_config):
    """Each chunk is checked whole right after its read; a chunk that fails there is checked again per micro batch
    over the rows it keeps, so a cut that stops before the bad row trains and the whole one fails, naming it."""
    store = open_store(local_config)
    rng = np.random.default_rng(3)
    branches = {"good": make_branch(rng, P, C, "good", completion=False, cfg=CFG)}
    refs = {"foreign": _foreign_ref(store, "|u1", 200)}  # row 3 holds id 200
    branches["foreign"] = branches["good"]
    build_step(store, 0, 8, [[[Seq("foreign", 3)], [Seq("foreign", P + C)]]], branches, refs, rng, cfg=CFG)
    fetched = fetch_own(store, StepFile.read(store, 0), 0, CFG, max_concurrency=2)
    assert fetched.failed == {1} and sorted(fetched.assembled) == [0] and fetched.chunks == 1
    assert fetched.errors == [
        f"micro batch 1: FieldError: micro batch dp_rank=0 index=1: ref 0 ({refs['foreign'].uri}): "
        "field 'routed_experts': row 3 [num_layers 1, top_k 0] value 200: expected >= 0, < num_experts=8 "
        "(a foreign or damaged chunk: the micro batch is not trained)"]
    assert fetched.assembled[0].fields["routed_experts"].values.tolist() == [[[0, 1], [0, 1]]] * 3


def test_a_clean_chunk_is_checked_once_right_after_its_read(local_config, monkeypatch):
    """A chunk used by two micro batches: its arrays' bounds are checked once, whole, on the thread that read it
    (while its bytes are in cache), not again per micro batch."""
    store = open_store(local_config)
    rng = np.random.default_rng(3)
    branches = {"good": make_branch(rng, P, C, "good", completion=False, cfg=CFG)}
    refs = keep_all(store, local_config, branches, CFG)
    build_step(store, 0, 8, [[[Seq("good", 3)], [Seq("good", P + C)]]], branches, refs, rng, cfg=CFG)
    checked: list[tuple[int, ...]] = []

    def counting(a, *args):
        checked.append(a.shape)
        return check_bounds(a, *args)

    monkeypatch.setattr("refpipe.trainer.assemble.check_bounds", counting)
    fetched = fetch_own(store, StepFile.read(store, 0), 0, CFG, max_concurrency=2)
    assert fetched.failed == set() and sorted(fetched.assembled) == [0, 1]
    assert checked == [(P + C, 2, 2)]
