"""refpipe.integrations.verl against the real verl 0.9.1: materialised tensors are verl's inline ones, byte for byte.

Both DataProtos come from the same engine outputs through verl's own agent-loop post-processing
(``AgentLoopWorker._agent_loop_postprocess`` and ``_postprocess``, set up by the example's
``verl_worker``): inline as verl builds it, and by reference after ``keep_output``.
"""

from __future__ import annotations

import importlib.util
import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import verl

from refpipe.integrations.verl import PAYLOAD_KEY, RolloutPayload, keep_output, materialize, release
from refpipe.pipeline.audit import audit
from refpipe.pipeline.fields import FieldsConfig
from refpipe.pipeline.keep import Keeper
from refpipe.storage.backends import open_store
from refpipe.storage.errors import ChunkNotFoundError, DoubleDeleteError, FieldError
from refpipe.storage.ledger import Ledger

EXAMPLE = Path(__file__).parents[2] / "examples" / "verl_dataproto.py"
_spec = importlib.util.spec_from_file_location("verl_dataproto_example", EXAMPLE)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

SHAPE = example.Shape(samples=8, prompt_length=12, response_length=20, num_layers=3, top_k=2, num_experts=8)


def keeper_for(storage_config, shape, **fields_options) -> Keeper:
    store = open_store(storage_config)
    fields = FieldsConfig(num_layers=shape.num_layers, top_k=shape.top_k, num_experts=shape.num_experts,
                          **fields_options)
    return Keeper(store, Ledger(store, "agent_loop_worker_0"), fields, storage_config)


def both_batches(keeper: Keeper, shape, *, seed: int = 0, as_torch: bool = False):
    """(inline DataProto, by-reference DataProto) of the same engine outputs, through verl's own code."""
    worker = example.verl_worker(shape)
    inline = example.to_dataproto(worker, example.engine_outputs(shape, seed))
    outputs = example.engine_outputs(shape, seed)
    for o in outputs:
        if as_torch:
            o.routed_experts = torch.from_numpy(o.routed_experts).to(torch.int64)
        keep_output(keeper, o)
    return inline, example.to_dataproto(worker, outputs)


