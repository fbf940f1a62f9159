"""The run layout: every key under a run prefix and every actor name, built and parsed here only.

Keys are relative to the run prefix (``storage.uri.RunPrefix``)::

    payloads/<shard>/<branch_id>/c.0               a branch's chunk (``storage.chunk_codec``)
    payloads/<shard>/<branch_id>/zarr.json         its commit marker, written last
    ledger/events/<actor>/<session>/<bucket>/<seq>.jsonl
                                                   ledger segment ``seq`` of a session ``<pid>-<ms>``, 1,000
                                                   per bucket directory (``segment_key``)
    ledger/deletes/<shard>/<sub>/<branch_id>.json  a chunk's delete record (tombstone), two levels of 256
    ledger/deletes/releases/step_<N:08d>/<actor>.json
                                                   a release record: one DP rank's delete of its chunks of step N
                                                   (S3; ``release_key``)
    ledger/heartbeats/<actor>/<session>.json       a session's heartbeat (``storage.liveness``)
    ledger/audit/summary.json                      the incremental audit's checkpoint (``pipeline.audit_summary``)
    steps/step_<N:08d>.npz                         step file of trainer step N
    config.json                                    the resolved run config (the main job)
    summary.json                                   the run summary (the main job)
    report.png                                     the run's per-step costs, plotted (the main job)
    metrics/trainer_step_<N:08d>.json              trainer metrics of step N (the main job)
    metrics/trainer_finish.json                    the trainer's last release and peak RSS (the main job)
    weights/policy_<V:08d>.pt, weights/latest.json policy weights (the main job)
    checkpoints/step_<N:08d>/                      trainer checkpoint covering step N (``trainer.checkpoint``):
        __<rank>_0.distcp, .metadata               torch.distributed.checkpoint's files
        commit.json                                refpipe's commit marker, written last
    envs/authkey, envs/<replica>.address           env-server auth key and addresses (the main job)

``shard`` is two hex digits of a hash of the branch id (256 directories). Branch ids, actor
names and run ids are 1-128 of ``[A-Za-z0-9._-]`` not starting with ``.``, ``-`` or ``_``;
every parser here matches whole strings (``re.fullmatch``), so a trailing newline is refused.
Parsers return None for keys of another kind, never raise.
"""

from __future__ import annotations

import hashlib
import re
import uuid

from refpipe.storage.errors import ConfigError

PAYLOADS_PREFIX = "payloads"
STEPS_PREFIX = "steps"
EVENTS_PREFIX = "ledger/events"
DELETES_PREFIX = "ledger/deletes"
RELEASES_PREFIX = f"{DELETES_PREFIX}/releases"
BATCHES_PREFIX = f"{RELEASES_PREFIX}/batches"
HEARTBEATS_PREFIX = "ledger/heartbeats"
AUDIT_SUMMARY_KEY = "ledger/audit/summary.json"
AUTHKEY_KEY = "envs/authkey"
DATA_NAME = "c.0"
"""Name of a node's chunk object (``.`` chunk key separator, one chunk)."""
META_NAME = "zarr.json"
"""Name of a node's commit marker (Zarr v3 array metadata)."""
CONFIG_KEY = "config.json"
SUMMARY_KEY = "summary.json"
LATEST_WEIGHTS_KEY = "weights/latest.json"

ORCHESTRATOR_ACTOR = "orchestrator"
SWEEP_ACTOR = "sweep"

