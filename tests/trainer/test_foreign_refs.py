"""A foreign or damaged ref's routing is checked before anything trains from it: its stored dtype against the
field's declaration, its ids against ``num_experts``; a wrong one fails its micro batch (counted and dropped on
every rank through the failure all-reduce, as every fetch failure), the healthy one beside it trains."""

from __future__ import annotations

import numpy as np
import pytest

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
