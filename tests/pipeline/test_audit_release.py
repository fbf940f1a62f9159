"""Release policies and retention in the ledger (issue 12): held chunks, retained chunks, ``sweep --retained``.

Two DP ranks release two published steps through ``trainer.release.ReleasePolicy`` in one process;
the audit is read after each move.
"""

from __future__ import annotations

from audit_helpers import keep, make_keeper, publish
from refpipe.cli.main import app
from refpipe.pipeline.audit import audit, sweep
from refpipe.storage.backends import open_store
from refpipe.storage.ledger import Ledger
from refpipe.trainer.background import BackgroundRelease, ReleaseCounts
from refpipe.trainer.config import TrainerConfig
from refpipe.trainer.release import ReleasePolicy
from typer.testing import CliRunner

AWAITING = "trainer_dp{} (trained, awaiting checkpoint)"


def released(rank: ReleasePolicy, step: int) -> ReleaseCounts:
    """A checkpoint covering ``step`` is durable: release what it covers and wait for the background deletes."""
    rank.checkpointed(step)
    rank.background.wait()
    return rank.background.take_counts()


def test_after_checkpoint_holds_then_deletes_and_retained_steps_are_swept_once(storage_config):
    store = open_store(storage_config)
    keeper = make_keeper(store, storage_config)
    refs = [keep(keeper, seed) for seed in range(4)]
    keeper.ledger.close()
    headers = [publish(store, 0, refs[:2], [0, 1]), publish(store, 1, refs[2:], [0, 1])]
    config = TrainerConfig(release="after_checkpoint", retain_steps=[1])
    ranks = [ReleasePolicy(BackgroundRelease(Ledger(store, f"trainer_dp{r}"), r, 2), config) for r in range(2)]
    for header in headers:
        for rank in ranks:
            rank.trained(header)
    assert [rank.background.take_counts() for rank in ranks] == [ReleaseCounts(), ReleaseCounts()]
    report = audit(store, stopped=True)
    assert report.outstanding_by_holder == {AWAITING.format(0): 2, AWAITING.format(1): 2}
    assert (report.deleted, report.retained, report.leaked) == (0, 0, 0) and report.clean

    assert released(ranks[0], 1) == ReleaseCounts(deletes=1)  # step 0 deleted, step 1 retained
    report = audit(store, stopped=True)
    # step 1 stays held whole until every owner released it (a replaying rank may borrow rows)
    assert report.outstanding_by_holder == {AWAITING.format(1): 2, "trainer step 1": 1}
    assert (report.deleted, report.retained, report.leaked) == (1, 0, 0) and report.clean
    assert released(ranks[1], 1) == ReleaseCounts(deletes=1)
    for rank in ranks:
        rank.background.shutdown()
        rank.ledger.close()
    report = audit(store, finished=True)
    assert (report.kept, report.deleted, report.retained, report.outstanding) == (4, 2, 2, 0) and report.clean
    step1 = store.uri("steps/step_00000001.npz")
    endpoint = ["--s3-endpoint-url", storage_config.s3_endpoint_url] if storage_config.s3_endpoint_url else []
    assert CliRunner().invoke(app, ["verify", step1, *endpoint]).exit_code == 0  # the retained arrays are all there

    result = CliRunner().invoke(app, ["sweep", "--retained", store.prefix.uri, *endpoint])
    assert result.exit_code == 0 and "deleted 2 chunks" in result.output, result.output
    report = audit(store, finished=True)
    assert (report.kept, report.deleted, report.retained, report.double_deletes) == (4, 4, 0, 0) and report.clean
    assert store.list_prefix("payloads") == []
    assert sweep(store, retained=True).retained == []  # exactly once: a second sweep finds nothing
    assert CliRunner().invoke(app, ["verify", step1, *endpoint]).exit_code == 1


def test_retain_every_nth_step_and_bad_values():
    config = TrainerConfig(retain_steps=3)
    assert [s for s in range(8) if config.retains(s)] == [0, 3, 6]
    assert not TrainerConfig().retains(0)
    for bad, expected in ((0, "retain_steps=0: expected a list of steps or every N-th step with N >= 1"),
                          ([2, -1], "retain_steps=[2, -1]: expected steps >= 0")):
        try:
            TrainerConfig(retain_steps=bad)
        except ValueError as e:
            assert expected in str(e)
        else:
            raise AssertionError(f"retain_steps={bad} was accepted")