_ID = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
ID_RULE = "1-128 of [A-Za-z0-9._-], not starting with . - or _"
_ID_RE = re.compile(_ID)
_SHARD = r"[0-9a-f]{2}"
_NODE = re.compile(rf"(?P<node>{PAYLOADS_PREFIX}/[^/]+/(?P<branch_id>[^/]+))/(?P<name>[^/]+)")
_TOMBSTONE = re.compile(rf"{DELETES_PREFIX}/{_SHARD}/{_SHARD}/(?P<branch_id>{_ID})\.json")
_RELEASE = re.compile(rf"{RELEASES_PREFIX}/step_(?P<step>\d{{8,}})/(?P<actor>{_ID})\.json")
_BATCH = re.compile(rf"{BATCHES_PREFIX}/(?P<actor>{_ID})/(?P<session>\d+-\d+)/\d{{4,}}/(?P<n>\d{{8,}})\.json")
_SEGMENT = re.compile(rf"{EVENTS_PREFIX}/(?P<actor>{_ID})/(?P<session>\d+-\d+)/\d{{4,}}/(?P<seq>\d+)\.jsonl")
_FLAT_SEGMENT = re.compile(rf"{EVENTS_PREFIX}/(?P<actor>{_ID})/(?P<session>\d+-\d+)-(?P<seq>\d+)\.jsonl")
SEGMENTS_PER_DIRECTORY = 1000
"""Ledger segments per bucket directory of a session (``segment_key``)."""
_HEARTBEAT = re.compile(rf"{HEARTBEATS_PREFIX}/(?P<actor>{_ID})/(?P<session>\d+-\d+)\.json")
_STEP = re.compile(rf"{STEPS_PREFIX}/step_(?P<step>\d+)\.npz")
_DRAWN = re.compile(rf"(?P<writer>{_ID})-[0-9a-f]{{32}}")


def is_id(value: str) -> bool:
    """Whether ``value`` is a valid id (whole-string match)."""
    return isinstance(value, str) and _ID_RE.fullmatch(value) is not None


def check_id(value: str, what: str) -> str:
    """Return ``value`` if it is a valid id (branch id, actor name, run id).

    Raises:
        ConfigError: naming ``what`` and the rule.
    """
    if not is_id(value):
        raise ConfigError(f"{what} {value!r}: expected {ID_RULE}")
    return value


# payload nodes -----------------------------------------------------------------------------------------------------


def node_key(branch_id: str) -> str:
    """Key of a branch's array node: ``payloads/<shard>/<branch_id>``.

    Raises:
        ConfigError: not a valid branch id.
    """
    check_id(branch_id, "branch_id")
    return f"{PAYLOADS_PREFIX}/{_shard(branch_id)}/{branch_id}"


def _shard(branch_id: str) -> str:
    return hashlib.blake2b(branch_id.encode(), digest_size=1).hexdigest()


def chunk_keys(node: str) -> tuple[str, str]:
    """``(data_key, meta_key)`` of the node ``node`` (``payloads/<shard>/<branch_id>``).

    For a ref, pass ``ref.key`` (``PayloadRef.key``): derived from its branch id, so confined to the run prefix
    whatever path the writer saw the run under (``OutsideRunError`` there when its URI names another chunk)."""
    return f"{node}/{DATA_NAME}", f"{node}/{META_NAME}"


def meta_key(node: str) -> str:
    """Key of a node's commit marker (``<node>/zarr.json``)."""
    return f"{node}/{META_NAME}"


def parse_payload_key(key: str) -> tuple[str, str, str] | None:
    """``(node, branch_id, object name)`` of a key ``payloads/<a>/<b>/<name>``, or None (a stray key).

    The node is not checked to be a valid ``node_key``: the audit counts whatever sits at that depth."""
    m = _NODE.fullmatch(key)
    return (m["node"], m["branch_id"], m["name"]) if m else None


def branch_id_of(node: str) -> str:
    """The branch id a node key ends with."""
    return node.rpartition("/")[2]


def draw_branch_id(actor: str) -> str:
    """A fresh branch id naming its writer: ``<actor>-<uuid4 hex>``."""
    return f"{actor}-{uuid.uuid4().hex}"


def drawn_writer(branch_id: str) -> str | None:
    """The writer a ``draw_branch_id`` id names, or None for other ids."""
    m = _DRAWN.fullmatch(branch_id)
    return m["writer"] if m else None


# ledger --------------------------------------------------------------------------------------------------------------


