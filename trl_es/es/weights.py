"""Weights backends: where a member's weights are written. This module holds the interface's reference, the trainer's
own tensors (`LocalWeights`); `trl_es.rollout.vllm_generate.VLLMWeights` writes members into vLLM's workers.

A backend holds θ (`params`: the trainer's parameters ES moves, by name) and the step's state, and answers:

- `start()`: be ready to generate with θ (vLLM: receive it, once); `loaded(checkpoint)`: θ was loaded from a
  checkpoint; `release()`: free the step's buffers (the end of training);
- `capture()`: θ ← the current weights (start of a step);
- `member(seed, scale, names)`: the evaluated weights become θ + scale·ε(seed) over `names` (default all), θ
  elsewhere; `center()`: they become θ again (after a member, cheaply);
- `restore()`: everything back to θ bitwise, whatever happened since `capture` (a failed step);
- `update(coefficients, decay, names)`: θ ← θ + Σ_s c_s ε(s) − decay·θ over `names`; returns ‖Δθ‖₂;
- `gradient(coefficients, names)` (the trainer's own tensors only): `.grad` ← −Σ_s c_s ε(s), for an optimizer;
- `fingerprint()`: a hash of the weights' bytes, equal only for bitwise-equal weights.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

from .noise import NoiseTable
from .params import ParameterSnapshot
from .update import apply_update, write_gradient


def weights_fingerprint(weights: dict[str, torch.Tensor], names: Iterable[str]) -> str:
    """A hash of the bytes of `weights[name]` for `names` (in that order): equal only for bitwise-equal weights,
    whatever device holds them."""
    digest = hashlib.blake2b(digest_size=16)
    for name in names:
        tensor = weights[name].detach().contiguous()
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(tensor.view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


class LocalWeights:
    """θ in the tensors `params` themselves, with an exact copy of θ on `storage_device` (`ParameterSnapshot`) and
    the run's noise table on the parameters' device. Each method returns the names whose tensors it wrote, for a
    caller that mirrors them elsewhere (the vLLM worker)."""

    def __init__(self, params: dict[str, torch.nn.Parameter], seed: int, table_size: int, storage_device="cpu"):
        self.params, self.seed, self.table_size, self.storage_device = params, seed, table_size, storage_device
        self.snapshot: ParameterSnapshot | None = None
        self.table: NoiseTable | None = None
        self.changed: set[str] = set()  # names holding a member's values rather than θ

    def start(self) -> None:
        """Nothing to do: θ is in the tensors already (the copy and the table are made at the first `capture`)."""

    def loaded(self, checkpoint: str) -> None:
        """Nothing to do: the tensors themselves were loaded from the checkpoint."""

    def release(self) -> None:
        """Free the copy of θ and the table (rebuilt from the seed when needed again)."""
        self.snapshot = self.table = None

    def capture(self, names: Iterable[str] | None = None) -> None:
        if self.snapshot is None:
            self.table = NoiseTable(self.seed, self.table_size, next(iter(self.params.values())).device)
            self.snapshot = ParameterSnapshot(self.params, self.storage_device)
        self.snapshot.capture(names)
        self.changed = set()

    def member(self, seed: int, scale: float, names: list[str] | None = None) -> set[str]:
        names = list(self.params) if names is None else names
        written, self.changed = self.changed | set(names), set(names)
        self.snapshot.restore(written - self.changed)  # `names` are rewritten from the snapshot, never accumulated
        self.snapshot.perturb(self.table, seed, scale, names)
        return written

    def write(self, weights: dict[str, torch.Tensor], member: bool = True) -> set[str]:
        """A member given by its weights (e.g. a candidate merge): `weights` over their names, θ elsewhere. With
        `member=False` they are the step's new θ instead (as after `update`)."""
        written = self.center()
        with torch.no_grad():
            for name, value in weights.items():
                self.params[name].copy_(value)
        if member:
            self.changed = set(weights)
        return written | set(weights)

    def center(self) -> set[str]:
        written, self.changed = self.changed, set()
        self.snapshot.restore(written)
        return written

    def restore(self) -> None:
        """θ back everywhere, and no gradient pending (`gradient`) for an optimizer to apply."""
        self.snapshot.restore()
        self.changed = set()
        for p in self.params.values():
            p.grad = None

    def update(self, coefficients: dict[int, float], decay: float = 0.0, names: list[str] | None = None) -> float:
        """`apply_update` from the snapshot: the snapshot stays θ until the next `capture`, so a failure can still be
        undone with `restore`."""
        self.center()
        return apply_update(self.snapshot, self.table, coefficients, decay=decay, names=names)

    def gradient(self, coefficients: dict[int, float], names: list[str] | None = None) -> float:
        """θ back in the tensors, and their `.grad` ← −Σ_s c_s ε(s) over `names` (`write_gradient`), for Trainer's
        optimizer to step; returns ‖ĝ‖₂."""
        self.center()
        return write_gradient(self.params, self.table, coefficients, names)

    def distance(self) -> float:
        """‖weights − θ‖₂ (float32), e.g. of a merge written as the new θ."""
        return (
            sum(
                float((p.detach().float() - self.snapshot.copies[n].float()).square().sum())
                for n, p in self.params.items()
            )
            ** 0.5
        )

    def fingerprint(self) -> str:
        return weights_fingerprint(self.params, self.params)
