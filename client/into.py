"""Restoring a checkpoint into the tensors a job already has: ``load(path, into=state)``; and slices of its stored
tensors into tensors given for them, reading only the pieces that hold them (``load_slices``: resharded DCP loads).

Why: a job that resumes has built its model and optimizer. Reading the file into fresh
memory and then copying that into them crosses memory twice, and a fresh allocation of the
whole state costs as much as the read itself. Here each storage's bytes go once, from the
disk (or the daemon's replica) into the tensor that will hold them.

Three steps, so that a state that does not fit is never half-written:

1. **Plan.** The skeleton is unpickled with every tensor a meta tensor (no data read) and
   matched with ``into`` key by key. A key one side lacks, or a tensor of another shape or
   dtype, raises StateMismatchError naming it, before any byte of ``into`` is written.
2. **Stream** (client/stream.py). The data region is read in pieces, on READ_THREADS threads, each
   piece in STEP reads into the thread's small page-aligned bounce buffer (O_DIRECT from disk;
   a replica on tmpfs read through the page cache, which it is), hashed and copied out while
   it is in the CPU's cache. A checksum or zip header that does not match, or a file that ends early,
   raises: the restore never returns a half-written state as success. A storage that one
   contiguous tensor of ``into`` covers whole is copied straight into that tensor; any other
   (views sharing a storage, strided tensors, tensors ``into`` has no place for) into one
   fresh buffer, then copied or wrapped from there.
3. **Rebuild.** The skeleton is unpickled again with each matched tensor entry the tensor of
   ``into`` itself, and the rest (a step count, the learning rate, objects) put into
   ``into``'s containers: ``into`` is returned, holding the checkpoint's values.

A tensor of ``into`` on a GPU gets its bytes through the thread's bounce buffer, page-locked
once (cudaHostRegister), by an asynchronous copy on the thread's own stream: never through
pageable memory. The trainer does it rather than the daemon, since the restarted trainer's
tensors are new allocations the daemon has no IPC handles for, and a restore from storage
(no daemon at all) takes the same path.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, MutableSequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from datastates.protocol.descriptors import EntryDesc
from datastates.protocol.errors import StateMismatchError
from datastates.protocol.format import FileHeader, ZipLayout
from datastates.protocol.storage.s3 import one_read

from .entries import Entries
from .filecheck import check_bounds, check_identity, check_views, check_zip, read_header
from .stream import Stream, Target

KeyPath = tuple[Any, ...]
NewKey = Callable[[KeyPath], bool]
"""Whether a key the checkpoint has and ``into`` lacks, at this key path, is added to ``into`` (else an error)."""


def key_name(path: KeyPath) -> str:
    return "".join(f"[{k!r}]" for k in path) or "(the root)"


class _Plan(Entries):
    """The skeleton with every tensor a meta tensor: its structure, shapes and dtypes, with no data read."""

    def __init__(self, path: str, header: FileHeader, region_len: int, weights_only: bool) -> None:
        super().__init__(path, header, weights_only)
        self._region_len = region_len
        self.tensor_entries: dict[int, int] = {}
        """id() of each meta tensor → its entry's index."""

    def storage(self, index: int) -> torch.UntypedStorage:
        check_bounds(self.path, self.header, index, self._region_len)
        return torch.UntypedStorage(self.header.storages[index].nbytes, device="meta")

    def build(self, index: int, entry: EntryDesc) -> Any:
        obj = super().build(index, entry)
        if entry.provider == "tensor":
            self.tensor_entries[id(obj)] = index
        return obj


