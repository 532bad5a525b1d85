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
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   StorageMeta, TensorProperties, TensorStorageMetadata)

from datastates.protocol.errors import CorruptCheckpointError, InvalidRequestError

FORMAT = 1
"""Bumped on any incompatible change to the JSON below; a reader refuses every other."""
MAX_INDEX = 1 << 24
"""The largest list index a ``planner_data`` key path may hold: DCP's loader fills a list up to it."""


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
        props = TensorProperties(dtype=_torch(item.get("dtype"), torch.dtype, fqn, bad),
                                 layout=_torch(item.get("layout"), torch.layout, fqn, bad),
                                 requires_grad=_check(item.get("requires_grad"), bool, f"{fqn!r} requires_grad", bad),
                                 memory_format=_torch(item.get("memory_format"), torch.memory_format, fqn, bad),
                                 pin_memory=_check(item.get("pin_memory"), bool, f"{fqn!r} pin_memory", bad))
        state[fqn] = TensorStorageMetadata(props, size, chunks)
    planner = {k: tuple(_check(v, list, f"planner path of {k!r}", bad))
               for k, v in _check(doc.get("planner_data"), dict, "planner_data", bad).items()}
    if not all(v and isinstance(v[0], str) and all(isinstance(x, str) or (type(x) is int and 0 <= x < MAX_INDEX)
                                                   for x in v) for v in planner.values()):
        raise bad(f"planner_data holds a key path that is not a name followed by names and indexes (below "
                  f"{MAX_INDEX})")
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


def _name(value: torch.dtype | torch.layout | torch.memory_format) -> str:
    return str(value).removeprefix("torch.")


def _check(value: Any, kind: type, what: str, bad: Callable[[str], CorruptCheckpointError]) -> Any:
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise bad(f"{what} is not a {kind.__name__}")
    return value


def _size(value: Any, fqn: str, bad: Callable[[str], CorruptCheckpointError]) -> torch.Size:
    if not isinstance(value, list) or not all(type(x) is int and 0 <= x < 1 << 63 for x in value):
        raise bad(f"item {fqn!r} has a size or offset that is not a list of integers from 0 to 2^63")
    return torch.Size(value)


def _torch(name: Any, kind: type, fqn: str, bad: Callable[[str], CorruptCheckpointError]) -> Any:
    """torch's dtype, layout or memory format of that name, and nothing else torch has."""
    value = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(value, kind):
        raise bad(f"item {fqn!r} names {str(name)[:40]!r}, not a torch {kind.__name__}")
    return value

