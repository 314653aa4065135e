"""The ES algorithm on plain tensors. Imports torch only, never transformers (a test checks it).

seeds (every seed of a run) · noise (the shared noise table) · params (which parameters move; the exact copy of θ) ·
weights (the weights backend interface; the trainer's own tensors) · fitness (shaping) · update (the ES update) ·
space (the search-space protocol) · full (full ES and CoPES) · subspaces (CoPES groups) · lowrank (EGGROLL) ·
merge (Hyper-ES; needs cma and peft when it runs) · qes (integer ES on an 8-bit model's int8 weights). Importing the package registers every search space.
"""

from .fitness import shape_fitness
from .full import CoPESSpace, FullSpace
from .lowrank import LowRankSpace
from .merge import MergeSpace
from .noise import NoiseTable, member_noise
from .params import ParameterSnapshot, int8_parameters, layer_index, select_parameters
from .qes import Int8Weights, QESSpace
from .seeds import derive_seed, member_seed
from .space import SEARCH_SPACES, Direction, SearchSpace, directions, register, search_space
from .subspaces import member_groups, partition_parameters
from .update import apply_update, update_coefficients
from .weights import LocalWeights, weights_hash


__all__ = [
    "SEARCH_SPACES",
    "CoPESSpace",
    "Direction",
    "FullSpace",
    "Int8Weights",
    "LowRankSpace",
    "MergeSpace",
    "LocalWeights",
    "NoiseTable",
    "ParameterSnapshot",
    "QESSpace",
    "SearchSpace",
    "apply_update",
    "derive_seed",
    "directions",
    "int8_parameters",
    "layer_index",
    "member_groups",
    "member_noise",
    "member_seed",
    "partition_parameters",
    "register",
    "search_space",
    "select_parameters",
    "shape_fitness",
    "update_coefficients",
    "weights_hash",
]
