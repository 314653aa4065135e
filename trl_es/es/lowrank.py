"""Low-rank perturbations applied in the forward pass, the whole population in one batch (EGGROLL: Sarkar et al.
2025, "Evolution Strategies at the Hyperscale").

Member i's noise for a weight W (out × in) is the rank-r matrix E_i = A_i·B_iᵀ/√r, with A_i (out × r) and
B_i (in × r) i.i.d. N(0, 1) drawn from (seed_i, parameter name): each entry of E_i has unit variance, and
θ_i's weight is W + σ·sign_i·E_i (antithetic members share a seed and differ by sign).

Members are never written into the weights: forward hooks on the target `nn.Linear`s add
σ·sign_m/√r·(x·B_m)·A_mᵀ to the output of every batch row whose member is m, at a cost of
O(batch·seq·(in + out)·r); a row of member −1 is the centre θ. The model's parameters stay bitwise unchanged.

Only the weights of `nn.Linear` modules are perturbed. Other parameters ES selects (norms, embeddings, biases, and
a Linear weight tied to an embedding, such as a tied `lm_head`) are left at θ by this strategy.
"""

from __future__ import annotations

import math

import torch

from .noise import _hash64
from .update import update_coefficients


def lowrank_factors(
    seed: int,
    name: str,
    shape: tuple[int, int],
    rank: int = 1,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A (out × r) and B (in × r), i.i.d. N(0, 1) from (seed, name); the noise of weight `name` is E = A·Bᵀ/√r.

    Drawn in float32 on the host from a generator seeded by hash(seed, name), so the same on every process and
    device, then moved to `device` and `dtype`.
    """
    if rank < 1:
        raise ValueError(f"rank must be at least 1, got {rank}")
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(_hash64("es-lowrank", seed, name))
    a = torch.randn(out_features, rank, generator=generator)
    b = torch.randn(in_features, rank, generator=generator)
    return a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)


def lowrank_targets(model: torch.nn.Module, params: dict[str, torch.nn.Parameter]) -> dict[str, torch.nn.Linear]:
    """The `nn.Linear`s whose weight is one of `params` (by identity), keyed by that parameter's name.

    A Linear whose weight is also an `nn.Embedding`'s (a tied `lm_head`) is left out: a low-rank perturbation of
    its output would disagree with the unperturbed embedding lookup of the same tensor.
    """
    names = {id(p): name for name, p in params.items()}
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return {
        names[id(m.weight)]: m
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and id(m.weight) in names and id(m.weight) not in embedded
    }


class LowRankPopulation:
    """Within the context, batch row b of every forward through `targets` sees member `row_members[b]`:
    y_b = x_b·Wᵀ (+ bias) + σ·sign_m/√r·(x_b·B_m)·A_mᵀ with m = row_members[b], and no perturbation when m = −1.

    Member m's factors come from `lowrank_factors(seeds[m], name, W.shape, rank)`. Works with KV-cached
    generation, whose rows keep their order; every forward must have `len(row_members)` rows. The hooks are
    removed on exit, exceptions included; the weights are never modified.
    """

    def __init__(
        self,
        targets: dict[str, torch.nn.Linear],
        seeds: list[int],
        signs: list[int],
        sigma: float,
        rank: int,
        row_members: torch.Tensor,
    ):
        if len(seeds) != len(signs):
            raise ValueError(f"got {len(seeds)} seeds but {len(signs)} signs")
        row_members = torch.as_tensor(row_members, dtype=torch.long).flatten()
        if row_members.numel() and not (-1 <= int(row_members.min()) and int(row_members.max()) < len(seeds)):
            raise ValueError(f"row_members must lie in [-1, {len(seeds)}), got {row_members.tolist()}")
        self.targets, self.seeds, self.signs, self.sigma, self.rank = targets, seeds, signs, sigma, rank
        # The centre (−1) indexes an extra all-zero member appended after the M real ones.
        self.rows = torch.where(row_members < 0, len(seeds), row_members)
        self.handles: list[torch.utils.hooks.RemovableHandle] = []

    def stacked_factors(self, name: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A_stack (M + 1, out, r) holding σ·sign_m/√r·A_m, and B_stack (M + 1, in, r); member M is zero (centre)."""
        out_features, in_features = weight.shape
        a_stack = torch.zeros(len(self.seeds) + 1, out_features, self.rank)
        b_stack = torch.zeros(len(self.seeds) + 1, in_features, self.rank)
        for m, (seed, sign) in enumerate(zip(self.seeds, self.signs)):
            a, b = lowrank_factors(seed, name, weight.shape, self.rank)
            a_stack[m] = a * (self.sigma * sign / math.sqrt(self.rank))
            b_stack[m] = b
        return a_stack.to(weight.device, weight.dtype), b_stack.to(weight.device, weight.dtype)

    def __enter__(self) -> None:
        try:
            for name, module in self.targets.items():
                a_stack, b_stack = self.stacked_factors(name, module.weight)
                rows = self.rows.to(module.weight.device)
                self.handles.append(module.register_forward_hook(_perturbation_hook(a_stack, b_stack, rows)))
        except BaseException:
            self.remove()
            raise

    def __exit__(self, *exc_info) -> None:
        self.remove()

    def remove(self) -> None:
        """Remove every hook this population registered."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _perturbation_hook(a_stack: torch.Tensor, b_stack: torch.Tensor, rows: torch.Tensor):
    """A forward hook adding row b's (x_b·B_m)·A_mᵀ to the output, m = rows[b] (σ·sign/√r is folded into A)."""

    def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        x = args[0]
        if x.shape[0] != rows.numel():
            raise ValueError(f"the batch has {x.shape[0]} rows but the population assigns {rows.numel()} rows")
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        xb = torch.einsum("bsi,bir->bsr", x, b_stack[rows])
        return output + torch.einsum("bsr,bor->bso", xb, a_stack[rows]).reshape(output.shape)

    return hook


@torch.no_grad()
def lowrank_update(
    weights: dict[str, torch.Tensor],
    directions: list[tuple[int, int]],
    fitness: torch.Tensor,
    learning_rate: float,
    n_members: int,
    rank: int = 1,
) -> float:
    """W ← W + α·(1/N)·Σ_i z_i·sign_i·A_i·B_iᵀ/√r for each weight, in place, with N = `n_members`.

    Antithetic pairs merge into one coefficient per seed (`update_coefficients`); each matrix's update is one
    float32 matmul [c_1·A_1 … c_S·A_S]·[B_1 … B_S]ᵀ/√r, added in float32 and cast to the weight dtype once.
    Returns ‖Δθ‖₂ of the float32 update.
    """
    coefficients = update_coefficients(fitness, directions, learning_rate, n_members)
    squared_norm = 0.0
    for name, weight in weights.items():
        factors = [lowrank_factors(seed, name, weight.shape, rank, device=weight.device) for seed in coefficients]
        a = torch.cat([a * (c / math.sqrt(rank)) for (a, _), c in zip(factors, coefficients.values())], dim=1)
        b = torch.cat([b for _, b in factors], dim=1)
        delta = a @ b.T
        squared_norm += float(delta.square().sum())
        weight.copy_(weight.float() + delta)
    return squared_norm**0.5
