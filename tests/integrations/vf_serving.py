"""Test harness: streamers over live traces, and real env servers + clients on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import numpy as np
from verifiers.v1.configs.client import EvalClientConfig
from verifiers.v1.episode import EnvInfo, Episode, WireEpisode
from verifiers.v1.serve import EnvClient, EnvServer
from verifiers.v1.serve.delta import EpisodeAssembly, TraceSummary, dump, pack, unpack
from verifiers.v1.task import TaskData
from verifiers.v1.trace import Trace, TraceTask
from verifiers.v1.types import SamplingConfig
from verifiers.v1.utils.loaders import resolve_env_config

from refpipe.integrations.verifiers_server import RefpipeEnvServer, RefpipeServeConfig
from refpipe.storage.ledger_records import DeleteRecord, delete_record_of
from refpipe.storage.store import Store

TEMPERATURE = 0.7


class Stream:
    """A streamer over a live trace list, and the client-side assembly of what it sent.

    ``make(traces, send)`` builds the streamer (``DeltaStreamer`` or ``RefDeltaStreamer``).
    Every delta goes through msgpack as on the wire; ``sizes`` holds each one's bytes.
    """

    def __init__(self, make: Callable):
        self.traces: list[Trace] = []
        self.assembly = EpisodeAssembly()
        self.deltas: list[dict] = []
        self.sizes: list[int] = []
        self.streamer = make(lambda: self.traces, self._send)

    async def _send(self, delta: dict) -> None:
        data = pack(delta)
        self.sizes.append(len(data))
        self.deltas.append(unpack(data))
        self.assembly.apply(unpack(data))

    def episode(self) -> WireEpisode:
        """The client's validated episode (``EnvClient.run``'s last step)."""
        head = dump(Episode(env=EnvInfo(id="offline"), task=TraceTask(type="OfflineTask", data=TaskData(prompt="q")),
                            ok=True), exclude={"traces"})
        summaries = [TraceSummary(id=t.id, nodes=len(t.nodes), calls=len(t.calls)) for t in self.traces]
        return WireEpisode.model_validate(self.assembly.finish(head, summaries))


def byte_leaves(value) -> list[bytes]:
    """Every raw-bytes value inside a delta (msgpack ``bin``: how arrays ride the wire)."""
    if isinstance(value, bytes):
        return [value]
    if isinstance(value, dict):
        return [b for v in value.values() for b in byte_leaves(v)]
    if isinstance(value, list):
        return [b for v in value for b in byte_leaves(v)]
    return []


def env_config(retries: int = 0):
    """The ``vf_offline_env`` env config (local subprocess runtime: no tunnel, no sandbox)."""
    return resolve_env_config({"taskset": {"id": "vf_offline_env"}, "agent": {"runtime": {"type": "subprocess"}},
                               "retries": {"max_retries": retries}})


@contextlib.asynccontextmanager
async def serving(refpipe: RefpipeServeConfig | None, *, retries: int = 0):
    """A running env server (refpipe's, or verifiers' own when ``refpipe`` is None) and a client."""
    config = env_config(retries)
    address = "tcp://127.0.0.1:0"
    server = (EnvServer(config, address) if refpipe is None
              else RefpipeEnvServer(config=config, refpipe=refpipe, address=address))
    task = asyncio.create_task(server.run())
    client = EnvClient(server.address)
    try:
        yield server, client
    finally:
        await client.close()
        task.cancel()
        await task


async def run(client: EnvClient, seed: int, script: str = "multi_turn", reward: float = 1.0,
              on_delta: Callable[[dict], None] | None = None) -> WireEpisode:
    """One served episode of the offline env."""
    return await client.run(EvalClientConfig(), "m", SamplingConfig(temperature=TEMPERATURE),
                            {"prompt": "q", "seed": seed, "script": script, "reward": reward}, on_delta=on_delta)


def tombstones(store: Store, refs) -> dict[str, dict]:
    """branch id -> the delete record of its chunks (a segmented branch's: its first segment's), for every ref
    whose chunks all have one (KeyError-free: the others are absent)."""
    out = {}
    for ref in refs:
        records = [delete_record_of(store, c.branch_id) for c in ref.chunks]
        if all(isinstance(r, DeleteRecord) for r in records):
            out[ref.branch_id] = records[0].model_dump()
    return out


def payload_nodes(store: Store) -> set[str]:
    """Chunk ids (branch or segment ids) of every chunk object under ``payloads/``."""
    return {key.split("/")[2] for key in store.list_prefix("payloads")}


def chunk_ids(refs) -> set[str]:
    """Chunk ids of every chunk the refs name (a segmented branch's segments)."""
    return {c.branch_id for ref in refs for c in ref.chunks}


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Same dtype, shape and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
