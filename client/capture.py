"""Turning a state tree into handles and entries, in the trainer, without copying bytes.

The state is pickled once with a ``persistent_id`` hook: each leaf a registered provider
captures (protocol/providers: CPU and CUDA tensors) becomes an entry that references shared
memory or a CUDA IPC block, and everything else stays in the pickled skeleton, the object
provider's payload. New kinds of leaves plug in by registering a provider for their type.
"""

from __future__ import annotations

import contextlib
import gc
import io
import pickle
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from datastates.protocol.descriptors import CUDA_IPC, EMPTY, SHM, VM, EntryDesc, Fence, SourceDesc
from datastates.protocol.errors import InvalidRequestError
from datastates.protocol.providers import PLAIN, provider_for
from datastates.protocol.torchzip import PICKLE_PROTOCOL

from .cuda import GpuRoute, record_fences
from .shm import SegmentPool


@dataclass
class Capture:
    """What one ``snapshot()`` sends: byte sources, entries, and the root entry's index."""

    segments: SegmentPool | None = None
    """Where CPU storages are copied for the daemon to map; None: it reads them in place, by address."""
    gpu: GpuRoute | None = None
    """How CUDA storages reach the daemon, per device (client/cuda.py); None: this process saves them itself."""
    staged: list[torch.UntypedStorage] = field(default_factory=list)
    """The segments this capture took from ``segments``: given back once the daemon has copied them."""
    sources: list[SourceDesc] = field(default_factory=list)
    entries: list[EntryDesc] = field(default_factory=list)
    root: int = -1
    fences: list[Fence] = field(default_factory=list)
    """One per GPU whose storages the daemon reads through CUDA IPC: ``seal()`` records them."""
    keepalive: list[Any] = field(default_factory=list)
    """Held until the daemon has copied: the tensors, and the CUDA events it waits on."""
    storages: list[torch.UntypedStorage | None] = field(default_factory=list)
    """Each source's storage: held with the tensors (the daemon reads in-place sources at their address), and
    read directly by a local save, which cannot open its own CUDA IPC handles."""
    _source_index: dict[tuple[int, int], int] = field(default_factory=dict)
    _ipc_devices: set[int] = field(default_factory=set)

    def add_storage(self, storage: torch.UntypedStorage, cuda: bool) -> int:
        """Index of ``storage`` (a CUDA one if ``cuda``: its tensor says so faster) among this capture's sources; a
        storage shared by views counts once."""
        nbytes = storage.nbytes()
        if nbytes == 0:
            return self._add(SourceDesc(kind=EMPTY, handle="", nbytes=0), None)
        key = (storage._cdata, nbytes)  # the StorageImpl: stable when sharing moves its data
        index = self._source_index.get(key)
        if index is None:
            index = self._source_index[key] = self._add(self._describe(storage, nbytes, cuda), storage)
        return index

    def _describe(self, storage: torch.UntypedStorage, nbytes: int, cuda: bool) -> SourceDesc:
        if cuda:
            if self.gpu is None:  # a save in this very process (fallback="local"): it reads the storage itself
                return SourceDesc(kind=CUDA_IPC, handle="", nbytes=nbytes)
            handle = self.gpu.ipc(storage.device.index) and self.gpu.blocks.handle(
                storage, required=self.gpu.mode == "ipc")  # "ipc": CUDA IPC or an error, never a host copy
            if handle:
                self._ipc_devices.add(storage.device.index)
                return SourceDesc(kind=CUDA_IPC, handle=handle, nbytes=nbytes)
            pool = self.gpu.segments  # the daemon cannot open it: copied here, to host
        elif self.segments is None:
            return SourceDesc(kind=VM, handle=f"{storage.data_ptr():x}", nbytes=nbytes)
        else:
            pool = self.segments
        segment, name = pool.copy_in(storage)
        self.staged.append(segment)
        return SourceDesc(kind=SHM, handle=name, nbytes=nbytes)

    def seal(self) -> None:
        """Record the snapshot's fences, one per GPU read through CUDA IPC.

        Recorded after the whole tree is walked, so they also order the kernels capture
        queued itself (``resolve_conj``).
        """
        if self._ipc_devices:
            self.fences = record_fences(self._ipc_devices, self.keepalive)

    def give_back(self) -> None:
        """The segments this capture took, free for reuse: the daemon has copied them, or never will."""
        pool = self.gpu.segments if self.gpu is not None else self.segments  # one SegmentPool per client
        if self.staged and pool is not None:
            pool.give_back(self.staged)
            self.staged = []

    def _add(self, desc: SourceDesc, storage: torch.UntypedStorage | None) -> int:
        self.sources.append(desc)
        self.storages.append(storage)
        return len(self.sources) - 1

    def add_entry(self, entry: EntryDesc) -> int:
        self.entries.append(entry)
        return len(self.entries) - 1


def _leaf_names(state: Any, prefix: str = "", out: dict[int, str] | None = None, depth: int = 0) -> dict[int, str]:
    """Dotted key paths of the leaves under dicts, lists and tuples, for error messages."""
    out = {} if out is None else out
    if depth > 64:
        return out
    if isinstance(state, dict):
        items = state.items()
    elif isinstance(state, (list, tuple)):
        items = enumerate(state)
    else:
        out.setdefault(id(state), prefix or "<root>")
        return out
    for k, v in items:
        _leaf_names(v, f"{prefix}.{k}" if prefix else str(k), out, depth + 1)
    return out


class _CapturingPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, cap: Capture, names: dict[int, str]) -> None:
        super().__init__(file, protocol=PICKLE_PROTOCOL)
        self._cap = cap
        self._names = names
        self._seen: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) in PLAIN:  # a state's keys, and its numbers: half the calls of a state of many tensors
            return None
        key = id(obj)
        if key in self._seen:
            return self._seen[key]
        provider = provider_for(obj)
        if provider is None:
            return None
        entry = provider.capture(obj, self._names.get(key, f"<leaf {len(self._seen)}>"), self._cap)
        if entry is None:
            return None
        self._seen[key] = self._cap.add_entry(entry)
        self._cap.keepalive.append(obj)
        return self._seen[key]


_gc_lock = threading.Lock()
_gc_pauses = 0
_gc_was_enabled = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's automatic collection held off while a snapshot is captured and sent (then as it was before).

    A capture makes a few objects per tensor, none of them garbage until the snapshot is sent, and the
    collector scanned them over and over as they grew: 0.8 of 1.7 s for 100,000 tensors. Nested and threaded
    pauses count, so the last one out restores what the trainer had (torchtitan, for one, turns it off itself).
    """
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


def capture(state: Any, segments: SegmentPool | None = None, gpu: GpuRoute | None = None) -> Capture:
    """Describe ``state`` as sources, leaf entries and a pickled root entry; ``segments``, ``gpu``: see ``Capture``."""
    cap = Capture(segments=segments, gpu=gpu)
    buf = io.BytesIO()
    try:
        _CapturingPickler(buf, cap, _leaf_names(state)).dump(state)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        cap.give_back()
        raise InvalidRequestError(f"state cannot be serialized: {exc}") from None
    except BaseException:  # a segment that did not fit: the ones taken so far are free again
        cap.give_back()
        raise
    cap.root = cap.add_entry(EntryDesc(provider="pickle", name="<skeleton>", meta={"data": buf.getvalue()}))
    cap.seal()
    return cap
