"""The reader against crafted files: thousands of headers and bodies, each refused with the format's own error.

A checkpoint file is as untrusted as a client: its author computes the
header's checksum too. Hypothesis crafts headers (every field of the index, the entries'
metadata, the skeleton's bytes) and bodies (bytes flipped, cut or appended) from a real
file the daemon wrote; ``load`` and ``verify`` must either return the state or raise a
``DatastatesError`` (``corrupt``, ``unsupported_format``, ``weights_only``), never another
exception, within bounded time and memory. 1,000 cases by default, 5,000 with ``--long``
(``DATASTATES_FUZZ_CASES`` sets another count, for a longer randomized pass, with ``DATASTATES_FUZZ_SEED``).
"""

from __future__ import annotations

import dataclasses
import os
import resource
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import datastates
from datastates.client import Client
from datastates.client.reader.stream import verify
from datastates.protocol.descriptors import EntryDesc
from datastates.protocol.errors import DatastatesError
from datastates.protocol.format import DATA_ALIGN, FileHeader, StorageRecord, align_up

from conftest import DaemonProc, file_index, save, with_index

CASES_SET = os.environ.get("DATASTATES_FUZZ_CASES", "")
CASES, SHORT_CASES = 5000, 1000
"""With ``--long``; the default run (and ``make test``) does SHORT_CASES."""
SEED = int(os.environ.get("DATASTATES_FUZZ_SEED", "14"))
CASE_SECONDS = 10.0
"""A hang guard per case (a crafted size that makes the reader loop), far above the milliseconds one takes."""
MEMORY_MARGIN = 512 << 20
"""What the fuzzing may add to this process's peak memory, all cases together: a crafted size that allocates
gigabytes would blow through it."""


@pytest.fixture(scope="module")
def good(shared_daemon: DaemonProc) -> Path:
    state = {"w": torch.randn(3, 1 << 12), "b": torch.arange(100, dtype=torch.int16), "view": None, "step": 7,
             "names": ["a", "b"], "nested": {"x": torch.ones(2, 2).t()}}
    state["view"] = state["w"][1:, ::2]
    with Client(shared_daemon.endpoint, timeout=60) as c:
        return Path(save(c, state, shared_daemon.root / "fuzz-reader" / "model_states.pt").files[0])


ints = st.one_of(st.integers(-3, 3), st.integers(-(2**63), 2**63 - 1), st.sampled_from([4095, 4096, 1 << 20, 1 << 40]))


def header_changes(h: FileHeader) -> st.SearchStrategy:
    """One crafted change of ``h``: a field of the header, of a storage record, or of an entry."""
    n_st, n_en = len(h.storages), len(h.entries)
    storage_field = st.tuples(st.integers(0, n_st - 1), st.sampled_from(["offset", "nbytes", "checksums"]),
                              ints | st.lists(st.binary(min_size=0, max_size=9), max_size=4))
    entry_meta = st.tuples(st.integers(0, n_en - 1),
                           st.sampled_from(["storage", "dtype", "shape", "stride", "storage_offset", "data", "provider"]),
                           ints | st.lists(ints, max_size=4) | st.sampled_from(["float32", "bool", "nope", ""])
                           | st.binary(max_size=40))
    top = st.tuples(st.sampled_from(["piece_size", "data_len", "root"]), ints)
    return st.one_of(top.map(lambda c: ("top", c)), storage_field.map(lambda c: ("storage", c)),
                     entry_meta.map(lambda c: ("entry", c)), st.just(("drop_storage", None)),
                     st.just(("swap_entries", None)))


def apply(h: FileHeader, change: tuple[str, Any]) -> FileHeader:
    kind, c = change
    if kind == "top":
        return dataclasses.replace(h, **{c[0]: c[1]})
    if kind == "storage":
        i, field, value = c
        if field == "checksums" and not isinstance(value, list):
            value = [b"\0" * 8] * (abs(value) % 5)
        if field != "checksums" and not isinstance(value, int):
            value = len(value)
        recs = list(h.storages)
        if not recs:
            return h
        i %= len(recs)
        recs[i] = dataclasses.replace(recs[i], **{field: value})
        return dataclasses.replace(h, storages=recs)
    if kind == "entry":
        i, field, value = c
        entries = list(h.entries)
        i %= len(entries)
        e = entries[i]
        entries[i] = (EntryDesc(provider=value if isinstance(value, str) else "tensor", name=e.name, meta=e.meta)
                      if field == "provider" else EntryDesc(provider=e.provider, name=e.name, meta={**e.meta, field: value}))
        return dataclasses.replace(h, entries=entries)
    if kind == "drop_storage":
        return dataclasses.replace(h, storages=h.storages[:-1])
    return dataclasses.replace(h, entries=list(reversed(h.entries)))


def craft(raw: bytes, header: FileHeader, changes: list[tuple[str, Any]], body: tuple[str, int, int]) -> bytes:
    for change in changes:
        header = apply(header, change)
    _, _, _, base = file_index(raw)
    data = bytearray(raw[base:base + align_up(file_index(raw)[0].data_len, DATA_ALIGN)])
    how, at, value = body
    if data and how == "flip":
        data[at % len(data)] ^= (value % 255) + 1
    elif how == "cut":
        data = data[: at % (len(data) + 1)]
    elif how == "append":
        data += bytes(value % 8192)
    return with_index(raw, header, bytes(data))


def read_both(path: Path) -> None:
    """``load`` (safe by default) and ``verify``: a state, or the format's own error; nothing else."""
    for read in (lambda: datastates.load(path), lambda: verify(path)):
        start = time.monotonic()
        try:
            read()
        except DatastatesError:
            pass
        assert time.monotonic() - start < CASE_SECONDS, "one crafted file took the reader past the hang guard"


def test_crafted_headers_and_bodies_are_refused_with_the_formats_own_error(good: Path, tmp_path: Path,
                                                                          long_runs: bool) -> None:
    cases = int(CASES_SET) if CASES_SET else CASES if long_runs else SHORT_CASES
    raw = good.read_bytes()
    header = file_index(raw)[0]
    path = tmp_path / "model_states.pt"
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tried = {"n": 0}

    @seed(SEED)
    @settings(max_examples=cases, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.lists(header_changes(header), max_size=3),
           st.tuples(st.sampled_from(["none", "flip", "cut", "append"]), st.integers(0, 1 << 20), st.integers(0, 1 << 20)))
    def case(changes: list[tuple[str, Any]], body: tuple[str, int, int]) -> None:
        path.write_bytes(craft(raw, header, changes, body))
        read_both(path)
        tried["n"] += 1

    case()
    assert tried["n"] >= min(cases, 5000) * 0.9, f"only {tried['n']} cases ran"
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak_before
    assert grew < MEMORY_MARGIN, f"crafted files grew the reader's peak memory by {grew >> 20} MiB"


def test_the_control_the_unchanged_file_loads(good: Path, tmp_path: Path) -> None:
    """The fuzzer's own plumbing, unchanged, gives back a good file (so refusals above are the reader's)."""
    raw = good.read_bytes()
    header = file_index(raw)[0]
    path = tmp_path / "model_states.pt"
    path.write_bytes(craft(raw, header, [], ("none", 0, 0)))
    state = datastates.load(path)
    assert torch.equal(state["w"], datastates.load(good)["w"]) and torch.equal(state["view"], state["w"][1:, ::2])
