"""The ES algorithm on plain tensors. Imports torch only, never transformers (a test checks it).

seeds (every seed of a run) · noise (the shared noise table) · params (which parameters move; the exact copy of θ) ·
weights (the weights backend interface; the trainer's own tensors) · fitness (shaping) · update (the ES update) ·
space (the search-space protocol) · full (full ES and CoPES) · subspaces (CoPES groups) · lowrank (EGGROLL) ·
merge (Hyper-ES; needs cma and peft).
"""

from .fitness import shape_fitness
from .full import FullSpace
from .noise import NoiseTable, member_noise
from .params import ParameterSnapshot, layer_index, select_parameters
from .seeds import derive_seed, member_seed
from .space import Direction, SearchSpace, directions
from .subspaces import member_groups, partition_parameters
from .update import apply_update, update_coefficients
from .weights import LocalWeights, weights_fingerprint


__all__ = [
    "Direction",
    "FullSpace",
    "LocalWeights",
    "NoiseTable",
    "ParameterSnapshot",
    "SearchSpace",
    "apply_update",
    "derive_seed",
    "directions",
    "layer_index",
    "member_groups",
    "member_noise",
    "member_seed",
    "partition_parameters",
    "select_parameters",
    "shape_fitness",
    "update_coefficients",
    "weights_fingerprint",
]
