"""Cooperative subspaces (CoPES): the parameters split into K groups, each member perturbing one group.

Member i (or antithetic pair k) perturbs group g(i) = i mod K (k mod K) only, with σ·√K so that the population's
total noise per step matches full ES; the rewards of all members are z-scored together; group g's update uses its
own members: θ_g ← θ_g + α·(1/N_g)·Σ_{i: g(i)=g} z_i·ε_i,g.
"""

from __future__ import annotations

import torch

from .params import layer_index
from .seeds import partition_seed


PARTITIONS = ("layer", "module", "random")


def _module_type(name: str) -> str:
    """`model.layers.3.self_attn.q_proj.weight` → `q_proj`; `model.embed_tokens.weight` → `embed_tokens`."""
    parts = name.split(".")
    return parts[-2] if parts[-1] in ("weight", "bias") and len(parts) > 1 else parts[-1]


def partition_parameters(names: list[str], k: int, rule: str = "layer", seed: int = 0) -> list[list[str]]:
    """K groups of parameter names.

    - "layer": transformer layers (`layers.<i>.`) in K contiguous blocks; other parameters (embeddings, final
      norm) dealt round-robin over the groups;
    - "module": one module type per group (q_proj, mlp's up_proj, norms, …; types sorted, dealt round-robin);
    - "random": the parameter tensors in a seeded random order, dealt round-robin.
    A ValueError when a group would be empty."""
    if rule not in PARTITIONS:
        raise ValueError(f"unknown CoPES partition {rule!r}; choose one of {PARTITIONS}")
    if k < 1:
        raise ValueError(f"CoPES needs at least one group, got {k}")
    groups: list[list[str]] = [[] for _ in range(k)]
    if rule == "layer":
        layers = sorted({layer for name in names if (layer := layer_index(name)) is not None})
        block = {layer: position * k // len(layers) for position, layer in enumerate(layers)}
        others = 0
        for name in names:
            layer = layer_index(name)
            if layer is not None:
                groups[block[layer]].append(name)
            else:
                groups[others % k].append(name)
                others += 1
    elif rule == "module":
        types = sorted({_module_type(name) for name in names})
        for name in names:
            groups[types.index(_module_type(name)) % k].append(name)
    else:
        order = torch.randperm(len(names), generator=torch.Generator().manual_seed(partition_seed(seed))).tolist()
        for position, index in enumerate(order):
            groups[position % k].append(names[index])
    empty = sum(not group for group in groups)
    if empty:
        raise ValueError(
            f"the '{rule}' partition of {len(names)} parameters into {k} groups leaves {empty} empty: use fewer "
            "groups or another partition"
        )
    return groups


def member_groups(n_members: int, k: int, antithetic: bool) -> list[int]:
    """g(i): member i's group, i mod K (antithetic pairs: pair mod K, so both signs share the group)."""
    return [(i // 2 if antithetic else i) % k for i in range(n_members)]
