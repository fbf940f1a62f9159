"""The store fault matrix (issue 13): every operation of a run x every fault kind, through the loopback
fault proxy (``tests/helpers/fault_proxy.py``) in front of each S3 server (moto, SeaweedFS), with exact outcomes.

Operations: keep, publish step, flush ledger, fetch whole, fetch truncated, delete, weights put, checkpoint put
and get (DCP through the store, a one-rank gloo world in this process). Faults:
see ``fault_proxy.KINDS``. A fault is injected once into the named request; the store's retries (2,
backoff 10 ms; read timeout 1.5 s for the ``delay`` fault, 30 s otherwise) absorb it. Each case asserts
what is stored, the retries and write-token recoveries counted, the ``DeleteResult`` per ref, and that the
audit of the run is clean afterwards.
Faults that do not apply to an operation are not in its list (a PUT has no body to cut short; a
``DeleteObjects`` is the only request with per-key errors).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from refpipe.job.weights import publish_weights
from refpipe.pipeline.audit import audit
from refpipe.pipeline.step_file import StepFile
from refpipe.storage.backends import open_store
from refpipe.storage.chunk_read import fetch_arrays
from refpipe.storage.errors import ChunkNotFoundError, TransientStorageError, TruncatedChunkError
from refpipe.storage.layout import (
    LATEST_WEIGHTS_KEY,
    checkpoint_key,
    chunk_keys,
    segment_key,
    step_key,
    tombstone_key,
    weights_key,
)
from refpipe.storage.ledger import Ledger
from tests.helpers.checkpoint import FILES, STEP, assert_loads_back, one_rank_world, save, trained
from tests.helpers.fault_proxy import Fault, FaultProxy
from tests.pipeline.audit_helpers import NUM_COMPLETION, NUM_PROMPT, keep, make_keeper, publish

WRITE_FAULTS = ["reset_before", "reset_after", "500_after", "slowdown", "conflict", "delay"]
READ_FAULTS = ["reset_before", "reset_after", "500_after", "slowdown", "delay", "short_body", "cut_body", "404"]
APPLIED = {"reset_after", "500_after"}
"""Write faults after which the server holds the object: the retry gets 412 and the write token resolves it."""
RESENT_BELOW = {"reset_before", "reset_after"}
"""Faults after which aiohttp itself resends an idempotent request (PUT, GET, HEAD, DELETE; not the POST of
``DeleteObjects``) once, at once (RFC 9112 9.3.1): below refpipe's retry layer, so not in ``store.retries``."""


def assert_retries(store, proxy, kind: str, method: str, requests: int = 1) -> None:
    """One fault of ``kind`` on a request of ``method`` was absorbed by exactly one resend of that request (so the
    key saw its fault-free ``requests`` plus the faulted one): by ``store.retries`` (counted), or for a reset of an
    idempotent request maybe by aiohttp (not counted)."""
    faulted = [r for r in proxy.requests if r[2] == kind]
    clean = [r for r in proxy.requests if r[:2] == faulted[0][:2] and r[2] is None]
    assert len(faulted) == 1 and len(clean) == requests, proxy.requests
    assert store.retries == 1 or (kind in RESENT_BELOW and method != "POST" and store.retries == 0)
DELAY_S = 2.0
DELAY_TIMEOUT_S = 1.5
"""A ``delay`` fault holds its request ``DELAY_S``, past the store's ``DELAY_TIMEOUT_S`` read timeout, which
times it out (one retry); a fault-free request on a loaded 2-core CI host takes far below ``DELAY_TIMEOUT_S``
(0.5 s was not: a SeaweedFS request timed out once and counted a second retry)."""
OTHER_TIMEOUT_S = 30.0
"""Cases without a ``delay`` fault never time out: their exact retry counts must not depend on host load."""


