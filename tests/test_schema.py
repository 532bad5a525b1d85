"""The checked conversion from untrusted dicts (protocol/schema.py) refuses what it always refused, and names it.

``from_dict`` checks with a checker made once per class, and hands what it refuses to the
generic walk that says why. Here every field of a real checkpoint's header and commit marker
is replaced by values of every other kind, or removed: the fast checker must accept exactly
what the walk accepts, build the same object, and raise the walk's own message otherwise.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Iterator

import msgpack
import pytest
import torch

from conftest import DaemonProc, save
from datastates.client.reader.checks import open_file
from datastates.protocol.errors import ProtocolError
from datastates.protocol.format import CommitMarker, FileHeader, marker_name
from datastates.protocol.schema import _checked, from_dict, pack

ODD_VALUES: list[Any] = [None, True, 0, 7, 1.5, "x", b"x", [], [1, "a"], {}, {"a": 1}]


def _positions(value: Any, path: tuple = ()) -> Iterator[tuple]:
    """Every key path inside ``value``'s maps and lists."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield path + (k,)
            yield from _positions(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value[:3]):  # the first items stand for the rest
            yield path + (i,)
            yield from _positions(v, path + (i,))


def _replaced(data: Any, path: tuple, new: Any, remove: bool = False) -> Any:
    out = copy.deepcopy(data)
    holder = out
    for k in path[:-1]:
        holder = holder[k]
    if remove:
        if isinstance(holder, dict):
            del holder[path[-1]]
        else:
            holder.pop(path[-1])
    else:
        holder[path[-1]] = new
    return out


def _outcome(build: Any, cls: type, data: Any) -> tuple[str, Any]:
    try:
        return "ok", build(cls, data, "x")
    except ProtocolError as exc:
        return "refused", exc.message
    except Exception as exc:  # the dataclass's own checks: the same either way
        return "raised", f"{type(exc).__name__}: {exc}"


@pytest.fixture(scope="module")
def written(shared_client: Any, shared_daemon: DaemonProc, tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[dict, dict]:
    """A real header (as msgpack carries it) and commit marker (as JSON) of a varied state."""
    folder = Path(shared_daemon.root) / "schema" / "t1"
    folder.mkdir(parents=True)
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {"w": w, "view": w[1:], "half": torch.ones(5, dtype=torch.float16), "step": 3, "name": "run",
             "nested": {"list": [torch.zeros(2), 1.5, None]}}
    save(shared_client, state, folder / "rank0.pt", tag="t1")
    header = msgpack.unpackb(pack(open_file(str(folder / "rank0.pt"), [], views=False, zip_records=False).header), raw=False)
    marker = json.loads((folder / marker_name("t1")).read_text())
    return header, marker


@pytest.mark.parametrize("which", ["header", "marker"])
def test_every_field_of_another_kind_is_refused_as_before_and_named(written: tuple[dict, dict], which: str) -> None:
    cls = FileHeader if which == "header" else CommitMarker
    good = written[0] if which == "header" else written[1]
    assert from_dict(cls, good) == _checked(cls, good)
    cases = refused = 0
    for path in _positions(good):
        variants = [_replaced(good, path, v) for v in ODD_VALUES] + [_replaced(good, path, None, remove=True)]
        for data in variants:
            fast, walk = _outcome(from_dict, cls, data), _outcome(_checked, cls, data)
            assert fast == walk, f"{which} at {path}: from_dict gave {fast[0]}, the walk {walk[0]}"
            cases += 1
            refused += fast[0] == "refused"
    assert cases > 100 and 0 < refused < cases, (cases, refused)
