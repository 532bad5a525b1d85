"""Reading a checkpoint file back: ``load`` (fresh, or into the tensors a job already has) and ``load_slices``.

Every read is one sequence: open the file and check its header and identity
(client/reader/checks.py) → plan → stream the data region in checked pieces
(client/reader/stream.py) → rebuild the entries through their providers
(client/reader/rebuild.py). ``verify`` is the same sequence with nothing rebuilt.

**A fresh load** reads the data region in one pass of large parallel reads into one buffer,
every storage a slice of it, as with ``torch.load(mmap=True)``: no per-tensor allocation and
no second copy; then rebuilds the skeleton over it.

**A load into ``into``** (``load(path, into=state)``; slices of stored tensors into tensors
given for them, reading only the pieces that hold them: ``load_slices``, resharded DCP loads).

Why: a job that resumes has built its model and optimizer. Reading the file into fresh
memory and then copying that into them crosses memory twice, and a fresh allocation of the
whole state costs as much as the read itself. Here each storage's bytes go once, from the
disk (or the daemon's replica) into the tensor that will hold them.

Three steps, so that a state that does not fit is never half-written:

1. **Plan.** The skeleton is unpickled once, every tensor over address space that no memory
   backs (``reserve``) until the stream is done, and walked once beside
   ``into``, key by key. A key one side lacks, or a tensor of another shape or dtype, raises
   StateMismatchError naming it, before any byte of ``into`` is written.
2. **Stream** (client/reader/stream.py). The data region is read in pieces, on READ_THREADS threads, each
   piece in STEP reads into the thread's small page-aligned bounce buffer (O_DIRECT from disk;
   a replica on tmpfs read through the page cache, which it is), hashed and copied out while
   it is in the CPU's cache. A checksum or zip header that does not match, or a file that ends early,
   raises: the restore never returns a half-written state as success. A storage that one
   contiguous tensor of ``into`` covers whole is copied straight into that tensor; any other
   (views sharing a storage, strided tensors, tensors ``into`` has no place for) into one
   fresh buffer, then copied or viewed from there.
3. **Merge.** Each tensor of the skeleton is given its memory (``.data``): the one of its
   tensor of ``into``, or its fresh buffer's; then what the walk planned: ``into``'s
   containers get the skeleton's other values (a step count, the learning rate, objects,
   keys ``into`` lacks), its tensors are kept, and ``into`` is returned, holding the
   checkpoint's values.

A tensor of ``into`` on a GPU gets its bytes through the thread's bounce buffer, page-locked
once (cudaHostRegister), by an asynchronous copy on the thread's own stream: never through
pageable memory. The trainer does it rather than the daemon, since the restarted trainer's
tensors are new allocations the daemon has no IPC handles for, and a restore from storage
(no daemon at all) takes the same path.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Mapping, MutableMapping, MutableSequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from datastates.protocol.errors import StateMismatchError
from datastates.protocol.format import FileHeader
from datastates.protocol.storage import backend_for
from datastates.protocol.tags import file_commits

from .checks import CheckpointFile, open_file
from .rebuild import Rebuild
from .source import reserve
from .stream import Stream, Target

MapLocation = str | torch.device | None
KeyPath = tuple[Any, ...]
Merged = Callable[[], Any]
"""What a value of ``into`` becomes once the data is read: called after the stream (nothing is written before)."""
NewKey = Callable[[KeyPath], bool]
"""Whether a key the checkpoint has and ``into`` lacks, at this key path, is added to ``into`` (else an error)."""


def key_name(path: KeyPath) -> str:
    return "".join(f"[{k!r}]" for k in path) or "(the root)"


@dataclass
class _Match:
    """What the plan found: each tensor entry's tensors of ``into``."""

    plan: Rebuild
    new_key: NewKey
    into: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    keys: dict[int, KeyPath] = field(default_factory=dict)
    """id() of each tensor of ``into`` matched → its first key path, to name it."""

    def walk(self, ours: Any, theirs: Any, path: KeyPath) -> Merged:
        """Match the checkpoint's ``ours`` with ``into``'s ``theirs`` at ``path``; raise on the first misfit. Returns
        what ``theirs`` becomes: its containers updated in place, its tensors kept (filled)."""
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
            return lambda: theirs
        if isinstance(theirs, torch.Tensor):
            raise self.misfit(path, f"`into` holds a tensor, the checkpoint a {type(ours).__name__}")
        if isinstance(ours, Mapping) and isinstance(theirs, Mapping):
            lacking = [k for k in theirs if k not in ours]
            if lacking:
                raise self.misfit(path + (lacking[0],), f"`into` has this key, the checkpoint does not "
                                                        f"({len(lacking)} such keys)")
            extra = [k for k in ours if k not in theirs and not self.new_key(path + (k,))]
            if extra:
                raise self.misfit(path + (extra[0],), f"the checkpoint has this key, `into` does not "
                                                      f"({len(extra)} such keys; strict=False adds them)")
            parts = {k: self.walk(ours[k], theirs[k], path + (k,)) for k in theirs}
            return lambda: _merge_mapping(ours, theirs, parts)
        if isinstance(ours, (list, tuple)) and isinstance(theirs, (list, tuple, MutableSequence)):
            if len(ours) != len(theirs):
                raise self.misfit(path, f"the checkpoint holds {len(ours)} items, `into` {len(theirs)}")
            items = [self.walk(a, b, path + (k,)) for k, (a, b) in enumerate(zip(ours, theirs))]
            return lambda: _merge_sequence(ours, theirs, items)
        return lambda: ours

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