@pytest.fixture(params=["moto", "seaweedfs"])
def run(request):
    """``(direct store, store through the proxy, proxy)`` of a fresh run on each S3 server."""
    config = request.getfixturevalue("s3_config" if request.param == "moto" else "seaweed_config")
    timeout = DELAY_TIMEOUT_S if request.node.callspec.params.get("kind") == "delay" else OTHER_TIMEOUT_S
    with FaultProxy(config.s3_endpoint_url) as proxy:
        faulty = config.model_copy(update={"s3_endpoint_url": proxy.url, "max_retries": 2, "retry_backoff_s": 0.01,
                                           "s3_timeout_s": timeout})
        yield open_store(config), open_store(faulty), proxy
        proxy.settle()  # a held request reaches the server before teardown


def _fault(kind: str, method: str, key: str, **kw) -> Fault:
    return Fault(kind, method, key.replace(".", r"\.") + "$", delay_s=DELAY_S, **kw)


def _assert_write_recovered(store, proxy, kind: str) -> None:
    assert_retries(store, proxy, kind, "PUT")
    assert store.idempotent_puts == (1 if kind in APPLIED else 0)


@pytest.mark.parametrize("kind", WRITE_FAULTS)
@pytest.mark.parametrize("target", ["c.0", "zarr.json"])
def test_keep(run, kind, target):
    direct, store, proxy = run
    keeper = make_keeper(store, store.config)
    proxy.add(_fault(kind, "PUT", f"/{target}"))
    ref = keep(keeper, seed=1)
    proxy.settle()
    _assert_write_recovered(store, proxy, kind)
    assert sorted(k for k in direct.list_prefix("payloads")) == sorted(chunk_keys(ref.key))
    assert fetch_arrays(direct, ref)["topk_ids"].shape == (NUM_COMPLETION, 2)
    assert keeper.discard([ref]).deleted == [ref.uri]
    _assert_audit_clean(direct, keeper.ledger, deleted=1)


def _assert_audit_clean(direct, *ledgers, deleted: int) -> None:
    for ledger in ledgers:
        ledger.close()
    report = audit(direct, finished=True)
    assert report.violations == [] and (report.deleted, report.present, report.double_deletes) == (deleted, 0, 0)


@pytest.mark.parametrize("kind", WRITE_FAULTS)
def test_publish_step(run, kind):
    direct, store, proxy = run
    keeper = make_keeper(direct, direct.config)
    refs = [keep(keeper, seed=s) for s in range(2)]
    proxy.add(_fault(kind, "PUT", f"/{step_key(0)}"))
    header = publish(store, 0, refs, [0, 1])
    proxy.settle()
    _assert_write_recovered(store, proxy, kind)
    assert StepFile.read(direct, 0).header.model_copy(update={"stream_crc32c": {}}) == header
    assert direct.list_prefix("steps") == [step_key(0)]


@pytest.mark.parametrize("kind", WRITE_FAULTS)
def test_flush_ledger(run, kind):
    direct, store, proxy = run
    ledger = Ledger(store, "env_worker_0")
    proxy.add(_fault(kind, "PUT", segment_key("env_worker_0", ledger.session, 1)))
    ledger.record("receive", branch_ids=["a"])
    ledger.flush()
    ledger.close()
    proxy.settle()
    _assert_write_recovered(store, proxy, kind)
    segments = [[json.loads(line)["event"] for line in direct.get(k).splitlines()]
                for k in direct.list_prefix("ledger/events/env_worker_0")]
    assert segments == [["open"], ["receive"], ["close"]]


@pytest.mark.parametrize("kind", WRITE_FAULTS)
def test_weights_put(run, kind):
    direct, store, proxy = run
    model = torch.nn.Linear(3, 2)
    proxy.add(_fault(kind, "PUT", f"/{weights_key(0)}"))
    publish_weights(store, model, 0)
    proxy.settle()
    _assert_write_recovered(store, proxy, kind)
    assert direct.list_prefix("weights") == [LATEST_WEIGHTS_KEY, weights_key(0)]


MULTIPART_FAULTS = [("reset_before", "PUT", "partNumber=2&"), ("slowdown", "PUT", "partNumber=2&"),
                    ("delay", "PUT", "partNumber=2&"), ("500_after", "POST", "^uploadId="),
                    ("reset_after", "POST", "^uploadId="), ("500_after", "POST", "^uploads")]


