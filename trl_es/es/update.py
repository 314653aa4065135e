"""The ES update θ ← θ + α·(1/N)·Σ_i z_i ε_i (Qiu et al. 2025 convention: α absorbs the 1/σ of the gradient estimate)."""

from __future__ import annotations

import math

import torch

from .noise import CHUNK, NoiseTable, Region, member_noise
from .params import ParameterSnapshot


FLOAT32_MAX = torch.finfo(torch.float32).max


def update_coefficients(
    fitness: torch.Tensor, directions: list[tuple[int, int]], scale: float, n_members: int
) -> dict[int, float]:
    """c_s = scale/N · Σ_{i: seed_i = s} sign_i·z_i, one coefficient per noise seed, with N = `n_members`: the plain
    update's coefficients with scale = α, the gradient estimate ĝ's with scale = 1/σ (`es_optimizer`).

    `directions[i] = (seed_i, sign_i)` is member i's noise ±ε(seed_i); antithetic pairs share a seed, so their
    two terms merge into one and the noise is regenerated once per pair.
    """
    coefficients: dict[int, float] = {}
    for z, (seed, sign) in zip(fitness.tolist(), directions, strict=True):
        coefficients[seed] = coefficients.get(seed, 0.0) + scale * sign * z / n_members
    check_coefficients(coefficients)
    return coefficients


def check_coefficients(coefficients: dict[int, float]) -> None:
    """A FloatingPointError unless every update coefficient is a finite float32 value."""
    for seed, c in coefficients.items():
        if not (math.isfinite(c) and abs(c) <= FLOAT32_MAX):
            raise FloatingPointError(f"the update coefficient of noise seed {seed} is {c}, not finite in float32")


def not_finite(name: str, dtype: torch.dtype, coefficients: dict[int, float]) -> FloatingPointError:
    largest = max((abs(c) for c in coefficients.values()), default=0.0)
    return FloatingPointError(
        f"the ES update of {name!r} is not finite in {dtype} (largest coefficient α·z/N = {largest:.3g}): lower "
        "learning_rate, or use fitness_shaping='zscore' — 'none' lets raw rewards scale the update"
    )


def noise_sums(
    table: NoiseTable, coefficients: dict[int, float], name: str, numel: int, device, region: Region | None = None
):
    """Yield `(a, b, Σ_s c_s ε(s)[a:b])` over parameter `name`'s flat elements, one noise window at a time, each sum
    accumulated in float32 in one reused buffer (valid until the next window). With `region` (of a parameter of
    `region.numel` elements), over that region's elements: the whole parameter's sums cut to it where it is not one
    run of them, so each element's sum is the whole parameter's bitwise."""
    if region is not None and region.run() is None:
        whole = torch.cat(
            [total.clone() for _, _, total in noise_sums(table, coefficients, name, region.numel, device)]
        )
        piece = region.cut(whole).reshape(-1)
        yield 0, piece.numel(), piece
        return
    start, stop = (0, numel) if region is None else region.run()
    seeds, coeffs = list(coefficients), list(coefficients.values())
    numel = numel if region is None else region.numel
    windows = [list(member_noise(table, seed, name, numel, start, stop)) for seed in seeds]
    buffer = torch.empty(CHUNK, dtype=torch.float32, device=device)
    for k, (a, b, _) in enumerate(windows[0]):
        total = buffer[: b - a].zero_()
        for coeff, member_windows in zip(coeffs, windows, strict=True):
            total.add_(member_windows[k][2], alpha=coeff)
        yield a - start, b - start, total


@torch.no_grad()
def apply_update(
    snapshot: ParameterSnapshot,
    table: NoiseTable,
    coefficients: dict[int, float],
    decay: float = 0.0,
    names: list[str] | None = None,
    into: dict[str, torch.Tensor] | None = None,
) -> float:
    """Write θ + Σ_s c_s ε(s) − decay·θ into the model's parameters (those in `names`, default all), with θ read
    from `snapshot`; `into`: other tensors to write it into instead (a master copy of θ, `LocalWeights.update`). A
    tensor that is a region of its parameter (`snapshot.regions`) takes that region of the parameter's update.

    The sum is accumulated in float32 one noise window at a time on the noise table's device, added to θ there
    and cast to the target's dtype once. The snapshot is left untouched (unless it is `into`), so an interrupted
    update can still be undone with `snapshot.restore()`. Returns ‖Δθ‖₂ of the float32 update. A
    FloatingPointError, after which the caller restores θ, when a coefficient or a written value is not finite.
    """
    check_coefficients(coefficients)
    into = snapshot.params if into is None else into
    device, squared_norm = table.values.device, 0.0
    for name in snapshot.params if names is None else names:
        flat, base = into[name].data.view(-1), snapshot.copies[name].view(-1)
        for a, b, delta in noise_sums(table, coefficients, name, flat.numel(), device, snapshot.regions.get(name)):
            theta = base[a:b].to(device)
            if decay:
                delta.add_(theta, alpha=-decay)
            squared_norm += float(delta.dot(delta))
            if flat.device == device:
                torch.add(theta, delta, out=flat[a:b])
            else:  # a master copy on the host: θ + Δ computed where the noise is, then copied
                flat[a:b].copy_(delta.add_(theta))
            if not torch.isfinite(flat[a:b]).all():
                raise not_finite(name, flat.dtype, coefficients)
    return squared_norm**0.5


@torch.no_grad()
def write_gradient(
    params: dict[str, torch.nn.Parameter], table: NoiseTable, coefficients: dict[int, float], names=None
) -> float:
    """p.grad ← −Σ_s c_s ε(s) for the parameters `names` (default all): with c_s = sign·z/(N·σ), the gradient of
    −R of the ES estimate ĝ = 1/(Nσ)·Σ z_i ε_i, for an optimizer to minimize. Built one noise window at a time in
    float32 and cast to the parameter's dtype. Returns ‖ĝ‖₂."""
    check_coefficients(coefficients)
    squared_norm = 0.0
    for name in params if names is None else names:
        p = params[name]
        grad = torch.empty_like(p, memory_format=torch.contiguous_format)
        flat = grad.view(-1)
        for a, b, estimate in noise_sums(table, coefficients, name, flat.numel(), flat.device):
            squared_norm += float(estimate.dot(estimate))
            torch.neg(estimate, out=estimate)
            flat[a:b].copy_(estimate)
        if not torch.isfinite(grad).all():
            raise not_finite(name, grad.dtype, coefficients)
        p.grad = grad
    return squared_norm**0.5