@dataclass
class _Match:
    """What the plan found: each tensor entry's tensors of ``into``."""

    plan: _Plan
    new_key: NewKey
    into: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    keys: dict[int, KeyPath] = field(default_factory=dict)
    """id() of each tensor of ``into`` matched → its first key path, to name it."""

    def walk(self, ours: Any, theirs: Any, path: KeyPath) -> None:
        """Match the checkpoint's ``ours`` with ``into``'s ``theirs`` at ``path``; raise on the first misfit."""
        index = self.plan.tensor_entries.get(id(ours)) if isinstance(ours, torch.Tensor) else None
        if index is not None:
            if not isinstance(theirs, torch.Tensor):
                raise self.misfit(path, f"the checkpoint holds a tensor, `into` a {type(theirs).__name__}")
            if theirs.shape != ours.shape or theirs.dtype != ours.dtype:
                raise self.misfit(path, f"the checkpoint holds a {ours.dtype} tensor of shape {tuple(ours.shape)}, "
                                        f"`into` a {theirs.dtype} one of shape {tuple(theirs.shape)}")
            unwritable = _unwritable(theirs)
            if unwritable:
                raise self.misfit(path, f"`into`'s tensor {unwritable}")
            self.into.setdefault(index, []).append(theirs)
            self.keys.setdefault(id(theirs), path)
        elif isinstance(theirs, torch.Tensor):
            raise self.misfit(path, f"`into` holds a tensor, the checkpoint a {type(ours).__name__}")
        elif isinstance(ours, Mapping) and isinstance(theirs, Mapping):
            lacking = [k for k in theirs if k not in ours]
            if lacking:
                raise self.misfit(path + (lacking[0],), f"`into` has this key, the checkpoint does not "
                                                        f"({len(lacking)} such keys)")
            extra = [k for k in ours if k not in theirs and not self.new_key(path + (k,))]
            if extra:
                raise self.misfit(path + (extra[0],), f"the checkpoint has this key, `into` does not "
                                                      f"({len(extra)} such keys; strict=False adds them)")
            for k in theirs:
                self.walk(ours[k], theirs[k], path + (k,))
        elif isinstance(ours, (list, tuple)) and isinstance(theirs, (list, tuple)):
            if len(ours) != len(theirs):
                raise self.misfit(path, f"the checkpoint holds {len(ours)} items, `into` {len(theirs)}")
            for k, (a, b) in enumerate(zip(ours, theirs)):
                self.walk(a, b, path + (k,))

    def check_shared(self) -> None:
        """Tensors of ``into`` that share memory must share it as the file's do: the same storage, the same byte
        distance apart, each with its entry's strides. Else one memory would get two tensors' bytes (a model tied
        where the checkpoint's was not), by whichever read thread lands last."""
        spans = []
        for index, tensors in self.into.items():
            for t in tensors:
                if t.numel():
                    reach = (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()
                    spans.append((str(t.device), t.data_ptr(), t.data_ptr() + reach, index, t))
        spans.sort(key=lambda s: s[:2])
        ref: tuple[str, int, int, int, torch.Tensor] | None = None
        end = 0
        for span in spans:
            device, lo, hi, index, t = span
            if ref is None or device != ref[0] or lo >= end:
                ref, end = span, hi
                continue
            end = max(end, hi)
            mine, theirs = self.plan.header.entries[index].meta, self.plan.header.entries[ref[3]].meta
            if (mine["storage"] != theirs["storage"]
                    or lo - ref[1] != mine["storage_offset"] * t.element_size()
                    - theirs["storage_offset"] * ref[4].element_size()
                    or not _alike(t, mine, ref[4], theirs)):
                raise self.misfit(self.keys[id(t)], f"`into`'s tensor shares memory with its tensor at "
                                                    f"{key_name(self.keys[id(ref[4])])}, as the checkpoint's do not: "
                                                    "it cannot hold both")

    def misfit(self, path: KeyPath, why: str) -> StateMismatchError:
        return StateMismatchError(f"{self.plan.path} does not fit `into` at {key_name(path)}: {why}; nothing was "
                                  "written", path=self.plan.path, key=key_name(path))


def _unwritable(t: torch.Tensor) -> str:
    """Why a load cannot write ``t`` (its device, or elements that share memory), or ""."""
    if t.device.type not in ("cpu", "cuda"):
        return f"is on {t.device}, which a restore cannot write to"
    if any(n > 1 and s == 0 for n, s in zip(t.shape, t.stride())):
        return "is expanded (a stride of 0): its elements share memory, so it cannot hold the checkpoint's values"
    if _overlaps_itself(t):
        return ("overlaps itself (its strides make some elements share memory): it cannot hold the checkpoint's "
                "values")
    return ""


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether some elements of ``t`` may share memory through strides other than 0 (the expanded case, checked
    first): each dimension's stride, smallest first, must step past all the smaller dimensions span. torch's own
    check gives up on such strides (and its copy then writes one element over another)."""
    reach = 0
    for n, s in sorted(((n, s) for n, s in zip(t.shape, t.stride()) if n > 1 and s > 0), key=lambda d: d[1]):
        if s <= reach:
            return True
        reach += (n - 1) * s
    return False


def _alike(a: torch.Tensor, a_meta: dict, b: torch.Tensor, b_meta: dict) -> bool:
    """Whether ``into``'s ``a`` and ``b`` lay out their elements as the file's (``a_meta``, ``b_meta``) do: each
    with its entry's strides, or both with one stride and shape on each side (tied on both)."""
    if tuple(a.stride()) == tuple(a_meta["stride"]) and tuple(b.stride()) == tuple(b_meta["stride"]):
        return True
    return a.stride() == b.stride() and a.shape == b.shape and tuple(a_meta["stride"]) == tuple(b_meta["stride"])


def _direct_target(header: FileHeader, entries: list[int], dests: dict[int, list[torch.Tensor]], storage: int
                   ) -> torch.Tensor | None:
    """The tensor of ``into`` that storage ``storage``'s bytes can go straight into, if one can.

    One tensor entry uses the storage, covers all of it as a contiguous view, and its first
    tensor of ``into`` is contiguous: then its bytes are the storage's, in order.
    """
    if len(entries) != 1 or entries[0] not in dests:
        return None
    meta = header.entries[entries[0]].meta
    target = dests[entries[0]][0]
    contiguous = torch.empty(0, device="meta").new_empty(meta["shape"]).stride()
    whole = target.numel() * target.element_size() == header.storages[storage].nbytes
    if meta["storage_offset"] or tuple(meta["stride"]) != tuple(contiguous) or not whole:
        return None
    return target if target.is_contiguous() else None


class _Fill(Entries):
    """The rebuild: matched tensor entries are ``into``'s tensors, the others views of their fresh buffers."""

    def __init__(self, plan: _Plan, dests: dict[int, list[torch.Tensor]], targets: dict[int, Target],
                 device: torch.device | None) -> None:
        super().__init__(plan.path, plan.header, plan.weights_only)
        self._dests = dests
        self._targets = targets
        self._device = device

    def storage(self, index: int) -> torch.UntypedStorage:
        return self._targets[index].tensor.untyped_storage()

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self._device is None or self._device.type == "cpu" else tensor.to(self._device)

    def build(self, index: int, entry: EntryDesc) -> Any:
        if index not in self._dests:
            return super().build(index, entry)
        first, *others = self._dests[index]
        target = self._targets[entry.meta["storage"]]
        if not target.direct:  # from its fresh buffer into each of into's tensors
            view = super().build(index, entry)
            for t in self._dests[index]:
                t.copy_(view)
        for t in others:  # tied in the checkpoint, apart in ``into``: the first one holds the bytes
            if target.direct and not _same_memory(t, first):
                t.copy_(first)
        return first


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.device == b.device and a.stride() == b.stride()


def _merge(theirs: Any, ours: Any) -> Any:
    """``into``'s ``theirs`` holding the rebuilt ``ours``: containers updated in place, tensors kept (filled)."""
    if isinstance(theirs, torch.Tensor):
        return theirs
    if isinstance(theirs, MutableMapping) and isinstance(ours, Mapping):
        for k in ours:
            theirs[k] = _merge(theirs[k], ours[k]) if k in theirs else ours[k]
        return theirs
    if isinstance(theirs, MutableSequence) and isinstance(ours, (list, tuple)):
        for k, v in enumerate(ours):
            theirs[k] = _merge(theirs[k], v)
        return theirs
    if isinstance(theirs, tuple) and isinstance(ours, tuple):
        items = [_merge(a, b) for a, b in zip(theirs, ours)]
        return type(ours)(*items) if hasattr(ours, "_fields") else type(ours)(items)
    return ours


def _opened(path: str, verify: bool, weights_only: bool) -> tuple[FileHeader, int, int, ZipLayout | None, _Plan]:
    """The checked header of ``path``, its data region's span, its zip layout, and its plan (no data read)."""
    header, base, end, layout = read_header(path)
    check_identity(path, header)
    if verify:
        check_views(path, header)
    return header, base, end, layout, _Plan(path, header, end - base, weights_only)


def load_into(path: str, into: Any, device: torch.device | None, *, new_key: NewKey, verify: bool,
              weights_only: bool) -> Any:
    """``into``, its tensors holding the checkpoint at ``path`` (``datastates.load(path, into=...)``)."""
    header, base, end, layout, plan = _opened(path, verify, weights_only)
    if verify and layout is not None:
        check_zip(path, header, layout, None)  # the data region's zip headers: as it streams (check_local_headers)
    match = _Match(plan, new_key)
    match.walk(plan.entry(header.root), into, ())
    match.check_shared()
    users: dict[int, list[int]] = {}
    for index in plan.tensor_entries.values():
        users.setdefault(header.entries[index].meta["storage"], []).append(index)
    targets: dict[int, Target] = {}
    with torch.no_grad():
        for storage, entries in users.items():
            direct = _direct_target(header, entries, match.into, storage)
            nbytes = header.storages[storage].nbytes
            targets[storage] = Target(direct, True) if direct is not None else \
                Target(torch.empty(nbytes, dtype=torch.uint8), False)
        Stream(path, header, layout, (base, end), targets, verify).run()
        return _merge(into, _Fill(plan, match.into, targets, device).entry(header.root))


@dataclass(frozen=True)
class Slice:
    """Elements ``offsets .. offsets + lengths`` of the tensor at a top-level key of a checkpoint, to be read into
    ``into`` (a tensor of shape ``lengths``; of another dtype, converted): a part of one stored shard, as a
    resharded or partial load of ``torch.distributed.checkpoint`` asks for it."""

    key: str
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    into: torch.Tensor
    shape: tuple[int, ...] | None = None
    """The stored tensor's shape, where the caller knows it (DCP's metadata does): checked against the file's."""


def load_slices(path: str, slices: list[Slice], *, verify: bool = True, weights_only: bool = True) -> dict[str, Any]:
    """Fill each slice's ``into`` from the checkpoint at ``path``, reading only the file's pieces that hold them; the
    file's top-level dict, every tensor in it a meta tensor (not read) and its other values as stored.

    A slice that is one contiguous run of its stored tensor's bytes, into a contiguous tensor of the stored dtype,
    is read straight into it (client/stream.py, as an in-place load); any other through a buffer of the bytes it
    spans. Every piece read is checked against its checksum (so a slice is checked with the whole pieces of the
    format around it). A slice that does not fit (a key the file lacks, out of bounds, another shape) raises
    StateMismatchError naming it before anything is written. A storage two slices share is read once.
    """
    with one_read():  # an object's reads share one ETag and its head: its header and data are of one version
        return _load_slices(path, slices, verify, weights_only)


def _load_slices(path: str, slices: list[Slice], verify: bool, weights_only: bool) -> dict[str, Any]:
    header, base, end, _, plan = _opened(path, verify, weights_only)
    root = plan.entry(header.root)
    spans: dict[int, list[tuple[Slice, int, int, dict, torch.dtype]]] = {}
    for piece in slices:
        meta, dtype = _slice_meta(path, plan, root, piece)
        if piece.into.numel():
            es = dtype.itemsize
            first = meta["storage_offset"] + sum(o * s for o, s in zip(piece.offsets, meta["stride"]))
            last = first + sum((n - 1) * s for n, s in zip(piece.lengths, meta["stride"]))
            spans.setdefault(meta["storage"], []).append((piece, first * es, (last + 1) * es, meta, dtype))
    targets: dict[int, Target] = {}
    parts: dict[int, tuple[int, int]] = {}
    with torch.no_grad():
        for storage, wanted in spans.items():
            lo, hi = min(w[1] for w in wanted), max(w[2] for w in wanted)
            piece, _, _, meta, dtype = wanted[0]
            runs = torch.empty(0, device="meta").as_strided(piece.lengths, meta["stride"]).is_contiguous()
            straight = len(wanted) == 1 and runs and piece.into.is_contiguous() and piece.into.dtype == dtype
            targets[storage] = Target(piece.into if straight else torch.empty(hi - lo, dtype=torch.uint8), straight)
            parts[storage] = (lo, hi)
        Stream(path, header, None, (base, end), targets, verify, parts).run()
        for storage, wanted in spans.items():
            lo = parts[storage][0]
            for piece, first, last, meta, dtype in wanted if not targets[storage].direct else ():
                raw = targets[storage].tensor[first - lo:last - lo]
                if (first - lo) % dtype.itemsize:  # one storage viewed as dtypes of several sizes
                    raw = raw.clone()
                typed = raw.view(dtype)
                piece.into.copy_(typed.as_strided(piece.lengths, meta["stride"], typed.storage_offset()))
    return root


def _slice_meta(path: str, plan: _Plan, root: Any, piece: Slice) -> tuple[dict, torch.dtype]:
    """The stored tensor entry's meta (storage, stride, offset) and dtype of a slice that fits it; else
    StateMismatchError."""
    def misfit(why: str) -> StateMismatchError:
        return StateMismatchError(f"{path}: cannot read a slice of {piece.key!r}: {why}; nothing was written",
                                  path=path, key=piece.key)

    stored = root.get(piece.key) if isinstance(root, Mapping) else None
    index = plan.tensor_entries.get(id(stored)) if isinstance(stored, torch.Tensor) else None
    if index is None:
        raise misfit("the checkpoint holds no tensor at that key")
    if len(piece.offsets) != stored.dim() or len(piece.lengths) != stored.dim() or any(
            o < 0 or n < 0 or o + n > size for o, n, size in zip(piece.offsets, piece.lengths, stored.shape)):
        raise misfit(f"elements {list(piece.offsets)} + {list(piece.lengths)} lie outside its shape "
                     f"{list(stored.shape)}")
    if piece.shape is not None and tuple(piece.shape) != tuple(stored.shape):
        raise misfit(f"the file's tensor has shape {list(stored.shape)}, not {list(piece.shape)} as expected")
    if tuple(piece.into.shape) != tuple(piece.lengths):
        raise misfit(f"the slice has shape {list(piece.lengths)}, the tensor to read it into {list(piece.into.shape)}")
    unwritable = _unwritable(piece.into)
    if unwritable:
        raise misfit(f"the tensor to read it into {unwritable}")
    return plan.header.entries[index].meta, stored.dtype
