"""DCP's ``Metadata`` as JSON, for the checkpoint's metadata file, and back.

JSON names no class and sets no attribute: a crafted metadata file can make the reader
build nothing but DCP's own metadata of the values it checks here. (An unpickler, even one
restricted to DCP's classes, lets a crafted file set any attribute on them for the rest of
the process through pickle's BUILD.) Only what DCP's default planners put in ``Metadata``
is written: each item's tensor properties, size and chunks, or that it is bytes; the
planner's flattening map (``planner_data``: fqn -> the path of keys to it); and where each
chunk is stored (``storage_data``: its file and key, ``ShardAt``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   StorageMeta, TensorProperties, TensorStorageMetadata)

from datastates.protocol.errors import CorruptCheckpointError, InvalidRequestError

FORMAT = 1
"""Bumped on any incompatible change to the JSON below; a reader refuses every other."""
MAX_DIMS = 64
"""The most dimensions an item's size may have (torch's CUDA kernels take 25): each is compared per chunk and slice."""
MAX_DEPTH = 64
"""The most keys a ``planner_data`` path may hold: DCP rebuilds the state along it and walks it back recursively."""
MAX_GAPS = 1024
"""List elements no item fills, in all lists of the state DCP rebuilds from ``planner_data`` (``set_element`` fills a
list with None up to its largest index, and DCP flattens each of them again): a list index alone, a few bytes, would
otherwise cost work and memory in proportion to its value. DCP's own saves name every element of a list but an empty
dict."""


@dataclasses.dataclass(frozen=True)
class ShardAt:
    """Where one DCP item is stored (the ``storage_data`` of its ``MetadataIndex``): a file of the checkpoint folder
    and the key of the item in that file's dict."""

    file: str
    key: str


def encode(md: Metadata) -> bytes:
    """``md`` as JSON; InvalidRequestError for what a custom planner put there that this format does not hold."""
    items: dict[str, Any] = {}
    for fqn, item in md.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata):
            items[fqn] = {"bytes": True}
            continue
        p = item.properties
        items[fqn] = {"dtype": _name(p.dtype), "layout": _name(p.layout), "memory_format": _name(p.memory_format),
                      "requires_grad": p.requires_grad, "pin_memory": p.pin_memory, "size": list(item.size),
                      "chunks": [[list(c.offsets), list(c.sizes)] for c in item.chunks]}
    planner = md.planner_data if md.planner_data is not None else {}
    if not isinstance(planner, dict) or not all(isinstance(k, str) and isinstance(v, (tuple, list))
                                                and all(isinstance(x, (str, int)) for x in v) for k, v in planner.items()):
        raise InvalidRequestError("DCP's planner_data is not the default planners' map of names to key paths: "
                                  "a custom planner's, which DatastatesStorageWriter cannot store")
    meta = md.storage_meta
    return json.dumps({
        "format": FORMAT, "version": md.version, "items": items,
        "planner_data": {k: list(v) for k, v in planner.items()},
        "storage": [[i.fqn, None if i.offset is None else list(i.offset), i.index, at.file, at.key]
                    for i, at in md.storage_data.items()],
        "storage_meta": None if meta is None else {
            "checkpoint_id": None if meta.checkpoint_id is None else str(meta.checkpoint_id),
            "save_id": meta.save_id, "load_id": meta.load_id, "modules": list(meta.modules)},
    }).encode()


