"""Every dtype and every tensor layout a state can hold comes back bitwise, as the same view of the same storage.

One daemon serves the whole module: each case is one small file, so what costs time is
the daemon's start, not the cases.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from datastates.client import Client
from datastates.protocol.providers.tensor import DTYPES
from datastates.protocol.tensormeta import DTYPE_SIZES, TYPED_STORAGES

from conftest import DaemonProc, assert_state_equal, load_both, same_storage, save

N = 24  # elements; divisible by 2, 3, 4 and 6 so every dtype gets the same 2-D views


def random_tensor(dtype: torch.dtype, n: int = N) -> torch.Tensor:
    """``n`` elements of ``dtype`` filled with random bytes, which reaches every bit pattern of any dtype."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # complex32 is "experimental"
            return torch.empty(n * dtype.itemsize, dtype=torch.uint8).random_().view(dtype)
    except (RuntimeError, TypeError) as exc:
        pytest.skip(f"torch {torch.__version__} cannot create a CPU tensor of {dtype}: {exc}")


def test_the_formats_dtype_tables_are_torchs() -> None:
    """``DTYPE_SIZES`` and ``TYPED_STORAGES`` hold what torch says, torch-free for ``verify``: every dense dtype of this
    torch with its size, and the typed storage ``torch.save`` names for a dtype; a torch that adds a dtype fails here."""
    quantized = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
    dense = {str(d).removeprefix("torch."): d.itemsize for d in vars(torch).values()
             if isinstance(d, torch.dtype) and d not in quantized}
    assert dense == {n: size for n, size in DTYPE_SIZES.items() if n in DTYPES} and set(DTYPES) == set(dense)
    typed = {str(d).removeprefix("torch."): name for d, name in torch.storage._dtype_to_storage_type_map().items()
             if d not in quantized}
    assert typed == TYPED_STORAGES