def tombstone_key(branch_id: str) -> str:
    """Key of a chunk's delete record: ``ledger/deletes/<shard>/<subshard>/<branch_id>.json``.

    Two hex digits each of a hash of the branch id: 65,536 leaf directories, so a run of 10M chunks
    keeps ~150 records per directory (one level of 256 would hold ~39,000) and no directory of the
    tree exceeds 256 entries until ~17M chunks.

    Raises:
        ConfigError: not a valid branch id.
    """
    check_id(branch_id, "branch_id")
    digest = hashlib.blake2b(branch_id.encode(), digest_size=2).hexdigest()
    return f"{DELETES_PREFIX}/{digest[:2]}/{digest[2:]}/{branch_id}.json"


def parse_tombstone_key(key: str) -> str | None:
    """The node key whose delete record ``key`` is (``tombstone_key`` inverted); None for any other key."""
    m = _TOMBSTONE.fullmatch(key)
    return node_key(m["branch_id"]) if m and tombstone_key(m["branch_id"]) == key else None


def release_prefix(step: int) -> str:
    """Key prefix of step ``step``'s release records: ``ledger/deletes/releases/step_<N:08d>``."""
    return f"{RELEASES_PREFIX}/step_{step:08d}"


def release_key(step: int, actor: str) -> str:
    """Key of ``actor``'s release record of step ``step``: ``ledger/deletes/releases/step_<N:08d>/<actor>.json``.

    Raises:
        ConfigError: not a valid actor name.
    """
    return f"{release_prefix(step)}/{check_id(actor, 'actor')}.json"


def batch_key(actor: str, session: str, n: int) -> str:
    """Key of the ``n``-th delete batch record of ``actor``'s ledger session ``session`` (``Ledger.delete`` on a
    filesystem): ``ledger/deletes/releases/batches/<actor>/<session>/<n // 1000:04d>/<n:08d>.json``.

    Raises:
        ConfigError: not a valid actor name.
    """
    return f"{BATCHES_PREFIX}/{check_id(actor, 'actor')}/{session}/{n // 1000:04d}/{n:08d}.json"


def parse_release_key(key: str) -> tuple[int | None, str] | None:
    """``(step, actor)`` of a release record's key (``release_key`` inverted), ``(None, actor)`` of a delete batch
    record's (``batch_key``); None for any other key."""
    m = _RELEASE.fullmatch(key)
    if m and release_key(int(m["step"]), m["actor"]) == key:
        return int(m["step"]), m["actor"]
    m = _BATCH.fullmatch(key)
    return (None, m["actor"]) if m and batch_key(m["actor"], m["session"], int(m["n"])) == key else None


def session_id(pid: int, opened_ms: int) -> str:
    """A ledger session id: ``<pid>-<ms>``."""
    return f"{pid}-{opened_ms}"


def session_opened_ms(session: str) -> int:
    """Wall-clock milliseconds at which a session (``<pid>-<ms>``) opened; orders one actor's sessions."""
    return int(session.rpartition("-")[2])


def segment_key(actor: str, session: str, seq: int) -> str:
    """Key of a ledger segment: ``ledger/events/<actor>/<session>/<seq // 1000:04d>/<seq:06d>.jsonl``.

    A session's segments fan out into buckets of ``SEGMENTS_PER_DIRECTORY``, so no directory grows with a
    session's length: a session flushes at least every 512 events or 2 s (``storage.ledger_session``), ~43,000 segments
    a day for a long-lived actor, ~31,000 for an env worker keeping 10M chunks (``bench/scale_sim.py``). A
    bucket holds at most 1,000 segments and a session directory one bucket per 1,000 segments (~43 a day;
    4-digit buckets keep key order up to 10M segments, 230 days at one per 2 s); an actor's directory holds
    one entry per session (one per life of the process).
    """
    return f"{EVENTS_PREFIX}/{actor}/{session}/{seq // SEGMENTS_PER_DIRECTORY:04d}/{seq:06d}.jsonl"


def heartbeat_key(actor: str, session: str) -> str:
    """Key of a session's heartbeat: ``ledger/heartbeats/<actor>/<session>.json``."""
    return f"{HEARTBEATS_PREFIX}/{actor}/{session}.json"