def _over(tensor: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """A tensor as ``tensor`` views its storage (dtype, offset, shape, stride), over ``buffer``'s instead."""
    return torch.empty(0, dtype=tensor.dtype).set_(buffer.untyped_storage(), tensor.storage_offset(), tensor.shape,
                                                   tensor.stride())


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.device == b.device and a.stride() == b.stride()


def _merge_mapping(ours: Mapping, theirs: Mapping, parts: dict[Any, Merged]) -> Any:
    if not isinstance(theirs, MutableMapping):
        return ours
    for k in ours:
        theirs[k] = parts[k]() if k in theirs else ours[k]
    return theirs


def _merge_sequence(ours: list | tuple, theirs: Any, items: list[Merged]) -> Any:
    if isinstance(theirs, MutableSequence):
        for k, item in enumerate(items):
            theirs[k] = item()
        return theirs
    if isinstance(theirs, tuple) and isinstance(ours, tuple):
        merged = [item() for item in items]
        return type(ours)(*merged) if hasattr(ours, "_fields") else type(ours)(merged)
    return ours


def load(path: str | os.PathLike, map_location: MapLocation = None, *, into: Any = None, strict: bool = True,
         verify: bool = True, weights_only: bool = True) -> Any:
    """The state saved at ``path``, bitwise as it was snapshotted.

    With ``into`` (a state of the same structure: ``model.state_dict()``, a dict of them),
    each tensor's bytes are read straight into ``into``'s tensor at the same key, on the CPU
    or a GPU; values that are not tensors are put into ``into``'s containers, and ``into`` is
    returned. A key one side lacks, or a tensor of another shape or dtype, raises
    StateMismatchError naming the key before anything is written; ``strict=False`` adds the
    checkpoint's keys that ``into`` lacks (freshly read, onto ``map_location``) instead.

    Without ``into``, the data region is read in one pass of large parallel reads into one
    buffer, and every storage is a slice of it, as with ``torch.load(mmap=True)``: no
    per-tensor allocation and no second copy.

    With ``verify`` (the default) every byte is checked against its checksum, before any of
    it reaches a tensor of ``into``. Refuses, with CorruptCheckpointError naming the file and
    the tensor, a file of the wrong size, a truncated one, or one whose header or data
    checksums do not match.
    By default (``weights_only=True``, as ``torch.load`` since torch 2.6) the skeleton goes
    through torch's safe unpickler, which builds tensors, containers, plain values and the
    objects training states commonly hold (numpy arrays and dtypes, RNG states,
    ``torch.Size``, ``argparse.Namespace``; more with ``torch.serialization.add_safe_globals``),
    and raises WeightsOnlyError for anything else. ``weights_only=False`` unpickles anything,
    which runs code the file's author chose: only for files you trust.
    """
    path = os.fspath(path)
    device = torch.device(map_location) if map_location is not None else None
    with backend_for(path).one_read(whole=True):  # an object's reads share one ETag, one read of its head and tail
        if into is not None:
            return load_into(path, into, device, new_key=lambda _: not strict, verify=verify,
                             weights_only=weights_only)
        file = open_file(path, file_commits(path), views=verify, zip_records=verify)
        return fresh(file, Stream(file, None, verify).read_region(), weights_only, device).entry(file.header.root)


def fresh(file: CheckpointFile, region: mmap.mmap | None, weights_only: bool, device: torch.device | None
          ) -> Rebuild:
    """A fresh load's rebuild: every storage a slice of the data region ``region`` (``Stream.read_region``), each
    tensor put onto ``device``."""
    data = torch.frombuffer(region, dtype=torch.uint8).untyped_storage() if region is not None else \
        torch.UntypedStorage(0)
    offsets = [rec.offset for rec in file.header.storages]
    return Rebuild(file, weights_only, lambda index, nbytes: data[offsets[index]:offsets[index] + nbytes],
                   lambda t: t if device is None or device.type == "cpu" else t.to(device))


def load_into(path: str, into: Any, device: torch.device | None, *, new_key: NewKey, verify: bool,
              weights_only: bool) -> Any:
    """``into``, its tensors holding the checkpoint at ``path`` (``datastates.load(path, into=...)``)."""
    file = open_file(path, file_commits(path), views=verify, zip_records=verify)
    header = file.header
    plan = Rebuild(file, weights_only, _unbacked(file))
    match = _Match(plan, new_key)
    merged = match.walk(plan.entry(header.root), into, ())
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
        Stream(file, targets, verify).fill()
        _settle(plan, match.into, targets, device)
    return merged()


def _unbacked(file: CheckpointFile) -> Callable[[int, int], torch.UntypedStorage]:
    """A plan's storages: slices of one reserved range of address space as large as the data region, which costs no
    memory (``reserve``); each tensor of the plan is given its memory after the stream (``_settle``)."""
    reserved = reserve(file.end - file.base)
    region = torch.frombuffer(reserved, dtype=torch.uint8).untyped_storage() if reserved is not None else \
        torch.UntypedStorage(0)
    offsets = [rec.offset for rec in file.header.storages]
    return lambda index, nbytes: region[offsets[index]:offsets[index] + nbytes]


def _settle(plan: Rebuild, dests: dict[int, list[torch.Tensor]], targets: dict[int, Target],
            device: torch.device | None) -> None:
    """After the stream, the plan's tensors given their memory: a matched entry's the first of its tensors of
    ``into`` (its bytes copied into all of them from its fresh buffer, or from the first, where ``into`` holds one
    tensor of the file apart under two keys); any other its view of its fresh buffer, moved onto ``device``."""
    for index in plan.tensor_entries.values():
        tensor = plan.entry(index)
        target = targets[plan.header.entries[index].meta["storage"]]
        if index not in dests:
            view = _over(tensor, target.tensor)
            tensor.data = view if device is None or device.type == "cpu" else view.to(device)
            continue
        first, *others = dests[index]
        if not target.direct:  # from its fresh buffer into each of into's tensors
            view = _over(tensor, target.tensor)
            for t in dests[index]:
                t.copy_(view)
        for t in others:  # tied in the checkpoint, apart in ``into``: the first one holds the bytes
            if target.direct and not _same_memory(t, first):
                t.copy_(first)
        tensor.data = first


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
    is read straight into it (client/reader/stream.py, as an in-place load); any other through a buffer of the bytes it
    spans. Every piece read is checked against its checksum (so a slice is checked with the whole pieces of the
    format around it). A slice that does not fit (a key the file lacks, out of bounds, another shape) raises
    StateMismatchError naming it before anything is written. A storage two slices share is read once.
    """
    with backend_for(path).one_read():  # an object's reads share one ETag and its head: header and data of one version
        return _load_slices(path, slices, verify, weights_only)


def _load_slices(path: str, slices: list[Slice], verify: bool, weights_only: bool) -> dict[str, Any]:
    file = open_file(path, file_commits(path), views=verify, zip_records=False)
    plan = Rebuild(file, weights_only, lambda _, nbytes: torch.UntypedStorage(nbytes, device="meta"))
    root = plan.entry(file.header.root)
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
        Stream(file, targets, verify, parts).fill()
        for storage, wanted in spans.items():
            lo = parts[storage][0]
            for piece, first, last, meta, dtype in wanted if not targets[storage].direct else ():
                raw = targets[storage].tensor[first - lo:last - lo]
                if (first - lo) % dtype.itemsize:  # one storage viewed as dtypes of several sizes
                    raw = raw.clone()
                typed = raw.view(dtype)
                piece.into.copy_(typed.as_strided(piece.lengths, meta["stride"], typed.storage_offset()))
    return root


def _slice_meta(path: str, plan: Rebuild, root: Any, piece: Slice) -> tuple[dict, torch.dtype]:
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