@pytest.fixture
def roundtrip(shared_client: Client, shared_daemon: DaemonProc, request: pytest.FixtureRequest) -> Any:
    """save(state) -> loaded state, in a folder of its own per test case. The file is also a zip that plain
    ``torch.load`` reads (format 2): ``torch.load(weights_only=True)``, with and without ``mmap``, gives the
    same state bitwise, and Python's ``zipfile`` lists it."""
    def run(state: Any) -> Any:
        tag = "".join(c if c.isalnum() else "-" for c in request.node.name).strip("-")
        committed = save(shared_client, state, shared_daemon.root / tag / "state.pt", tag=tag)
        return load_both(committed.files[0])

    return run


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_supported_dtype(roundtrip: Any, name: str) -> None:
    """Each dtype the daemon accepts round-trips bitwise, flat and as 2-D, transposed and strided views of one storage."""
    dtype = DTYPES[name]
    flat = random_tensor(dtype)
    grid = flat.view(4, N // 4)
    state = {"flat": flat, "grid": grid, "t": grid.t(), "strided": grid[1:, ::2], "scalar": flat[5]}

    loaded = roundtrip(state)

    assert_state_equal(state, loaded)
    assert all(same_storage(loaded["flat"], loaded[k]) for k in state), "views of one storage share it again"


def test_bfloat16_values_survive(roundtrip: Any) -> None:
    """bf16 weights, the common case, load with their exact values, not just their bytes."""
    w = torch.randn(64, 32).to(torch.bfloat16)
    loaded = roundtrip({"w": w})
    assert loaded["w"].dtype == torch.bfloat16 and torch.equal(loaded["w"], w)


def test_views_of_one_storage(roundtrip: Any) -> None:
    """Slices, transposes, an expand with stride 0 and an overlapping as_strided keep their layout and share storage."""
    base = torch.randn(8, 16)
    state = {
        "base": base,
        "row": base[3],
        "slice": base[2:6, 4:12],
        "transposed": base.t(),
        "every_other": base[:, 1::2],
        "expanded": base[0, :4].expand(5, 4),
        "overlapping": base.as_strided((6, 6), (3, 1), 7),
        "reshaped": base.view(4, 2, 16).permute(2, 0, 1),
        "alias": None,
    }
    state["alias"] = state["row"]  # the same tensor object twice
    assert state["expanded"].stride() == (0, 1)

    loaded = roundtrip(state)

    assert_state_equal(state, loaded)
    assert all(same_storage(loaded["base"], v) for v in loaded.values())
    assert loaded["alias"] is loaded["row"], "one object in, one object out, as torch.save does"
    loaded["base"][3, 0] = 42.0  # one storage: a write through one view shows in the others, as before the save
    assert loaded["row"][0] == 42.0 and loaded["transposed"][0, 3] == 42.0


def test_non_contiguous_tensors(roundtrip: Any) -> None:
    """Tensors whose bytes are not in row-major order are stored as they lie, not re-packed."""
    state = {
        "channels_last": torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
        "permuted": torch.randn(3, 4, 5).permute(2, 0, 1),
        "column": torch.randn(10, 10)[:, 3],
        "transposed_slice": torch.arange(12, dtype=torch.int16).view(3, 4).t()[1:, :],
    }
    assert not any(t.is_contiguous() for t in state.values())
    assert_state_equal(state, roundtrip(state))


def test_zero_size_tensors(roundtrip: Any) -> None:
    """Empty tensors, with or without storage behind them, load with their shape and stride."""
    backed = torch.randn(10)
    state = {
        "empty": torch.empty(0),
        "empty_3d": torch.empty(3, 0, 2, dtype=torch.int64),
        "empty_view": backed[4:4],
        "empty_bf16": torch.zeros(0, 7, dtype=torch.bfloat16),
        "backed": backed,
    }
    loaded = roundtrip(state)
    assert_state_equal(state, loaded)
    assert same_storage(loaded["empty_view"], loaded["backed"])


@pytest.mark.parametrize(
    "state",
    [{"empty": torch.empty(0), "also_empty": torch.empty(2, 0, dtype=torch.bfloat16)}, {"step": 5, "note": "objects only"}],
    ids=["only-empty-tensors", "no-tensors"],
)
def test_state_with_no_tensor_bytes(roundtrip: Any, state: dict[str, Any]) -> None:
    """A file whose data region is empty still has the size its header declares, so it loads."""
    assert_state_equal(state, roundtrip(state))


def test_zero_dim_scalars(roundtrip: Any) -> None:
    """0-dim tensors (Adam's step, a loss scale, an element of a larger tensor) stay 0-dim."""
    vec = torch.randn(6, dtype=torch.float64)
    state = {
        "step": torch.tensor(1234.0),
        "loss_scale": torch.tensor(65536, dtype=torch.int64),
        "flag": torch.tensor(True),
        "element": vec[4],
        "vec": vec,
    }
    loaded = roundtrip(state)
    assert_state_equal(state, loaded)
    assert loaded["element"].dim() == 0 and loaded["element"].storage_offset() == 4


def test_parameters_keep_requires_grad(roundtrip: Any) -> None:
    """nn.Parameter stays a Parameter, and requires_grad comes back as it was, for Parameters and plain tensors."""
    state = {
        "trainable": torch.nn.Parameter(torch.randn(4, 4)),
        "frozen": torch.nn.Parameter(torch.randn(4), requires_grad=False),
        "leaf": torch.randn(3).requires_grad_(),
        "plain": torch.randn(3),
    }
    loaded = roundtrip(state)
    assert_state_equal(state, loaded)
    assert type(loaded["trainable"]) is torch.nn.Parameter and loaded["trainable"].requires_grad
    assert type(loaded["frozen"]) is torch.nn.Parameter and not loaded["frozen"].requires_grad
    assert loaded["leaf"].requires_grad and not loaded["plain"].requires_grad


def test_lazy_conjugate_and_negative_views(roundtrip: Any) -> None:
    """A conj() or neg view loads with the values it shows, not the bytes under it."""
    z = torch.randn(5, dtype=torch.complex64)
    state = {"conj": z.conj(), "neg": torch._neg_view(torch.randn(5))}
    assert state["conj"].is_conj() and state["neg"].is_neg()
    loaded = roundtrip(state)
    for key, t in state.items():
        assert torch.equal(loaded[key], t.resolve_conj().resolve_neg()), key
