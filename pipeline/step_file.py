"""Step files: one per trainer step, token streams inline, side channels by reference (docs/step-files.md).

A step file is an uncompressed ``.npz`` (a zip of ``.npy`` arrays, readable with numpy alone:
``np.load(path)``) under ``<run>/steps/step_<N:08d>.npz`` with ``header.json`` (the ``StepHeader``:
schema version, run, step, ``seq_len``, the run's field shapes, every micro batch's sequences and
the refs they use, each stream member's crc32c) and ``dp<r>.mb<i>.<stream>.npy`` for every micro
batch ``i`` of DP rank ``r`` and every token stream in ``STREAMS`` and ``header.extra_streams``
(``[T]``, ``T`` = the micro batch's real tokens; padding to ``seq_len`` is the trainer's job).

Reading validates: a truncated or foreign file, an unknown schema version, a ref outside the run
prefix, a ref whose arrays disagree with the header's field shapes, a ``seq_len`` above
``MAX_SEQ_LEN`` or unequal to a micro batch's tokens plus padding, or a stream member whose crc32c,
dtype or shape disagrees with the header is a ``StepFileError`` naming the file, raised before
anything is sized from the header. A ref that disagrees with itself or its use (a slice longer than
its chunk, rows against its token counts) makes only its micro batches unusable
(``StepHeader.micro_batch_problem``). Published with one exclusive put (temp + link on a
filesystem, one conditional PUT on S3), after every chunk it references was kept.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from collections.abc import Mapping

import numpy as np
from pydantic import ValidationError

from refpipe.pipeline.step_header import SCHEMA_VERSION, STREAMS, StepHeader
from refpipe.pipeline.step_zip import npy_header_bytes, stream_member
from refpipe.storage.backends import open_store
from refpipe.storage.checksum import crc32c
from refpipe.storage.chunk_ref import REF_ROWS_CHECKED_PER_USE
from refpipe.storage.config import run_storage
from refpipe.storage.errors import ConfigError, KeyExistsError, StepFileError, validation_problems
from refpipe.storage.layout import STEPS_PREFIX, parse_step_key, step_key
from refpipe.storage.store import Store

HEADER_MEMBER = "header.json"
"""The zip member holding the ``StepHeader`` (JSON)."""


def member_name(dp_rank: int, index: int, stream: str) -> str:
    """Zip member of one stream of one micro batch."""
    return f"dp{dp_rank}.mb{index}.{stream}.npy"


def encode_step_file(header: StepHeader, streams: Mapping[tuple[int, int], Mapping[str, np.ndarray]]) -> bytes:
    """Serialise a step: ``streams[(dp_rank, index)][name]`` is a [T] array of ``header.stream_dtypes()[name]``.

    The header is written with ``stream_crc32c`` set to the crc32c of every stream member's bytes.

    Raises:
        StepFileError: a stream is missing, of the wrong dtype, or not [T] for its micro batch.
    """
    members: dict[str, tuple[bytes, np.ndarray]] = {}
    for mb in header.micro_batches:
        arrays = streams.get((mb.dp_rank, mb.index), {})
        for name, dtype in header.stream_dtypes().items():
            a = arrays.get(name)
            if a is None or a.dtype.str != dtype or a.shape != (mb.num_tokens,):
                got = None if a is None else f"{a.dtype.str} {list(a.shape)}"
                raise StepFileError(f"step {header.step} dp_rank={mb.dp_rank} micro batch {mb.index}: stream "
                                    f"{name!r} is {got}: expected {dtype} [{mb.num_tokens}]")
            # the .npy bytes np.lib.format.write_array writes: its 1.0 header, then the array
            members[member_name(mb.dp_rank, mb.index, name)] = (npy_header_bytes(dtype, mb.num_tokens),
                                                                np.ascontiguousarray(a).view(np.uint8))
    crcs = {member: crc32c(body, crc32c(head))
            for member, (head, body) in members.items()}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        # members dated 1980-01-01 (ZipInfo's default), not now: the same step encodes to the same bytes, so a
        # publish retried after a lost answer is recognised as this writer's own (the store's write token)
        zf.writestr(zipfile.ZipInfo(HEADER_MEMBER), header.model_copy(update={"stream_crc32c": crcs}).model_dump_json())
        for member, (head, body) in members.items():
            with zf.open(zipfile.ZipInfo(member), "w") as f:
                f.write(head)
                f.write(body)  # type: ignore[call-overload]  # numpy stubs: ndarray a Buffer only from 3.12
    return buf.getvalue()


def publish_step_file(store: Store, header: StepHeader,
                      streams: Mapping[tuple[int, int], Mapping[str, np.ndarray]]) -> str:
    """Write a step file with one exclusive put; return its URI.

    A publish that failed although its put was applied (every answer lost) is done when the same step is
    published again: the step file already there holds these very bytes (``Store.put`` tells only the retries of
    one call apart by its write token).

    Raises:
        StepFileError: as ``encode_step_file``, or the header belongs to another run.
        KeyExistsError: this step was already published with other contents.
    """
    if header.run_uri != store.prefix.uri:
        raise StepFileError(f"step {header.step}: header run_uri {header.run_uri!r}, expected {store.prefix.uri!r}")
    key = step_key(header.step)
    data = encode_step_file(header, streams)
    try:
        store.put(key, data, exclusive=True)
    except KeyExistsError:
        if store.get(key) != data:
            raise
    return store.uri(key)


class StepFile:
    """A step file, read-only: its validated header and the token streams of every micro batch.

    Open one with ``read_step_file(uri)`` (a path or URI of ``<root>/<run_id>/steps/step_<N:08d>.npz``),
    ``StepFile.read(store, step)`` (a run's store, as every trainer rank does) or ``StepFile.from_bytes``
    (a file already in memory). Reading validates the header (``StepHeader``) and every stream member
    once: its crc32c against ``StepHeader.stream_crc32c``, then its ``.npy`` dtype, shape and byte count
    against the header; any damage is a ``StepFileError`` naming the file and the member. Nothing here
    writes, deletes or imports torch.

    Token streams of a micro batch of ``T`` real tokens (``StepFile.streams``; ``STREAMS``), each ``[T]``,
    its sequences concatenated in packing order, no padding:

    - ``input_ids`` int32 (``<i4``): token ids, each sequence's prompt then completion;
    - ``loss_mask`` bool (``|b1``): True on completion tokens (trained), False on prompt tokens and on
      a padding dummy's;
    - ``advantages`` float32 (``<f4``): the sequence's advantage on completion tokens, 0 on prompt tokens;
    - ``inference_logprobs`` float32 (``<f4``): logprob of each completion token under the sampling
      policy, 0 on prompt tokens;
    - ``position_ids`` int32 (``<i4``): 0, 1, ... within each sequence;
    - ``temperatures`` float32 (``<f4``): the sampling temperature of each token.

    Attributes:
        header: the ``StepHeader`` (micro batches, sequences, refs, owners, fields, metrics).
        uri: the step file's URI (in the run as opened); errors name it.
        damaged: member name -> what is wrong with it; empty unless opened with ``parse``.
    """

    stream_names: tuple[str, ...] = tuple(STREAMS)
    """Names of the token streams of every micro batch, in member order."""

    def __init__(self, header: StepHeader, streams: dict[str, np.ndarray], damaged: dict[str, str], uri: str):
        self.header, self._streams, self.damaged, self.uri = header, streams, damaged, uri

    @classmethod
    def read(cls, store: Store, step: int) -> "StepFile":
        """Read and validate step ``step`` of the store's run (one ``Store.get``).

        Raises:
            KeyNotFoundError: the step file does not exist (yet).
            StepFileError: truncated, foreign, unknown schema version, a ref whose URI names
                another chunk than its branch id, a ref whose arrays disagree with ``header.fields``,
                a stream member missing, damaged (crc32c) or of another dtype or shape than the header
                says, or a header whose ``step`` is not ``step``.
        """
        key = step_key(step)
        step_file = cls.from_bytes(store.get(key), store.uri(key))
        check_step(step_file.header, step, step_file.uri)
        return step_file

    @classmethod
    def from_bytes(cls, data: bytes, uri: str) -> "StepFile":
        """Validate a step file's bytes (see ``read``); ``uri`` names it in errors."""
        step_file = cls.parse(data, uri)
        if step_file.damaged:
            raise StepFileError(next(iter(step_file.damaged.values())))
        return step_file

    @classmethod
    def parse(cls, data: bytes, uri: str) -> "StepFile":
        """As ``from_bytes``, but a damaged stream member is listed in ``damaged`` (``refpipe verify``: every
        problem, one line each) instead of raised; ``streams`` raises it for its micro batch.

        Raises:
            StepFileError: the container or the header cannot be read (as ``read``).
        """
        try:
            zf = zipfile.ZipFile(io.BytesIO(data))
            compressed = [i.filename for i in zf.infolist() if i.compress_type != zipfile.ZIP_STORED]
            if compressed:  # a stored member reads at most the file's own bytes; a deflated one its declared size
                raise ValueError(f"member {compressed[0]} is compressed: expected every member stored")
            raw = json.loads(zf.read(HEADER_MEMBER))
        except (zipfile.BadZipFile, KeyError, ValueError, EOFError) as e:
            raise StepFileError(f"step file {uri}: not a readable step file (truncated or foreign): {e}") from e
        if raw.get("schema_version") != SCHEMA_VERSION:
            raise StepFileError(f"step file {uri}: schema_version {raw.get('schema_version')!r}, "
                                f"expected {SCHEMA_VERSION}")
        try:
            header = StepHeader.model_validate(raw, context=REF_ROWS_CHECKED_PER_USE)
        except ValidationError as e:
            raise StepFileError(f"step file {uri}: invalid header: {validation_problems(e)}") from e
        streams, damaged = {}, {}
        view = memoryview(data)
        for mb in header.micro_batches:
            num_tokens = mb.num_tokens
            for name, dtype in header.stream_dtypes().items():
                member = member_name(mb.dp_rank, mb.index, name)
                try:
                    streams[member] = stream_member(view, zf, member, dtype, num_tokens, header.stream_crc32c)
                except ValueError as e:
                    damaged[member] = f"step file {uri}: {e}"
        return cls(header, streams, damaged, uri)

    def streams(self, dp_rank: int, index: int) -> dict[str, np.ndarray]:
        """The token streams of one micro batch: name -> [T] array of ``header.stream_dtypes()[name]`` (fresh,
        writable copies).

        Raises:
            StepFileError: no such micro batch, or (opened with ``parse``) one of its members is damaged.
        """
        out = {}
        for name in self.header.stream_dtypes():
            member = member_name(dp_rank, index, name)
            if member in self.damaged:
                raise StepFileError(self.damaged[member])
            if member not in self._streams:
                raise StepFileError(f"step file {self.uri}: no micro batch dp_rank={dp_rank} index={index}")
            out[name] = self._streams[member].copy()
        return out


def read_step_file(uri: str, *, s3_endpoint_url: str | None = None) -> StepFile:
    """Open the step file at ``uri`` read-only: ``StepFile.read`` of its run's store.

    Args:
        uri: ``<root>/<run_id>/steps/step_<N:08d>.npz`` as a local path (relative or absolute), a
            ``file://`` or an ``s3://`` URI.
        s3_endpoint_url: S3 endpoint (MinIO, Ceph RGW, moto); default: ``AWS_ENDPOINT_URL`` or AWS.

    Raises:
        ConfigError: ``uri`` does not name a step file under a run's ``steps/``.
        KeyNotFoundError, StepFileError: as ``StepFile.read``.
    """
    store, step = locate_step_file(uri, s3_endpoint_url)
    return StepFile.read(store, step)


def locate_step_file(uri: str, s3_endpoint_url: str | None = None) -> tuple[Store, int]:
    """The run's store and the step of ``<root>/<run_id>/steps/step_<N:08d>.npz`` (see ``read_step_file``);
    the store is opened, nothing is read.

    Raises:
        ConfigError: ``uri`` does not name a step file under a run's ``steps/``.
    """
    absolute = uri if "://" in uri else os.path.abspath(os.path.expanduser(uri))
    run_uri, _, name = absolute.rpartition(f"/{STEPS_PREFIX}/")
    step = parse_step_key(f"{STEPS_PREFIX}/{name}") if run_uri else None
    if step is None or step_key(step) != f"{STEPS_PREFIX}/{name}":
        raise ConfigError(f"step URI {uri!r}: expected <root>/<run_id>/steps/step_<N:08d>.npz")
    return open_store(run_storage(run_uri, s3_endpoint_url)), step


def check_step(header: StepHeader, step: int, uri: str) -> None:
    """Raise ``StepFileError`` unless the header of the file at ``uri`` (named for ``step``) holds step ``step``."""
    if header.step != step:
        raise StepFileError(f"step file {uri}: header says step {header.step}, expected step {step}")
