"""Weights backends: where a member's weights are written, stated as protocols. `WeightsBackend` is what every
backend does; `TrainerWeights` adds what only a backend over the trainer's own tensors can. `LocalWeights` (here)
is the trainer's and satisfies both; `trl_es.generation.vllm_backend.VLLMWeights` writes members into vLLM's workers
and satisfies `WeightsBackend` and `AdapterWeights` (low-rank members as the engine's adapters). A search space names the protocol it needs (`SearchSpace.backend`); the trainer
refuses a backend that lacks it.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterable, Mapping
from typing import Protocol, runtime_checkable

import torch

from .noise import NoiseTable, Region
from .params import ParameterSnapshot
from .update import apply_update, write_gradient


def weights_hash(weights: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over the names, dtypes, shapes and bytes of `weights`, in name order: equal only for bitwise-equal
    weights, whatever device holds them. The one weight digest of trl-es (seed chains, deltas, vLLM's copy)."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        tensor = weights[name].detach().contiguous().cpu()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


@runtime_checkable
class WeightsBackend(Protocol):
    """What every weights backend does. `params`: θ's tensors by name (the trainer's)."""

    params: dict[str, torch.nn.Parameter]
    batches_members: bool
    """Whether the engine evaluates several full-ES members in one call (then it is a `BatchedWeights`)."""
    member_slots: int
    """With `batches_members`, how many members one call can hold."""

    def start(self) -> None:
        """Be ready to generate with θ (vLLM: receive it, once)."""

    def loaded(self, checkpoint: str) -> None:
        """θ was loaded from `checkpoint` (vLLM takes it at the next `start`)."""

    def release(self) -> None:
        """Free the step's buffers (the end of training)."""

    def capture(self) -> None:
        """θ ← the current weights (the start of a step)."""

    def member(self, seed: int, scale: float, names: list[str] | None = None) -> set[str]:
        """The evaluated weights become θ + scale·ε(seed) over `names` (default all), θ elsewhere; returns the names
        whose tensors were written."""

    def center(self) -> set[str]:
        """The evaluated weights become θ again (after a member, cheaply); returns the names written."""

    def restore(self) -> None:
        """Everything back to θ bitwise, whatever happened since `capture` (a failed step)."""

    def update(self, coefficients: dict[int, float], decay: float = 0.0, names: list[str] | None = None) -> float:
        """θ ← θ + Σ_s c_s ε(s) − decay·θ over `names`; returns ‖Δθ‖₂."""

    def fingerprint(self) -> str:
        """`weights_hash` of the weights held now: equal only for bitwise-equal weights."""


@runtime_checkable
class BatchedWeights(WeightsBackend, Protocol):
    """A backend whose engine evaluates several full-ES members in one call (`batches_members`, up to
    `member_slots`): vLLM's LoRA slots holding an adapter's members, or several vLLM servers holding one each."""

    def members(self, members: list[tuple[int, float, list[str] | None]]) -> contextlib.AbstractContextManager:
        """Within the context, member k = (seed, scale, the names it perturbs; scale 0: θ) is in the engine's k-th
        slot; yields the search space's `Route` for the next generate calls' rows. θ everywhere again after."""


@runtime_checkable
class AdapterWeights(WeightsBackend, Protocol):
    """A backend that evaluates low-rank members in the forward pass, for the low-rank search space: hooks on the
    trainer's model (`trl_es.generation.transformers_backend.TransformersWeights`) or vLLM's LoRA slots; members
    never written into the weights, updates mirrored from the trainer's tensors."""

    lowrank_names: list[str] | None
    """The weights low-rank members perturb (None: the run is not low-rank)."""

    def lowrank_members(self, members: list[tuple[int, float]]) -> contextlib.AbstractContextManager:
        """Within the context, adapter k holds member k = (seed, σ·sign; scale 0: θ); yields the search space's
        `Route` for the next generate calls' rows."""

    def lowrank_update(self, norm: float, coefficients: dict[int, float], names: list[str], rank: int) -> None:
        """The engine takes the low-rank update the trainer's tensors took (norm `norm`), checked by its norm."""


@runtime_checkable
class TrainerWeights(WeightsBackend, Protocol):
    """A backend over the trainer's own tensors: a search space may also write `params` in place between `capture`
    and the next `capture` (`restore` undoes it: the low-rank update)."""

    def write(self, weights: dict[str, torch.Tensor], member: bool = True) -> set[str]:
        """A member given by its weights (θ elsewhere), or with `member=False` the step's new θ."""

    def distance(self) -> float:
        """‖weights − θ‖₂."""

    def gradient(self, coefficients: dict[int, float], names: list[str] | None = None) -> float:
        """θ back in the tensors and `.grad` ← −Σ_s c_s ε(s) over `names`, for an optimizer; returns ‖ĝ‖₂."""


class LocalWeights:
    """θ in the tensors `params` themselves, with an exact copy of θ on `storage_device` (`ParameterSnapshot`) and
    the run's noise table on the parameters' device. Each method returns the names whose tensors it wrote, for a
    caller that mirrors them elsewhere (the vLLM worker).

    With `master` (θ by name, in a wider dtype than `params`: float32 for a bfloat16 engine's tensors) θ lives in
    the master, which is the exact copy: `params` hold the cast of θ or of a member θ + σ·ε computed in the
    master's precision, and updates are applied to the master, so that updates below `params`' resolution add up.
    With `regions`, a tensor is that region of its parameter (a tensor-parallel shard: `ParameterSnapshot`)."""

    def __init__(
        self,
        params: dict[str, torch.nn.Parameter],
        seed: int,
        table_size: int,
        storage_device="cpu",
        master: dict[str, torch.Tensor] | None = None,
        regions: dict[str, Region] | None = None,
    ):
        self.params, self.seed, self.table_size, self.storage_device = params, seed, table_size, storage_device
        self.master, self.regions = master, regions or {}
        self.batches_members, self.member_slots = False, 1  # one member at a time, in the tensors themselves
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
            self.snapshot = ParameterSnapshot(self.params, self.storage_device, self.master, self.regions)
            if self.master is not None:
                self.snapshot.restore()  # the tensors start as the cast of θ
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
        undone with `restore`. A master takes the update too, once it has reached the tensors whole (no value
        there non-finite), computed again in its own precision."""
        self.center()
        norm = apply_update(self.snapshot, self.table, coefficients, decay=decay, names=names)
        if self.master is not None:
            apply_update(self.snapshot, self.table, coefficients, decay=decay, names=names, into=self.master)
        return norm

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
        return weights_hash(self.params)