def decode(raw: bytes, path: str) -> Metadata:
    """DCP's ``Metadata`` from ``encode``'s JSON; CorruptCheckpointError naming what does not fit, before DCP sees it."""
    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: DCP metadata {why}", path=path)

    try:
        doc = json.loads(raw)
    except (ValueError, TypeError, RecursionError) as exc:
        raise bad(f"is not JSON ({type(exc).__name__}: {str(exc)[:80]})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise bad(f"is not of format {FORMAT} (it says {doc.get('format') if isinstance(doc, dict) else doc!r})")
    items = _check(doc.get("items"), dict, "items", bad)
    state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for fqn, item in items.items():
        _check(item, dict, f"item {fqn!r}", bad)
        if item == {"bytes": True}:
            state[fqn] = BytesStorageMetadata()
            continue
        size = _size(item.get("size"), fqn, bad)
        chunks = []
        for c in _check(item.get("chunks"), list, f"{fqn!r} chunks", bad):
            if not (isinstance(c, list) and len(c) == 2):
                raise bad(f"item {fqn!r} has a chunk that is not [offsets, sizes]")
            chunk = ChunkStorageMetadata(_size(c[0], fqn, bad), _size(c[1], fqn, bad))
            if not len(chunk.offsets) == len(chunk.sizes) == len(size) or any(
                    o + n > whole for o, n, whole in zip(chunk.offsets, chunk.sizes, size)):
                raise bad(f"item {fqn!r} has a chunk {list(chunk.offsets)} + {list(chunk.sizes)} outside its size "
                          f"{list(size)}")
            chunks.append(chunk)
        if math.prod(size) > sum(math.prod(c.sizes) for c in chunks):
            raise bad(f"item {fqn!r} of size {list(size)} has chunks of fewer elements: a load of its whole size "
                      "would fill the rest with no stored data")
        props = TensorProperties(dtype=_torch(item.get("dtype"), torch.dtype, fqn, bad),
                                 layout=_torch(item.get("layout"), torch.layout, fqn, bad),
                                 requires_grad=_check(item.get("requires_grad"), bool, f"{fqn!r} requires_grad", bad),
                                 memory_format=_torch(item.get("memory_format"), torch.memory_format, fqn, bad),
                                 pin_memory=_check(item.get("pin_memory"), bool, f"{fqn!r} pin_memory", bad))
        state[fqn] = TensorStorageMetadata(props, size, chunks)
    planner = _planner(doc.get("planner_data"), state, bad)
    storage: dict[MetadataIndex, ShardAt] = {}
    for row in _check(doc.get("storage"), list, "storage", bad):
        if not (isinstance(row, list) and len(row) == 5 and isinstance(row[0], str) and all(isinstance(x, str)
                                                                                            for x in row[3:])
                and (row[2] is None or type(row[2]) is int)):
            raise bad(f"storage row {str(row)[:80]} is not [fqn, offsets, index, file, key]")
        offset = None if row[1] is None else _size(row[1], row[0], bad)
        index = MetadataIndex(row[0], offset, row[2])
        if index in storage:
            raise bad(f"storage lists {row[0]!r} at {row[1]} twice")
        storage[index] = ShardAt(row[3], row[4])
    stored = {MetadataIndex(fqn, c.offsets) for fqn, item in state.items() if isinstance(item, TensorStorageMetadata)
              for c in item.chunks} | {MetadataIndex(fqn) for fqn, item in state.items()
                                       if isinstance(item, BytesStorageMetadata)}
    if set(storage) != stored or len(stored) != sum(len(i.chunks) if isinstance(i, TensorStorageMetadata) else 1
                                                    for i in state.values()):
        unlisted = sorted(i.fqn for i in stored ^ set(storage))[:3]
        raise bad(f"items and where they are stored do not match one to one (e.g. {unlisted})")
    meta = doc.get("storage_meta")
    if meta is not None:
        _check(meta, dict, "storage_meta", bad)
        if not all(meta.get(k) is None or isinstance(meta.get(k), str) for k in ("checkpoint_id", "save_id", "load_id")) \
                or not all(isinstance(m, str) for m in _check(meta.get("modules"), list, "storage_meta modules", bad)):
            raise bad("storage_meta is not strings")
        meta = StorageMeta(meta.get("checkpoint_id"), meta.get("save_id"), meta.get("load_id"), meta["modules"])
    version = doc.get("version")
    if version is not None and not isinstance(version, str):
        raise bad("version is not a string")
    return Metadata(state, planner_data=planner, storage_data=storage, storage_meta=meta, version=version)


def _planner(doc: Any, items: dict[str, Any], bad: Callable[[str], CorruptCheckpointError]) -> dict[str, tuple]:
    """``planner_data``, where each item goes in the state DCP rebuilds from it (``_EmptyStateDictLoadPlanner``,
    ``datastatesctl convert --to dcp``), checked so that rebuilding costs in proportion to the metadata: each path is
    a name, then at most MAX_DEPTH - 1 names and indexes, that joined with dots is its item's name (as DCP's
    flattening makes it); no path ends at or inside another's; lists have at most MAX_GAPS elements in all that no
    path names."""
    planner = {k: tuple(_check(v, list, f"planner_data path of {k[:80]!r}", bad))
               for k, v in _check(doc, dict, "planner_data", bad).items()}
    strays = planner.keys() - items.keys()
    if strays:
        raise bad(f"planner_data names {min(strays)[:80]!r}, which is no item")
    tree: dict[str | int, Any] = {}
    for fqn in items:
        path = planner.get(fqn, (fqn,))
        if not 0 < len(path) <= MAX_DEPTH:
            raise bad(f"planner_data path of {fqn[:80]!r} has {len(path)} keys, not 1 to {MAX_DEPTH}")
        if not (isinstance(path[0], str) and all(isinstance(k, str) or (type(k) is int and k >= 0) for k in path)
                and ".".join(map(str, path)) == fqn):
            raise bad(f"planner_data path of {fqn[:80]!r} is not a name followed by names and indexes that joined "
                      "with dots make the item's name")
        node: Any = tree
        for key in path[:-1]:
            node = node.setdefault(key, {}) if isinstance(node, dict) else None
        if not isinstance(node, dict) or path[-1] in node:
            raise bad(f"planner_data path of {fqn[:80]!r} ends at or inside another item's")
        node[path[-1]] = fqn
    gaps, todo = 0, [tree]
    while todo:
        node = todo.pop()
        indexes = [k for k in node if type(k) is int]
        if indexes and len(indexes) != len(node):
            raise bad("planner_data puts items by name and by index into one container")
        gaps += max(indexes, default=-1) + 1 - len(indexes)
        todo.extend(v for v in node.values() if isinstance(v, dict))
    if gaps > MAX_GAPS:
        raise bad(f"planner_data's list indexes leave {gaps} list elements no item fills (at most {MAX_GAPS})")
    return planner


def _name(value: torch.dtype | torch.layout | torch.memory_format) -> str:
    return str(value).removeprefix("torch.")


def _check(value: Any, kind: type, what: str, bad: Callable[[str], CorruptCheckpointError]) -> Any:
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise bad(f"{what} is not a {kind.__name__}")
    return value


def _size(value: Any, fqn: str, bad: Callable[[str], CorruptCheckpointError]) -> torch.Size:
    if not isinstance(value, list) or not all(type(x) is int and 0 <= x < 1 << 63 for x in value):
        raise bad(f"item {fqn!r} has a size or offset that is not a list of integers from 0 to 2^63")
    if len(value) > MAX_DIMS:
        raise bad(f"item {fqn!r} has a size or offset of {len(value)} dimensions (at most {MAX_DIMS})")
    return torch.Size(value)


def _torch(name: Any, kind: type, fqn: str, bad: Callable[[str], CorruptCheckpointError]) -> Any:
    """torch's dtype, layout or memory format of that name, and nothing else torch has."""
    value = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(value, kind):
        raise bad(f"item {fqn!r} names {str(name)[:40]!r}, not a torch {kind.__name__}")
    return value

