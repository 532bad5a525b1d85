"""The model of bench/dcp_fsdp.py: a GPT of Linear layers, FSDP2-sharded over every rank, its AdamW and step.

Imported by the ranks (bench/dcp_fsdp_rank.py), with the helpers that compare sharded states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and a 4x MLP, all Linear layers."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, layers: int, dim: int, vocab: int, ctx: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(ctx, dim)
        self.blocks = nn.ModuleList(Block(dim, max(1, dim // 64)) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


@dataclass
class Trainer:
    model: nn.Module
    opt: torch.optim.Optimizer
    cfg: dict[str, Any]
    step: int = 0

    def train_step(self) -> None:
        """One step on a batch of this rank's (random tokens, seeded by the step and the rank)."""
        g = torch.Generator().manual_seed(self.step * 1000 + dist.get_rank())
        idx = torch.randint(self.cfg["vocab"], (self.cfg["batch"], self.cfg["seq"] + 1), generator=g)
        logits = self.model(idx[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1)).backward()
        self.opt.step()  # the fences (datastates' protect, DCP's staging) are pre-hooks of this
        self.opt.zero_grad(set_to_none=True)
        self.step += 1

    def state(self) -> dict[str, Any]:
        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd}


def build(cfg: dict[str, Any], seed: int, steps: int = 1) -> Trainer:
    """The GPT, each block and the whole sharded over every rank (FSDP2), its AdamW, after ``steps`` steps."""
    torch.manual_seed(seed)
    model = GPT(cfg["layers"], cfg["dim"], cfg["vocab"], cfg["seq"])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    t = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1), cfg)
    for _ in range(steps):  # AdamW makes its state on its first step
        t.train_step()
    return t


def local_tensors(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of ``state`` by its path, a DTensor as this rank's shard."""
    if isinstance(state, DTensor):
        return {prefix: state.to_local()}
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    if isinstance(state, dict):
        return {k: v for key, val in state.items() for k, v in local_tensors(val, f"{prefix}.{key}" if prefix else str(key)).items()}
    return {}


def local_bytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for t in local_tensors(state).values())


def unequal(a: Any, b: Any) -> list[str]:
    ta, tb = local_tensors(a), local_tensors(b)
    return sorted(k for k in set(ta) | set(tb) if k not in ta or k not in tb or not torch.equal(ta[k], tb[k]))
