"""Where the ES worker's tensors lie in vLLM's (`trl_es.generation.vllm_worker`): a tensor-parallel rank's region of
a transformers weight (`shard_region`, `expert_region`), a low-rank factor's rows of it (`factor_rows`), and the
packing of fused expert tensors for vLLM's CPU MoE kernel (`pack_experts`)."""

from __future__ import annotations

import torch

from ..es.noise import Region


EXPERT_TENSORS = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}
"""A mixture of experts' fused expert tensors in transformers and the parameters of vLLM's fused-MoE layer that hold
them in the same layout: gate_up_proj [E, 2I, H] (each expert's gate rows, then its up rows) is w13_weight,
down_proj [E, H, I] is w2_weight."""
MOE_KERNELS = ("TRITON", "BATCHED_TRITON", "CPU")
"""vLLM's unquantized MoE kernels that compute with w13_weight and w2_weight as loaded (Triton's), or from a packed
copy that the worker re-makes (vLLM's CPU kernel); the others lay the experts out their own way after loading
(FlashInfer puts the up rows first, AITER shuffles them), which a member written by name would not follow."""


def pack_experts(tensor: torch.Tensor, packed: torch.Tensor, isa: str) -> None:
    """`packed` ← vLLM's CPU-kernel packing of the expert tensor `tensor` (w13 [E, 2I, H] or w2 [E, H, I]), written
    in place. Where vLLM pads I to its kernel's alignment, `tensor` is zero-padded as vLLM pads it: each of w13's
    gate and up halves, w2's columns (a padded copy per call; none otherwise)."""
    pad = torch.nn.functional.pad
    if tensor.shape[2] < packed.shape[2]:
        tensor = pad(tensor, (0, packed.shape[2] - tensor.shape[2]))
    elif tensor.shape[1] < packed.shape[1]:
        tensor = pad(tensor.unflatten(1, (2, -1)), (0, 0, 0, (packed.shape[1] - tensor.shape[1]) // 2)).flatten(1, 2)
    torch.ops._C.prepack_moe_weight(tensor, packed, isa)


def shard_region(layer, shape, held_shape) -> Region | None:
    """The region of a transformers weight of `shape` that vLLM's `layer` (a linear layer or an embedding) holds as
    a part of shape `held_shape` (a fused layer's part: q of qkv_proj), None for all of it: vLLM's tensor-parallel
    split, from the layer's rank. A vocabulary shard's rows; a column-parallel layer's rows (a key/value head on
    several ranks where there are fewer heads than ranks); a row-parallel layer's columns."""
    rank, size = getattr(layer, "tp_rank", 0), getattr(layer, "tp_size", 1)
    ranges = [None] * len(shape)
    if hasattr(layer, "shard_indices"):  # VocabParallelEmbedding, ParallelLMHead
        ranges[0] = ((layer.shard_indices.org_vocab_start_index, layer.shard_indices.org_vocab_end_index),)
    elif size > 1 and len(shape) <= 2:
        rows = held_shape[0]
        start = rank * shape[0] // (size * rows) * rows
        ranges[0] = ((start, start + rows),)
        if len(shape) == 2 and held_shape[1] < shape[1]:  # row-parallel: the input columns split
            ranges[1] = ((rank * held_shape[1], (rank + 1) * held_shape[1]),)
    ranges = [None if r == ((0, n),) else r for r, n in zip(ranges, shape, strict=True)]
    return Region(tuple(shape), tuple(ranges)) if any(ranges) else None


def factor_rows(factor: torch.Tensor, ranges) -> torch.Tensor:
    """The rows `ranges` of a low-rank factor ((start, stop) pairs of a `Region`; None: all of them)."""
    return factor if ranges is None else Region(tuple(factor.shape), (ranges, None)).cut(factor)


def expert_region(leaf: str, shape, experts_held: int) -> Region | None | bool:
    """The region of a fused expert tensor (`EXPERT_TENSORS`) of `shape` that this tensor-parallel rank's MoE layer
    holds (None: all of it): each expert's intermediate dim split as vLLM splits it (gate_up_proj [E, 2I, H]: the
    rank's gate rows then its up rows; down_proj [E, H, I]: its columns). False where the experts themselves are
    split over ranks (`experts_held` < E: expert parallelism), which members are not written into."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    rank, size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    if experts_held != shape[0]:
        return False
    if size == 1:
        return None
    if leaf == "gate_up_proj":
        half = shape[1] // 2
        part = half // size
        rows = ((rank * part, (rank + 1) * part), (half + rank * part, half + (rank + 1) * part))
        return Region(tuple(shape), (None, rows, None))
    part = shape[2] // size
    return Region(tuple(shape), (None, None, ((rank * part, (rank + 1) * part),)))
