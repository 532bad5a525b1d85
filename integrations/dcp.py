"""``torch.distributed.checkpoint`` (DCP) through datastates: FSDP2, tensor parallel and resharding on load.

DCP already plans sharded saves and loads (which rank writes which shard, and which stored
chunks a rank of another layout needs); this module is only its storage layer::

    fut = dcp.async_save(state, checkpoint_id="/ckpt/step100", storage_writer=DatastatesStorageWriter(client))
    dcp.load(state, checkpoint_id=f"/ckpt/{datastates.latest('/ckpt')}", storage_reader=DatastatesStorageReader())

**Saving.** Each rank hands its daemon one snapshot, ``<checkpoint_id>/rank<R>.pt``, of the
items DCP's plan gives it: references to its local shards (a DTensor's local tensor, a
plain tensor), copied by the daemon lazily, and the few objects DCP pickles itself. The
coordinator adds ``metadata.pt`` (DCP's ``Metadata`` as JSON, ``dcp_meta``, each item's file and key in it)
once every rank's results are in, and the checkpoint folder's name is the tag: it is
committed once, with every rank's file and the metadata durable, and ``dcp.save`` returns
(``async_save``'s future resolves) only then. A second save of a tag while one is under
way (an ``async_save`` not yet resolved, then another save of that checkpoint_id) is refused
with CommitError: through the same client by its writer, through another client by the
daemon. ``async_save`` stages nothing: ``stage()`` takes references to the items on the
caller's thread (no copy) and ``client.expect()`` makes the fence
(``client.protect(optimizer)``) wait for the snapshot DCP's save thread sends, and then for
the daemon's copy, before the optimizer changes a shard.

Call order (DCP's): ``stage`` (``async_save`` only), ``reset(checkpoint_id)``,
``set_up_storage_writer``, ``prepare_local_plan``, ``prepare_global_plan``, ``write_data``
on every rank, then ``finish`` on the coordinator.

**Loading.** ``read_metadata`` refuses a folder whose tag is not committed (an interrupted
save, DCP's own layout, any other folder). Each rank reads the files its plan names: where
its requests cover a file's every item whole, into tensors of the stored shape and dtype
(the same layout as the save), straight into them (``datastates.load(path, into=...)``,
checksums checked); otherwise (resharding, a partial load) only the pieces of the file
that hold the requested slices are read, each slice straight into its tensor where it is
one run of the stored bytes, else through a buffer (``client.reader.restore.load_slices``). With a
``client``, a file the node's daemon still holds in memory is read from there.

Each rank's file is a zip plain ``torch.load`` reads (a dict: ``"<fqn>@<offsets>"`` →
that rank's shard); stock ``dcp.load`` cannot read the folder (DCP's own files hold one
``torch.save`` blob per item), so ``to_filesystem`` (``datastatesctl convert --to dcp``)
writes DCP's own ``FileSystemWriter`` layout of a committed checkpoint.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import os
import pickle
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.distributed.checkpoint import FileSystemWriter, Metadata
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from datastates.client.client import Client
from datastates.client.inflight import Expected
from datastates.client.reader.restore import Slice, load, load_slices
from datastates.protocol.errors import (
    CommitError,
    CorruptCheckpointError,
    InvalidRequestError,
    UnsupportedFormatError,
    WeightsOnlyError,
)
from datastates.protocol.format import marker_name
from datastates.protocol.tags import trusted_marker

from .dcp_meta import ShardAt, decode, encode

METADATA = "metadata.pt"
"""The checkpoint's DCP ``Metadata``, written by the coordinator into the same tag as the ranks' files."""


def rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def entry_key(index: dcp_metadata.MetadataIndex) -> str:
    """An item's key in its rank's file: its fully qualified name, and its chunk's offsets where it is a tensor's."""
    return index.fqn if index.offset is None else f"{index.fqn}@{','.join(map(str, index.offset))}"


def _value(planner: SavePlanner, item: WriteItem) -> Any:
    """What DCP would write for ``item``: a tensor (a reference to the rank's own shard, no copy), or the bytes DCP
    pickled an object into."""
    data = planner.resolve_data(item)
    return data.getvalue() if isinstance(data, io.BytesIO) else data.detach()


def _reference(obj: Any) -> Any:
    """What ``stage`` keeps of one item: a reference to a tensor's (a DTensor's local shard's) memory, or the bytes an
    object is pickled into now (the caller may change it once ``async_save`` returns)."""
    if isinstance(obj, DTensor):
        return obj.to_local().detach()
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    pickled = io.BytesIO()
    torch.save(obj, pickled)
    return pickled.getvalue()


def _nbytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else len(value)


FILES_AT_ONCE = 4
"""Files a rank's load reads at a time: each read has its own threads and 8 MiB buffers (client/reader/stream.py), so a
load from a checkpoint of 64 ranks into one must not start 64 of them."""


ANSWER_WAIT_S = 10.0
"""How long a rank's save of a tag waits for the daemon's answer to the commit of its earlier save of it before it is
refused: a save again right after a save returned may reach ``write_data`` a moment before this rank hears it."""


@dataclass(eq=False)
class _Save:
    """One save's hold on its tag through one client: its folder, and the thread running it."""

    folder: str
    thread: threading.Thread
    commit: concurrent.futures.Future | None = None
    """A rank other than the coordinator asked its commit: held until the daemon answers it, whatever its thread
    does. Where another rank's write failed, the coordinator never commits, and the daemon's round of the tag waits
    with this rank's files in it: a save of the tag that went on would be committed with them."""

    def committing(self) -> bool:
        return self.commit is not None and not self.commit.done()

    def over(self) -> bool:
        """Whether this save has ended without releasing its hold: DCP calls no more of a coordinator's writer once
        another rank's write failed. Its thread has ended (``async_save``'s own), or saves again (``save``)."""
        if self.commit is not None:
            return self.commit.done()
        return not self.thread.is_alive() or self.thread is threading.current_thread()


class _TagsUnderWay:
    """Per client, the tag each of its DCP saves has under way: from ``write_data`` until its commit is answered.

    The daemon tells one client's snapshots of a tag apart by nothing: two saves of a tag at
    once (an ``async_save`` not yet finished, then another save to the same checkpoint_id) would
    be committed as one, their files mixed. The later to write is refused instead (``claim``).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._saves: weakref.WeakKeyDictionary[Client, dict[str, _Save]] = weakref.WeakKeyDictionary()

    def claim(self, client: Client, tag: str, folder: str) -> _Save:
        """Hold ``tag`` for a save into ``folder`` through ``client``; CommitError while another save holds it."""
        with self._lock:
            earlier = self._saves.get(client, {}).get(tag)
        if earlier is not None and earlier.committing():  # the daemon answers a round's ranks at once: this one's
            concurrent.futures.wait([earlier.commit], ANSWER_WAIT_S)  # answer may be a moment behind the coordinator's
        with self._lock:
            saves = self._saves.setdefault(client, {})
            other = saves.get(tag)
            if other is not None and other.committing():
                raise CommitError(f"checkpoint {folder!r} not saved: this rank's commit of its earlier save of tag "
                                  f"{tag!r} into {other.folder!r} is not answered yet (another rank's write failed, so "
                                  "the daemon fails it at its commit_timeout); saving the tag before then would commit "
                                  "it with this rank's earlier file", tag=tag)
            if other is not None and not other.over():
                raise CommitError(f"checkpoint {folder!r} not saved: this client's save of tag {tag!r} into "
                                  f"{other.folder!r} is still under way (an async_save whose future has not resolved, "
                                  "or a save on another thread); a client saves a tag once at a time, so wait for "
                                  "that save first", tag=tag)
            save = saves[tag] = _Save(folder, threading.current_thread())
            return save

    def release(self, client: Client, tag: str, save: _Save) -> None:
        with self._lock:
            saves = self._saves.get(client, {})
            if saves.get(tag) is save:
                del saves[tag]

    def begin(self, client: Client) -> None:
        """An ``async_save`` begins on this thread: the saves through ``client`` this thread ran have ended, one whose
        ``finish`` DCP never called (another rank's write failed) too; its write runs on DCP's thread, not this one."""
        with self._lock:
            saves = self._saves.get(client, {})
            for tag in [t for t, save in saves.items() if save.thread is threading.current_thread()
                        and not save.committing()]:
                del saves[tag]


_UNDER_WAY = _TagsUnderWay()


class DatastatesStorageWriter(StorageWriter, AsyncStager):
    """DCP's storage layer as snapshots and one commit through this rank's ``client`` (see the module's docstring).

    One writer per save, as with DCP's own writers. ``async_save`` runs it on DCP's thread executor (the default);
    the process executor is refused, since a client cannot cross processes.
    """

    _synchronize_after_execute = False

    def __init__(self, client: Client) -> None:
        super().__init__()
        self.client = client
        self.folder = ""
        self.tag = ""
        self.is_coordinator = False
        self._staged: dict[str, Any] | None = None
        self._coming: Expected | None = None
        self._save: _Save | None = None
        """This save's hold on its tag through ``client`` (``_TagsUnderWay``), from ``write_data`` on."""

    def __reduce__(self) -> Any:
        self._release()  # the process executor pickles it after stage(): the fence must not wait for it
        self._let_go()
        raise TypeError("DatastatesStorageWriter holds this rank's connection to its daemon and cannot be sent to "
                        "another process: use async_save's default thread executor")

    # -- AsyncStager: no copy, only the references, taken before async_save returns

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Take a reference to every item this rank may write (a DTensor's local shard, a tensor) and pickle the few
        objects, as DCP's default planner would resolve them, without its plan (21 of 29 ms for 159 DTensors on the
        training thread); the fence then waits for the snapshot ``write_data`` sends from DCP's thread."""
        if self._staged is not None or self._coming is not None:
            raise InvalidRequestError("this DatastatesStorageWriter's previous save is still under way: make one "
                                      "writer per save")
        staged: dict[str, Any] = {}
        with torch.no_grad():  # DTensor.to_local is its local tensor, not an autograd call (7 of 15 ms, 447 DTensors)
            for fqn, obj in flatten_state_dict(state_dict)[0].items():
                staged[fqn] = _reference(obj)
        _UNDER_WAY.begin(self.client)
        self._staged, self._coming = staged, self.client.expect()
        return state_dict

    def synchronize_staging(self) -> None:
        """Nothing is staged: the fence waits for the daemon's copy instead."""

    def close(self) -> None:
        self._release()

    def _release(self) -> None:
        """This save's snapshot will not be sent (any more): the fence stops waiting for it."""
        if self._coming is not None:
            self._coming.close()
            self._coming = None
        self._staged = None

    # -- StorageWriter

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is None:
            raise InvalidRequestError("DatastatesStorageWriter needs a checkpoint_id: the folder to save into, whose "
                                      "name is the tag")
        self.folder = os.path.abspath(os.fspath(checkpoint_id))
        self.tag = os.path.basename(self.folder)

    def _let_go(self) -> None:
        """This save no longer holds its tag: its commit was answered, or it failed before."""
        if self._save is not None:
            _UNDER_WAY.release(self.client, self.tag, self._save)
            self._save = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        _needs_id(self.folder, "DatastatesStorageWriter")
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Snapshot this rank's items as one file; the results say where each is, before a byte is copied."""
        name = rank_file(self.client.ranks.rank)
        entries: dict[str, Any] = {}
        results: list[WriteResult] = []
        try:
            self._save = _UNDER_WAY.claim(self.client, self.tag, self.folder)  # where DCP tells every rank of a failure
            for item in plan.items:
                key = entry_key(item.index)
                if key in entries:
                    raise InvalidRequestError(f"two items of this rank's plan are both stored as {key!r} (a key "
                                              "that names a tensor's chunk as well): rename one")
                entries[key] = self._staged_item(item) if self._staged is not None else _value(planner, item)
                results.append(WriteResult(index=item.index, size_in_bytes=_nbytes(entries[key]),
                                           storage_data=ShardAt(name, key)))
            with self._coming.sending() if self._coming is not None else contextlib.nullcontext():
                self.client.snapshot(entries, os.path.join(self.folder, name), tag=self.tag)
            if not self.is_coordinator:  # the coordinator commits in finish(), with the metadata
                self._save.commit = self.client.commit(self.tag)
                self._save.commit.add_done_callback(lambda _: self._let_go())
        except BaseException:
            self._let_go()
            raise
        finally:
            self._release()
        fut: Future[list[WriteResult]] = Future()  # torch's: DCP waits on it
        fut.set_result(results)
        return fut

    def _staged_item(self, item: WriteItem) -> Any:
        """What ``stage`` took for ``item``: its fqn's local shard, which must be the item's whole chunk."""
        value = self._staged.get(item.index.fqn) if self._staged is not None else None
        chunk = item.tensor_data.chunk.sizes if item.tensor_data is not None else None
        if value is None or (chunk is not None and (not isinstance(value, torch.Tensor) or value.shape != chunk)):
            raise InvalidRequestError(f"DCP's plan asks this rank to write {entry_key(item.index)!r}, which is not "
                                      "what stage() took for it (one local shard per tensor, DCP's default planner): "
                                      "not supported by DatastatesStorageWriter")
        return value

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The coordinator's metadata joins its own file in the tag, which it then commits for every rank; returns
        once committed (CommitError: a rank's part failed, so the checkpoint is not visible)."""
        try:
            if len(results) != self.client.ranks.world_size:
                raise InvalidRequestError(f"this save has {len(results)} rank(s), the job "
                                          f"{self.client.ranks.world_size}: a tag commits once every rank of the job "
                                          "commits it, so save on every rank (DCP's default process group), not a "
                                          "subgroup or no_dist")
            metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
            self.client.snapshot({"dcp": encode(metadata)}, os.path.join(self.folder, METADATA), tag=self.tag)
            self.client.commit(self.tag).result()
        finally:
            self._let_go()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


class DatastatesStorageReader(StorageReader):
    """DCP's storage layer for loading a committed datastates checkpoint, into any layout (see the module's
    docstring). ``client``: read a file the node's daemon still holds in memory from there."""

    def __init__(self, client: Client | None = None, *, weights_only: bool = True) -> None:
        """``weights_only``: each object DCP pickled (``torch.save``, loaded by its planner with
        ``weights_only=False``) must first load with torch's safe unpickler, or the load raises WeightsOnlyError
        naming it; False only for checkpoints you trust."""
        super().__init__()
        self.client = client
        self.weights_only = weights_only
        self.files: set[str] = set()
        """The files the checkpoint's commit marker lists: the only ones its metadata may name."""
        self.folder = ""
        self.storage_data: dict[dcp_metadata.MetadataIndex, ShardAt] = {}
        self._chunks: dict[dcp_metadata.MetadataIndex, tuple[torch.Size, torch.dtype]] = {}
        """Each stored tensor chunk's shape and dtype."""

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.folder = os.path.abspath(os.fspath(checkpoint_id))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata of a committed checkpoint; CommitError for a folder that is not one."""
        _needs_id(self.folder, "DatastatesStorageReader")
        tag = os.path.basename(self.folder)
        marker = trusted_marker(os.path.join(self.folder, marker_name(tag)))
        self.files = {f.path for f in marker.files} if marker is not None else set()
        if METADATA not in self.files:
            dcp_own = os.path.exists(os.path.join(self.folder, ".metadata"))
            raise CommitError(f"{self.folder!r} is not a committed datastates DCP checkpoint (no valid commit marker "
                              f"naming its {METADATA}): " + ("it is DCP's own layout; read it with FileSystemReader"
                                                            if dcp_own else "an interrupted save, or another folder"),
                              tag=tag)
        path = os.path.join(self.folder, METADATA)
        raw = load(path)
        if not isinstance(raw, dict) or not isinstance(raw.get("dcp"), bytes):
            raise UnsupportedFormatError(f"{path}: not DCP metadata of this datastates (a dict with 'dcp', its JSON)",
                                         path=path)
        return decode(raw["dcp"], path)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        strays = sorted({at.file for at in metadata.storage_data.values()}
                        - (self.files - {METADATA}))
        if strays:
            raise CorruptCheckpointError(f"{self.folder}: its metadata names {strays[:4]}, which are not files of its "
                                         "committed tag: refused", path=self.folder)
        self.storage_data = metadata.storage_data
        self._chunks = {dcp_metadata.MetadataIndex(fqn, chunk.offsets): (chunk.sizes, md.properties.dtype)
                        for fqn, md in metadata.state_dict_metadata.items()
                        if isinstance(md, dcp_metadata.TensorStorageMetadata) for chunk in md.chunks}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Each file this rank's plan names, read once: into its tensors where it fits them whole, else the slices
        of it the plan asks for, and only the pieces that hold them. FILES_AT_ONCE files are read at a time, on a
        thread each (a resharded load reads a few scalars from most files: their latency hides behind the large
        reads); the planner hears of each item on this thread, after every read succeeded."""
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].file, []).append(item)
        keys: dict[str, set[str]] = {}
        for at in self.storage_data.values():
            keys.setdefault(at.file, set()).add(at.key)
        reads: dict[str, tuple[dict[str, Any] | None, dict[int, Slice]]] = {}
        for name, items in per_file.items():
            into = self._into(items, planner, keys[name])
            reads[name] = into, {} if into is not None else {
                id(item): Slice(self.storage_data[item.storage_index].key, tuple(item.storage_offsets),
                                tuple(item.lengths), planner.resolve_tensor(item).detach(),
                                shape=tuple(self._chunks[item.storage_index][0]))
                for item in items if item.type != LoadItemType.BYTE_IO}

        def read(name: str) -> dict[str, Any]:
            into, slices = reads[name]
            return self._read(name, lambda path: load(path, into=into) if into is not None else
                              load_slices(path, list(slices.values())))

        with ThreadPoolExecutor(max(1, min(FILES_AT_ONCE, len(per_file))), thread_name_prefix="ds-dcp-read") as pool:
            states = dict(zip(per_file, pool.map(read, per_file)))
        for name, items in per_file.items():
            into, slices = reads[name]
            for item in items:
                key = self.storage_data[item.storage_index].key
                if item.type == LoadItemType.BYTE_IO:
                    pickled = _pickled(states[name], key, os.path.join(self.folder, name))
                    if self.weights_only:
                        _safe(pickled, name, item.storage_index.fqn)
                    planner.load_bytes(item, io.BytesIO(pickled))
                    continue
                planner.commit_tensor(item, into[key] if into is not None else slices[id(item)].into)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _into(self, items: list[ReadItem], planner: LoadPlanner, file_keys: set[str]) -> dict[str, Any] | None:
        """The tensors to read one file straight into, where ``items`` take every item of it whole, each into a
        tensor of its stored shape and dtype (a load in the layout of the save); else None."""
        into: dict[str, Any] = {}
        for item in items:
            key = self.storage_data[item.storage_index].key
            if key in into:
                return None
            if item.type == LoadItemType.BYTE_IO:
                into[key] = None
                continue
            shape, dtype = self._chunks.get(item.storage_index, (None, None))
            target = planner.resolve_tensor(item).detach()
            if (shape is None or any(item.storage_offsets) or tuple(item.lengths) != tuple(shape)
                    or target.size() != shape or target.dtype != dtype):
                return None
            into[key] = target
        return into if set(into) == file_keys else None

    def _read(self, name: str, read: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
        """``read`` of one file of the checkpoint: from the daemon's memory where a client is given and it holds it,
        else from storage."""
        if self.client is not None:
            root, tag = os.path.split(self.folder)
            restored = self.client.restore_with(root, name, read, tag=tag)
            if restored is not None:
                return restored.state
        return read(os.path.join(self.folder, name))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


def _needs_id(folder: str, who: str) -> None:
    """InvalidRequestError for a save or load given no checkpoint_id (DCP then never calls ``reset``)."""
    if not folder:
        raise InvalidRequestError(f"{who} needs a checkpoint_id: the checkpoint's folder, whose name is its tag")


def _pickled(state: Any, key: str, path: str) -> bytes:
    """The object DCP pickled that a file's ``state`` holds at ``key``, where the checkpoint's metadata says it is;
    CorruptCheckpointError where the file holds no bytes there."""
    value = state.get(key) if isinstance(state, dict) else None
    if not isinstance(value, bytes):
        raise CorruptCheckpointError(f"{path}: the checkpoint's metadata says {key!r} is an object pickled there, "
                                     f"but the file holds {type(value).__name__} at {key!r}", path=path)
    return value


def _safe(pickled: bytes, name: str, fqn: str) -> None:
    """Refuse an object DCP pickled that torch's safe unpickler will not build (WeightsOnlyError naming it)."""
    try:
        torch.load(io.BytesIO(pickled), weights_only=True)
    except pickle.UnpicklingError as exc:
        raise WeightsOnlyError(f"{name}: {fqn} holds an object torch's safe unpickler refuses ({exc}); load with "
                               "DatastatesStorageReader(weights_only=False) only a checkpoint you trust",
                               path=name) from None


def to_filesystem(folder: str | os.PathLike, out: str | os.PathLike) -> str:
    """Write the committed datastates DCP checkpoint ``folder`` in DCP's own ``FileSystemWriter`` layout at ``out``,
    for stock ``dcp.load`` or ``format_utils.dcp_to_torch_save``; returns ``out``. Every item is read whole (the
    state at its saved, global shapes) in this one process. A failure is raised as its own error (CommitError: not a
    committed checkpoint), not as DCP's CheckpointException."""
    state: dict[str, Any] = {}
    reader = DatastatesStorageReader()
    reader.reset(folder)
    reader.read_metadata()  # its error as it is: DCP's loader would log it with its traceback, then wrap it
    try:
        _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        dcp_save(state, storage_writer=FileSystemWriter(os.fspath(out)), no_dist=True)
    except CheckpointException as exc:  # a BaseException, the one rank's error and traceback in it
        raise next(iter(exc.failures.values()))[0] from None
    return os.fspath(out)
