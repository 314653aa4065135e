"""The ES worker's state for a run (`trl_es.generation.vllm_worker`), one object per mode: `FullState` when θ is the
model's weights (`es_init`, with the low-rank members' LoRA slots `es_lowrank_init` adds), `AdapterState` when θ is a
LoRA adapter's weights (`es_adapter_init`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..es.weights import LocalWeights


@dataclass
class WorkerState:
    """What the worker holds for a run, whatever its mode: θ under the trainer's names (`weights`; `names`: those ES
    perturbs), whether vLLM multiplies by packed CPU copies of its weights (`repacked`), and the LoRA slots it
    registered (their indices, in LoRA-id order)."""

    weights: LocalWeights
    names: list[str]
    repacked: bool
    slots: list[int] = field(default_factory=list)


@dataclass
class FullState(WorkerState):
    """`es_init`'s: θ is vLLM's weights themselves (`in_place`: views of them) or the worker's own tensors copied in;
    `packed`: per name, the CPU layers to re-pack after it changes; `moe`: vLLM's fused-MoE layers by the
    transformers name of their experts module; `packed_experts`: per expert tensor vLLM's CPU kernel packs, (its
    packed parameter, the ISA). `es_lowrank_init` adds the low-rank members' LoRA tensors per name (`lowrank`: A
    stacked, B stacked, this rank's region) and their `rank`."""

    in_place: bool = False
    packed: dict[str, list] = field(default_factory=dict)
    moe: dict[str, torch.nn.Module] = field(default_factory=dict)
    packed_experts: dict[str, tuple[torch.Tensor, str]] = field(default_factory=dict)
    lowrank: dict[str, tuple] = field(default_factory=dict)
    rank: int = 0


@dataclass
class AdapterState(WorkerState):
    """`es_adapter_init`'s: θ is a LoRA adapter's weights, evaluated through LoRA slot `slots[0]`; `pairs`: per
    adapted layer (A's name, B's name, scaling, A stacked, B stacked, this rank's region)."""

    pairs: list[tuple] = field(default_factory=list)