@pytest.mark.parametrize("kind,method,query", MULTIPART_FAULTS)
def test_multipart_put(run, kind, method, query):
    """An exclusive put above the part size (a checkpoint share over 5 GiB on AWS) is one multipart upload. A fault
    on a part costs one resend of that part; a completion applied but answered with an error makes ``Store.put``
    upload again, and the completion meets its own object (412) and write token. A lost answer to the upload's
    creation leaves that empty upload on the server (nothing under the run prefix; a bucket lifecycle rule
    reclaims it); every other upload is completed or aborted."""
    direct, store, proxy = run
    store = open_store(store.config.model_copy(update={"s3_part_size_bytes": 5 * 2**20}))
    body = np.arange(11 * 2**20 + 1, dtype=np.uint8) % 251  # 3 parts
    proxy.add(Fault(kind, method, r"/share$", query=query, delay_s=DELAY_S))
    store.put("share", body, exclusive=True)
    proxy.settle()
    assert direct.get("share") == body.tobytes() and direct.list_prefix("") == ["share"]
    whole_again = method == "POST" and query == "^uploadId="
    assert store.idempotent_puts == (1 if whole_again else 0)
    assert store.retries == 1 or (kind in RESENT_BELOW and method == "PUT" and store.retries == 0)
    bucket, _, object_key = direct.path("share").partition("/")
    uploads = direct.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=object_key).get("Uploads")
    assert len(uploads or []) == (1 if query == "^uploads" else 0)


@pytest.fixture(scope="module")
def world():
    with one_rank_world() as group:
        yield group


@pytest.mark.parametrize("kind,target", [*((k, "__0_0.distcp") for k in WRITE_FAULTS), ("reset_after", ".metadata")])
def test_checkpoint_put(run, world, kind, target):
    """A rank's share (a file DCP closes) and DCP's ``.metadata`` (a file DCP renames into place): one exclusive put
    each, with its write token. ``.metadata`` takes the same ``Store.put`` as the share; only its lost answer is
    a case here (the rename path's own one)."""
    direct, store, proxy = run
    model, optimizer = trained()
    proxy.add(_fault(kind, "PUT", f"/{checkpoint_key(STEP)}/{target}"))
    assert save(store, world, model, optimizer) == direct.uri(checkpoint_key(STEP))
    proxy.settle()
    _assert_write_recovered(store, proxy, kind)
    assert direct.list_prefix("checkpoints") == FILES
    assert_loads_back(direct, model, optimizer)


@pytest.mark.parametrize("kind", ["short_body", "404"])
def test_checkpoint_get(run, world, kind):
    """A rank's share read back through ``Store.get``: the two read faults a put has no row for (a body cut short; a
    404 for a file the complete checkpoint names, read again). The other kinds take the same retry as in
    ``test_fetch`` (``delay`` alone costs 2 s a case)."""
    direct, store, proxy = run
    model, optimizer = trained()
    save(direct, world, model, optimizer)
    proxy.add(_fault(kind, "GET", f"/{checkpoint_key(STEP)}/__0_0.distcp"))
    assert_loads_back(store, model, optimizer)
    assert_retries(store, proxy, kind, "GET")


@pytest.mark.parametrize("kind", READ_FAULTS)
@pytest.mark.parametrize("num_tokens", [None, NUM_PROMPT + 1], ids=["whole", "truncated"])
def test_fetch(run, kind, num_tokens):
    direct, store, proxy = run
    ref = keep(make_keeper(direct, direct.config), seed=2)
    expected = fetch_arrays(store, ref, num_tokens)
    gets = len(proxy.requests)  # a truncated fetch reads one byte range per array
    proxy.requests.clear()
    proxy.add(_fault(kind, "GET", "/c.0"))
    got = fetch_arrays(store, ref, num_tokens)
    assert list(got) == list(expected) and all(np.array_equal(got[k], expected[k]) for k in expected)
    assert_retries(store, proxy, kind, "GET", requests=gets)


def _kept_pair(direct):
    keeper = make_keeper(direct, direct.config)
    return [keep(keeper, seed=s) for s in (3, 4)], keeper


