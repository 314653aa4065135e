"""The ES algorithm on plain tensors (DESIGN.md §2). Imports torch only, never transformers."""

from .fitness import shape_fitness
from .noise import NoiseTable, member_noise, member_seed
from .params import ParameterSnapshot, select_parameters
from .subspaces import member_groups, partition_parameters
from .update import apply_update, update_coefficients


__all__ = [
    "NoiseTable",
    "ParameterSnapshot",
    "apply_update",
    "member_groups",
    "member_noise",
    "member_seed",
    "partition_parameters",
    "select_parameters",
    "shape_fitness",
    "update_coefficients",
]