def parse_heartbeat_key(key: str) -> tuple[str, str] | None:
    """``(actor, session)`` of a heartbeat key, or None for any other key."""
    m = _HEARTBEAT.fullmatch(key)
    return (m["actor"], m["session"]) if m else None


def parse_segment_key(key: str) -> tuple[str, str, int] | None:
    """``(actor, session, seq)`` of an event segment key, or None for any other key (a bucket that is not
    ``seq``'s, a seq not written as ``segment_key`` writes it).

    Also reads the flat layout of runs written before the bucket level
    (``ledger/events/<actor>/<session>-<seq>.jsonl``), so such a run's sessions and events are read, never
    taken for stray keys.
    """
    m = _SEGMENT.fullmatch(key)
    if m:
        seq = int(m["seq"])
        return (m["actor"], m["session"], seq) if segment_key(m["actor"], m["session"], seq) == key else None
    m = _FLAT_SEGMENT.fullmatch(key)
    return (m["actor"], m["session"], int(m["seq"])) if m else None


# steps, main job ---------------------------------------------------------------------------------------------------


def step_key(step: int) -> str:
    """Key of step ``step``'s file: ``steps/step_<N:08d>.npz``."""
    return f"{STEPS_PREFIX}/step_{step:08d}.npz"


def parse_step_key(key: str) -> int | None:
    """The step number of a ``steps/step_<digits>.npz`` key (``step_key(n) != key`` when not zero-padded
    to 8 digits: callers refuse those), or None for any other key."""
    m = _STEP.fullmatch(key)
    return int(m["step"]) if m else None


def metrics_key(step: int) -> str:
    """Key of the trainer metrics of step ``step``: ``metrics/trainer_step_<N:08d>.json``."""
    return f"metrics/trainer_step_{step:08d}.json"


FINISH_METRICS_KEY = "metrics/trainer_finish.json"
"""Counts of the trainer's last release (``TrainerRank.finish``) and every rank's peak RSS in bytes
(``peak_rss_bytes``, by rank); written by rank 0 after the last step."""

REPORT_KEY = "report.png"
"""``<run>/report.png``: the run's per-step costs (written by the launcher at the end)."""


def weights_key(version: int) -> str:
    """Key of policy version ``version``: ``weights/policy_<V:08d>.pt``."""
    return f"weights/policy_{version:08d}.pt"


# checkpoints ---------------------------------------------------------------------------------------------------------

CHECKPOINTS_PREFIX = "checkpoints"
CHECKPOINT_MARKER_NAME = "commit.json"
"""refpipe's commit marker of a checkpoint, written by rank 0 once every rank's share is durable."""
DCP_METADATA_NAME = ".metadata"
"""torch.distributed.checkpoint's metadata file, written by its coordinator after every rank's share."""
_CHECKPOINT = re.compile(rf"{CHECKPOINTS_PREFIX}/step_(?P<step>\d{{8}})/(?P<name>[^/]+)")


def checkpoint_key(step: int) -> str:
    """Key (directory) of the checkpoint covering step ``step``: ``checkpoints/step_<N:08d>``."""
    return f"{CHECKPOINTS_PREFIX}/step_{step:08d}"


def parse_checkpoint_key(key: str) -> tuple[int, str] | None:
    """``(step, file name)`` of a key inside a checkpoint directory, or None for any other key."""
    m = _CHECKPOINT.fullmatch(key)
    return (int(m["step"]), m["name"]) if m else None


# actor names ---------------------------------------------------------------------------------------------------------


def address_key(replica: int) -> str:
    """Key of env-server replica ``replica``'s address: ``envs/<replica>.address`` (the main job)."""
    return f"envs/{replica}.address"


def env_worker_actor(worker: int) -> str:
    """Ledger actor of env-server worker ``worker``: ``env_worker_<i>``."""
    return f"env_worker_{worker}"


def trainer_actor(dp_rank: int) -> str:
    """Ledger actor of the trainer's DP rank ``dp_rank``: ``trainer_dp<r>``."""
    return f"trainer_dp{dp_rank}"