def _assert_deleted(direct, refs) -> None:
    """Both chunks deleted once each, by their delete records, and the finished run audits clean."""
    assert direct.list_prefix("payloads") == []
    assert direct.list_prefix("ledger/deletes") == sorted(tombstone_key(r.branch_id) for r in refs)
    _assert_audit_clean(direct, deleted=len(refs))


@pytest.mark.parametrize("kind", WRITE_FAULTS)
def test_delete_claim_put(run, kind):
    direct, store, proxy = run
    refs, keeper = _kept_pair(direct)
    proxy.add(_fault(kind, "PUT", f"/{tombstone_key(refs[0].branch_id)}"))
    result = Ledger(store, "trainer_dp0").delete(refs, reason="trained")
    proxy.settle()
    assert [result.outcome(r.uri) for r in refs] == ["deleted", "deleted"] and result.failed == {}
    _assert_write_recovered(store, proxy, kind)
    _assert_deleted(direct, refs)


@pytest.mark.parametrize("kind", ["reset_before", "reset_after", "500_after", "slowdown", "delay"])
def test_delete_objects_request(run, kind):
    direct, store, proxy = run
    refs, _ = _kept_pair(direct)
    proxy.add(_fault(kind, "POST", "/" + chunk_keys(refs[0].key)[0]))
    result = Ledger(store, "trainer_dp0").delete(refs, reason="trained")
    proxy.settle()
    assert result.deleted == [r.uri for r in refs] and result.failed == {}
    assert store.retries == 1
    _assert_deleted(direct, refs)


@pytest.mark.parametrize("code", ["InternalError", "SlowDown"])
def test_delete_objects_transient_key_error_is_retried_for_that_key(run, code):
    direct, store, proxy = run
    refs, _ = _kept_pair(direct)
    data_key = chunk_keys(refs[1].key)[0]
    proxy.add(_fault("key_error", "POST", f"/{data_key}", code=code))
    result = Ledger(store, "trainer_dp0").delete(refs, reason="trained")
    assert result.deleted == [r.uri for r in refs] and result.failed == {}
    assert store.retries == 1 and proxy.hits == {"key_error": 1}
    _assert_deleted(direct, refs)


def test_delete_objects_permanent_key_error_is_an_unfinished_delete_finished_later(run):
    direct, store, proxy = run
    refs, keeper = _kept_pair(direct)
    data_key = chunk_keys(refs[1].key)[0]
    proxy.add(_fault("key_error", "POST", f"/{data_key}", code="AccessDenied", times=None))
    trainer = Ledger(store, "trainer_dp0")
    result = trainer.delete(refs, reason="trained")
    assert [result.outcome(r.uri) for r in refs] == ["deleted", "failed"]
    assert "AccessDenied" in str(result.failed[refs[1].uri])
    assert direct.list_prefix("payloads") == [data_key]  # the commit marker went first: a fetch is a miss
    assert trainer.unfinished == [refs[1].uri]
    assert audit(direct).unfinished_deletes == [refs[1].uri]
    proxy.clear()
    again = trainer.finish_unfinished()  # the same holder, its own claim: never a double delete
    assert again.deleted == [refs[1].uri] and again.double_deletes == {} and trainer.unfinished == []
    keeper.ledger.close()
    trainer.close()
    _assert_deleted(direct, refs)


def test_delete_objects_refused_falls_back_to_single_key_deletes(run):
    direct, store, proxy = run
    refs, _ = _kept_pair(direct)
    proxy.add(_fault("refuse_delete", "POST", "", times=None))
    result = Ledger(store, "trainer_dp0").delete(refs, reason="trained")
    assert result.deleted == [r.uri for r in refs] and result.failed == {}
    assert store.retries == 0 and proxy.hits == {"refuse_delete": 1}
    assert sorted(k for m, k, _ in proxy.requests if m == "DELETE") == sorted(
        f"/{direct.path(k)}" for r in refs for k in chunk_keys(r.key))
    _assert_deleted(direct, refs)


