"""Converting a committed tag out of the datastates format, so other tools can read it.

``torch``: each file becomes a plain ``torch.save`` file of the same state, at the same
relative path: a file of format 2 is one already, so it is checked and copied as it is; a
file of format 1 is loaded and saved with ``torch.save``. ``safetensors``: each file becomes ``<name>.safetensors`` holding every
tensor, under its dotted key path (``model.layers.0.weight``), plus ``<name>.json``, the
state's tree with each tensor replaced by ``{"__tensor__": key}``. Values JSON cannot hold
are written as ``{"__repr__": ..., "__type__": ...}``, so nothing is silently dropped, but
such values do not convert back by themselves.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch

from datastates.protocol.errors import CommitError, CorruptCheckpointError, InvalidRequestError
from datastates.protocol.format import INDEX_AT, index_at, marker_name
from datastates.protocol.paths import within
from datastates.protocol.tags import read_marker

from ..reader.restore import load
from ..reader.stream import verify

FORMATS = ("torch", "safetensors")


def convert_tag(folder: str, to: str, out: str, weights_only: bool = True) -> list[str]:
    """Write every file of the tag committed in ``folder`` under ``out`` in format ``to``; the files written.

    Files are read safely by default (``weights_only``, as ``datastates.load``). A marker
    entry whose path is absolute or climbs out with ``..`` is refused: nothing is written
    outside ``out``.
    """
    if to not in FORMATS:
        raise InvalidRequestError(f"--to {to!r}: the formats are {', '.join(FORMATS)}")
    folder = os.path.abspath(folder)
    tag = os.path.basename(folder)
    marker = read_marker(os.path.join(folder, marker_name(tag)))
    if marker is None:
        raise CommitError(f"{folder} holds no committed tag {tag!r} (no valid {marker_name(tag)}): nothing converted",
                          tag=tag)
    if os.path.abspath(out) == folder:
        raise InvalidRequestError("the output folder must not be the tag's own folder")
    out = os.path.abspath(out)
    for rec in marker.files:
        if os.path.isabs(rec.path) or ".." in rec.path.split("/") or not within(os.path.normpath(os.path.join(out, rec.path)), out):
            raise CorruptCheckpointError(f"{folder}: marker lists {rec.path[:256]!r}, which is not a file inside the "
                                         "tag's folder: nothing converted", path=folder)
    written = []
    for rec in marker.files:
        src, base = os.path.join(folder, rec.path), os.path.join(out, rec.path)
        os.makedirs(os.path.dirname(base), exist_ok=True)
        if to == "torch":
            written += _write_torch(src, base, weights_only)
        else:
            written += _write_safetensors(load(src, weights_only=weights_only), os.path.splitext(base)[0])
    return written


def _write_torch(src: str, path: str, weights_only: bool) -> list[str]:
    with open(src, "rb") as f:
        container, _ = index_at(f.read(INDEX_AT), src)
    if container >= 2:  # a zip: torch.load reads it as it is: its checksums checked, it is copied
        verify(src)
        shutil.copyfile(src, path)
    else:
        torch.save(load(src, weights_only=weights_only), path)
    return [path]


def _write_safetensors(state: Any, stem: str) -> list[str]:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    tree = _split(state, "", tensors, {})
    save_file(tensors, stem + ".safetensors")
    with open(stem + ".json", "w") as f:
        json.dump(tree, f, indent=1)
    return [stem + ".safetensors", stem + ".json"]


def _split(obj: Any, key: str, tensors: dict[str, torch.Tensor], seen: dict[int, str]) -> Any:
    """The JSON tree of ``obj``, its tensors moved into ``tensors`` (safetensors holds no shared or strided views)."""
    if isinstance(obj, torch.Tensor):
        if id(obj) in seen:
            return {"__tensor__": seen[id(obj)]}
        name = key or "<root>"
        tensors[name] = obj.detach().to("cpu").contiguous().clone()
        seen[id(obj)] = name
        return {"__tensor__": name}
    if isinstance(obj, dict) and all(isinstance(k, (str, int)) for k in obj):
        return {str(k): _split(v, f"{key}.{k}" if key else str(k), tensors, seen) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_split(v, f"{key}.{i}" if key else str(i), tensors, seen) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return {"__repr__": repr(obj), "__type__": f"{type(obj).__module__}.{type(obj).__qualname__}"}