def assert_identical(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype == torch.int16
    assert got.shape == expected.shape
    assert torch.equal(got, expected)


def test_materialized_routing_is_verls_inline_tensor_byte_for_byte(storage_config):
    keeper = keeper_for(storage_config, SHAPE)
    inline, by_ref = both_batches(keeper, SHAPE)
    expected = inline.batch["routed_experts"]
    assert expected.shape == (8, 32, 3, 2)
    assert "routed_experts" not in by_ref.batch.keys()
    got = materialize(pickle.loads(pickle.dumps(by_ref, protocol=5)), keeper.store).batch["routed_experts"]
    assert_identical(got, expected)
    # verl's layout, checked independently: rows start at the left pad; every 4th sample stops early
    rows = example.engine_outputs(SHAPE)
    for i, o in enumerate(rows):
        start = SHAPE.prompt_length - len(o.prompt_ids)
        assert (expected[i, :start] == 0).all() and (expected[i, start + len(o.routed_experts):] == 0).all()
        assert torch.equal(expected[i, start:start + len(o.routed_experts)], torch.from_numpy(o.routed_experts).short())
    assert [len(o.routed_experts) - len(o.prompt_ids) - len(o.response_ids) for o in rows][:4] == [
        -1, -1, -1, len(rows[3].response_ids) // 2 - len(rows[3].response_ids)]


def test_shares_and_reorders_of_the_batch_materialize_their_own_rows(local_config):
    keeper = keeper_for(local_config, SHAPE)
    inline, by_ref = both_batches(keeper, SHAPE)
    shares = [materialize(share, keeper.store).batch["routed_experts"] for share in by_ref.chunk(2)]
    assert_identical(torch.cat(shares), inline.batch["routed_experts"])
    order = [5, 0, 7, 2, 1, 6, 3, 4]
    got = materialize(by_ref[order], keeper.store).batch["routed_experts"]
    assert_identical(got, inline.batch["routed_experts"][order])


@pytest.mark.parametrize("num_experts, fields_options", [(300, {}), (8, {"routing_rows": "all_but_last"})])
def test_uint16_ids_torch_rows_and_all_but_last_routing_rows(local_config, num_experts, fields_options):
    shape = SHAPE._replace(num_experts=num_experts)
    keeper = keeper_for(local_config, shape, **fields_options)
    inline, by_ref = both_batches(keeper, shape, seed=3, as_torch=True)
    assert int(inline.batch["routed_experts"].max()) >= (256 if num_experts == 300 else 0)
    assert_identical(materialize(by_ref, keeper.store).batch["routed_experts"], inline.batch["routed_experts"])


def test_a_declared_completion_field_is_laid_out_like_the_responses(local_config):
    keeper = keeper_for(local_config, SHAPE, logprobs_k=4)
    worker, outputs = example.verl_worker(SHAPE), example.engine_outputs(SHAPE)
    topk = [np.arange(len(o.response_ids) * 4, dtype=np.int32).reshape(-1, 4) + 1000 * i for i, o in enumerate(outputs)]
    for o, ids in zip(outputs, topk):
        keep_output(keeper, o, fields={"topk_ids": ids})
    data = materialize(example.to_dataproto(worker, outputs), keeper.store, names=("routed_experts", "topk_ids"))
    got = data.batch["topk_ids"]
    assert got.dtype == torch.int32 and got.shape == (8, SHAPE.response_length, 4)
    for i, ids in enumerate(topk):
        assert torch.equal(got[i, :len(ids)], torch.from_numpy(ids)) and (got[i, len(ids):] == 0).all()
    # the response mask verl built marks exactly the rows that carry ids
    assert torch.equal(data.batch["response_mask"].sum(1), torch.tensor([len(ids) for ids in topk]))


def test_release_deletes_each_chunk_exactly_once_and_the_audit_is_clean(storage_config):
    keeper = keeper_for(storage_config, SHAPE)
    _, by_ref = both_batches(keeper, SHAPE)
    refs = [p.slice.ref for p in by_ref.non_tensor_batch[PAYLOAD_KEY]]
    driver = Ledger(keeper.store, "verl_driver")
    result = release(driver, by_ref)
    assert sorted(result.deleted) == sorted(keeper.store.uri(r.key) for r in refs)
    driver.close()
    keeper.ledger.close()
    report = audit(keeper.store, finished=True)
    assert (report.kept, report.deleted, report.present, report.clean) == (8, 8, 0, True)
    with pytest.raises(ChunkNotFoundError):  # never zeros (no re-reads: this store gives up at once)
        materialize(by_ref, open_store(storage_config.model_copy(update={"max_retries": 0})))
    again = Ledger(keeper.store, "verl_driver_1")
    with pytest.raises(DoubleDeleteError) as second:
        release(again, by_ref)
    assert second.value.result.deleted == [] and len(second.value.result.double_deletes) == 8
    again.close()
    assert audit(keeper.store, finished=True).double_deletes == 8


def test_the_dataproto_through_the_driver_loses_the_routing_bytes_and_nothing_else(local_config):
    keeper = keeper_for(local_config, SHAPE)
    inline, by_ref = both_batches(keeper, SHAPE)
    assert sorted(by_ref.batch.keys()) == sorted(k for k in inline.batch.keys() if k != "routed_experts")
    for key in by_ref.batch.keys():
        assert torch.equal(by_ref.batch[key], inline.batch[key]), key
    assert sorted(by_ref.non_tensor_batch) == sorted([*inline.non_tensor_batch, PAYLOAD_KEY])
    payloads = by_ref.non_tensor_batch[PAYLOAD_KEY]
    assert payloads.shape == (8,) and all(isinstance(p, RolloutPayload) for p in payloads)
    payload_bytes = [len(pickle.dumps(p, protocol=5)) for p in payloads]
    assert max(payload_bytes) < 1000
    inline_bytes, by_ref_bytes = (len(pickle.dumps(d, protocol=5)) for d in (inline, by_ref))
    routing_bytes = inline.batch["routed_experts"].nbytes
    assert routing_bytes == 8 * 32 * 3 * 2 * 2
    assert inline_bytes - routing_bytes < by_ref_bytes < inline_bytes - routing_bytes + sum(payload_bytes)


def test_bad_engine_rows_are_refused_and_nothing_is_kept(local_config):
    keeper = keeper_for(local_config, SHAPE)
    too_many, negative, wraps = example.engine_outputs(SHAPE)[:3]
    num_tokens = len(too_many.prompt_ids) + len(too_many.response_ids)
    too_many.routed_experts = np.zeros((num_tokens + 1, 3, 2), np.int32)
    negative.routed_experts[0, 0, 0] = -1
    wraps.routed_experts[0, 0, 0] = 264  # as uint8: 8 (keep checks ids before it narrows them)
    with pytest.raises(FieldError, match=rf"int32 \[{num_tokens + 1}, 3, 2\]: expected rows \[R, num_layers, "
                                         rf"top_k\] with 1 <= R <= {num_tokens} \(prompt \+ response tokens\)"):
        keep_output(keeper, too_many)
    with pytest.raises(FieldError, match=r"'routed_experts': row 0 \[num_layers 0, top_k 0\] value -1: expected >= 0, "
                                         r"< num_experts=8"):
        keep_output(keeper, negative)
    with pytest.raises(FieldError, match=r"'routed_experts': row 0 \[num_layers 0, top_k 0\] value 264: expected >= 0, "
                                         r"< num_experts=8"):
        keep_output(keeper, wraps)
    assert too_many.routed_experts is not None and PAYLOAD_KEY not in too_many.extra_fields
    keeper.ledger.close()
    assert audit(keeper.store, finished=True).kept == 0


def test_routing_rows_in_a_run_without_routing_are_a_field_error(local_config):
    """Fewer rows than tokens would be padded by the routing padding rule, which needs num_experts: a run that
    declares no routing refuses them (it raised a TypeError from ``% None``)."""
    store = open_store(local_config)
    keeper = Keeper(store, Ledger(store, "agent_loop_worker_0"), FieldsConfig(logprobs_k=2), local_config)
    output = example.engine_outputs(SHAPE)[0]
    output.routed_experts = output.routed_experts[:5]
    with pytest.raises(FieldError, match=r"^routed_experts: the engine returned 5 routing rows but this run carries no "
                                         r"routing: expected FieldsConfig num_layers, top_k and num_experts set"):
        keep_output(keeper, output)
    keeper.ledger.close()
    assert audit(store, finished=True).kept == 0


def test_a_batch_that_does_not_match_its_payloads_is_refused(local_config):
    keeper = keeper_for(local_config, SHAPE)
    inline, by_ref = both_batches(keeper, SHAPE)
    with pytest.raises(FieldError, match=r"has no non_tensor_batch\['refpipe_payload'\]"):
        materialize(inline, keeper.store)
    other = example.to_dataproto(example.verl_worker(SHAPE), example.engine_outputs(SHAPE, seed=1))
    other.non_tensor_batch[PAYLOAD_KEY] = by_ref.non_tensor_batch[PAYLOAD_KEY]
    with pytest.raises(FieldError, match=r"sample 0 \(branch .*\): kept prompt/response tokens \[\d+, \d+\], "
                                         r"attention_mask marks \[\d+, \d+\]: expected equal"):
        materialize(other, keeper.store)
    with pytest.raises(FieldError, match="field 'sampling_mask': expected a dense field"):
        materialize(by_ref, keeper.store, names=("sampling_mask",))
    with pytest.raises(FieldError, match="field 'topk_ids': not kept for branch"):
        materialize(by_ref, keeper.store, names=("topk_ids",))


def test_the_example_prints_its_measurements():
    run = subprocess.run([sys.executable, str(EXAMPLE), "--smoke"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    line = json.loads(run.stdout.strip().splitlines()[-1])
    assert list(line)[:4] == ["verl_version", "byte_identical_to_inline", "dataproto_bytes_ratio", "audit_clean"]
    assert line["verl_version"] == verl.__version__ == "0.9.1"
    assert line["byte_identical_to_inline"] is True and line["audit_clean"] is True
    assert line["dataproto_bytes_ratio"] == round(line["by_reference_bytes"] / line["inline_bytes"], 6)
    assert 0 < line["routing_bytes_ratio"] < line["dataproto_bytes_ratio"] < 1
    assert line["shape"] == example.SMOKE._asdict()