def test_commit_marker_404_once_is_read_again_not_an_unknown_ref(run):
    direct, store, proxy = run
    refs, _ = _kept_pair(direct)
    proxy.add(_fault("404", "HEAD", "/" + chunk_keys(refs[0].key)[1]))
    result = Ledger(store, "trainer_dp0").delete(refs, reason="trained")
    assert result.deleted == [r.uri for r in refs] and result.unknown == {}
    assert store.retries == 1
    _assert_deleted(direct, refs)


def test_claim_applied_but_answered_500_every_time_is_this_holders_on_the_next_call(run):
    direct, store, proxy = run
    refs, _ = _kept_pair(direct)
    tomb = tombstone_key(refs[0].branch_id)
    proxy.add(_fault("500_after", "PUT", f"/{tomb}", times=None))
    trainer = Ledger(store, "trainer_dp0")
    first = trainer.delete(refs, reason="trained")
    assert [first.outcome(r.uri) for r in refs] == ["failed", "deleted"]
    assert isinstance(first.failed[refs[0].uri], TransientStorageError)
    assert direct.exists(tomb) and trainer.unfinished == [refs[0].uri]
    proxy.clear()
    second = trainer.delete([refs[0]], reason="trained")  # the caller retries the same ref
    assert second.deleted == [refs[0].uri] and second.double_deletes == {}
    assert json.loads(direct.get(tomb))["holder"] == "trainer_dp0"
    _assert_deleted(direct, refs)
    with pytest.raises(ChunkNotFoundError):
        fetch_arrays(direct, refs[0])


def test_a_failed_keep_ends_the_group_not_the_worker_and_a_resend_gets_fresh_branch_ids(run):
    """An env worker's group whose third branch's commit marker PUT is refused (403): the group's kept branches are
    discarded, nothing of it stays, and the re-sent group (next attempt) keeps under new branch ids."""
    from refpipe.job.config import RunConfig
    from refpipe.job.env_worker import GroupRequest, run_group
    from refpipe.job.workload.model import MoELM

    direct, store, proxy = run
    cfg = RunConfig(storage=store.config)
    keeper = make_keeper(store, store.config)
    keeper.fields = cfg.fields
    model = MoELM(cfg.model).eval()
    request = GroupRequest(7, "g000007", 7)
    proxy.add(_fault("denied", "PUT", "/g000007-a0-2/zarr.json", times=None))
    failed = run_group(model, keeper, cfg, request, worker=0, version=0)
    assert failed.episodes == [] and failed.discarded == 2 and "AccessDenied" in failed.failed
    assert direct.list_prefix("payloads") == []
    assert direct.list_prefix("ledger/deletes") == sorted(tombstone_key(f"g000007-a0-{i}") for i in (0, 1))
    again = run_group(model, keeper, cfg, GroupRequest(7, "g000007", 7, attempt=1), worker=0, version=0)
    n = cfg.orchestrator.group_size
    assert again.failed is None and [e.branches[0].ref.branch_id for e in again.episodes] == [
        f"g000007-a1-{i}" for i in range(n)]
    assert keeper.discard([e.branches[0].ref for e in again.episodes]).failed == {}
    _assert_audit_clean(direct, keeper.ledger, deleted=2 + n)


@pytest.mark.parametrize("num_tokens", [None, NUM_PROMPT + 1], ids=["whole", "truncated"])
def test_a_body_cut_on_every_read_is_a_typed_error_after_the_retries(run, num_tokens):
    """Every GET of the chunk answers half its body with a matching length: a whole read fails its transport
    checksum, a ranged read comes back short; each is read again (2 retries), then a typed error."""
    direct, store, proxy = run
    ref = keep(make_keeper(direct, direct.config), seed=2)
    proxy.add(Fault("cut_body", "GET", r"/c\.0$", times=None))
    if num_tokens is None:
        with pytest.raises(TransientStorageError, match=r"gave up after 3 attempts: .*FlexibleChecksumError"):
            fetch_arrays(store, ref)
    else:
        with pytest.raises(TruncatedChunkError, match=r"read 12 bytes \(truncated chunk; read 3 times\)$"):
            fetch_arrays(store, ref, num_tokens)
    assert (proxy.hits["cut_body"], store.retries) == (3, 2)
