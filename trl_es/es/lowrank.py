"""Low-rank ES (EGGROLL: Sarkar et al. 2025, "Evolution Strategies at the Hyperscale"): the noise, the update and the
search space; the members are evaluated in the forward pass by the weights backend (`AdapterWeights.lowrank_members`:
hooks on the trainer's model, `trl_es.generation.lowrank_forward`, or vLLM's LoRA slots), never written into θ.

Member i's noise for a weight W (out × in) is the rank-r matrix E_i = A_i·B_iᵀ/√r, with A_i (out × r) and
B_i (in × r) i.i.d. N(0, 1) drawn from (seed_i, parameter name): each entry of E_i has unit variance, and
θ_i's weight is W + σ·sign_i·E_i (antithetic members share a seed and differ by sign). A mixture of experts' fused
expert tensor W (E × out × in) gets one such matrix per expert e, E_i,e = A_i,e·B_i,eᵀ/√r (factors E × out × r and
E × in × r).
"""

from __future__ import annotations

import math
import warnings

import torch

from .params import is_fused_experts
from .seeds import lowrank_seed
from .space import Direction, SearchSpace, UpdateRule, directions, names_problem, register
from .update import not_finite, update_coefficients
from .weights import AdapterWeights


def lowrank_factors(
    seed: int,
    name: str,
    shape: tuple[int, ...],
    rank: int = 1,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A (… × out × r) and B (… × in × r), i.i.d. N(0, 1) from (seed, name), for a weight of shape (… × out × in):
    the noise of weight `name` is E = A·Bᵀ/√r, one matrix per leading index (a fused expert tensor's experts).

    Drawn in float32 on the host from a generator seeded by hash(seed, name), so the same on every process and
    device, then moved to `device` and `dtype`.
    """
    if rank < 1:
        raise ValueError(f"rank must be at least 1, got {rank}")
    *experts, out_features, in_features = shape
    generator = torch.Generator().manual_seed(lowrank_seed(seed, name))
    a = torch.randn(*experts, out_features, rank, generator=generator)
    b = torch.randn(*experts, in_features, rank, generator=generator)
    return a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)


ROWS_PER_CALL = 512
"""Rows (members × prompts × generations) of one batched generate call when `lowrank_members_per_call` is unset:
the population in as few calls as keep each within this, so a population of thousands costs the memory of 512 rows,
not of all of its rows (N = 1,024 rank-1 members of a tiny model in one call of 2,048 rows peaked 1.1 GB above the
loaded model; in calls of 32 members, no higher than N = 32)."""
SEEDS_PER_MATMUL = 1024
"""Seeds of one matmul of the low-rank update (`lowrank_delta`): a population of thousands is summed in parts, so
its factors never sit in memory all at once."""


def members_per_call(args) -> int:
    """Members (the centre counted) per batched generate call, for ESConfig `args`: `lowrank_members_per_call`, or
    the step's evaluations while their rows fit in `ROWS_PER_CALL` (at least one). With use_vllm, the engine's
    LoRA slots."""
    if args.lowrank_members_per_call:
        return args.lowrank_members_per_call
    slots = args.population_size + (args.es_baseline == "center")
    rows = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_generations
    return max(1, min(slots, ROWS_PER_CALL // rows))


@torch.no_grad()
def lowrank_update(
    tensors: dict[str, torch.Tensor],
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
    return apply_lowrank_update(tensors, update_coefficients(fitness, directions, learning_rate, n_members), rank)


def lowrank_delta(name: str, weight: torch.Tensor, coefficients: dict[int, float], rank: int, region=None):
    """Σ_s c_s·A_s·B_sᵀ/√r for weight `name`, in float32: one matmul [c_1·A_1 … c_S·A_S]·[B_1 … B_S]ᵀ/√r (batched
    over the experts of a fused expert tensor). With `region` (`trl_es.es.noise.Region`: `weight` is that shard of
    the parameter), the whole parameter's delta cut to it, so each element is the whole one's bitwise."""
    shape = weight.shape if region is None else region.shape
    seeds, delta = list(coefficients.items()), None
    for start in range(0, len(seeds), SEEDS_PER_MATMUL):  # more seeds than SEEDS_PER_MATMUL: summed part by part
        part = seeds[start : start + SEEDS_PER_MATMUL]
        factors = [lowrank_factors(seed, name, shape, rank, device=weight.device) for seed, _ in part]
        scaled = [a * (c / math.sqrt(rank)) for (a, _), (_, c) in zip(factors, part, strict=True)]
        product = torch.cat(scaled, dim=-1) @ torch.cat([b for _, b in factors], dim=-1).transpose(-1, -2)
        delta = product if delta is None else delta.add_(product)
    return delta if region is None else region.cut(delta)


@torch.no_grad()
def apply_lowrank_update(
    tensors: dict[str, torch.Tensor], coefficients: dict[int, float], rank: int = 1, regions: dict | None = None
) -> float:
    """W ← W + Σ_s c_s·A_s·B_sᵀ/√r for each weight, in place (the coefficients already hold α/N·Σ z·sign), added in
    float32 and cast to the weight dtype once; a weight of `regions` (a tensor-parallel shard) takes its region of
    the whole parameter's update (`lowrank_delta`). Returns ‖Δθ‖₂."""
    squared_norm = 0.0
    for name, weight in tensors.items():
        delta = lowrank_delta(name, weight, coefficients, rank, (regions or {}).get(name))
        squared_norm += float(delta.square().sum())
        updated = (weight.float() + delta).to(weight.dtype)
        if not torch.isfinite(updated).all():
            raise not_finite(name, weight.dtype, coefficients)
        weight.copy_(updated)
    return squared_norm**0.5


@torch.no_grad()
def write_lowrank_gradient(tensors: dict[str, torch.nn.Parameter], coefficients: dict[int, float], rank: int = 1):
    """W.grad ← −Σ_s c_s·A_s·B_sᵀ/√r for each weight (c_s = sign·z/(N·σ): minus the ES gradient estimate), for an
    optimizer; returns ‖ĝ‖₂."""
    squared_norm = 0.0
    for name, weight in tensors.items():
        estimate = lowrank_delta(name, weight, coefficients, rank)
        squared_norm += float(estimate.square().sum())
        if not torch.isfinite(estimate).all():
            raise not_finite(name, weight.dtype, coefficients)
        weight.grad = (-estimate).to(weight.dtype)
    return squared_norm**0.5


@register
class LowRankSpace(SearchSpace):
    """EGGROLL: member i's noise is a rank-r matrix per target weight (`targets`, the backend's `lowrank_names`:
    nn.Linear weights, a mixture of experts' fused experts, one matrix per expert, and its routers), applied in the
    forward pass by the weights backend (an `AdapterWeights`: hooks on the trainer's model, or vLLM's LoRA adapters,
    one per member), the weights never written for a member. `members_per_call` members share one batched generate
    call (ESConfig: `members_per_call(args)`; None: all of this process's). Update: `apply_lowrank_update` on the
    targets' weights, which are the trainer's own tensors (`weights.params`: written in place, undone by `restore`),
    then the backend's `lowrank_update` (the same update inside vLLM)."""

    name = "lowrank"
    backend = AdapterWeights

    def __init__(
        self,
        weights,
        targets: list[str],
        seed: int,
        population_size: int,
        rank: int = 1,
        antithetic: bool = False,
        members_per_call: int | None = None,
        gradient: bool = False,
        rule: UpdateRule | None = None,
    ):
        if not targets:
            raise ValueError(
                "es_search_space='lowrank' perturbs nn.Linear weights and a mixture of experts' experts and routers, "
                "and none is among the parameters ES selects (es_parameter_patterns)"
            )
        fused = [name for name, p in weights.params.items() if is_fused_experts(p) and name not in targets]
        if fused:  # fused experts of a layout the forward pass's members do not run
            warnings.warn(
                f"es_search_space='lowrank' perturbs fused experts stored as transformers' gate_up_proj (E × 2I × H) "
                f"and down_proj (E × H × I) without biases: {len(fused)} selected tensors of more than 2 dimensions "
                f"(e.g. {fused[0]!r}) stay fixed. Use es_search_space='full' or 'copes' to train them",
                stacklevel=3,
            )
        super().__init__(weights, rule)
        self.targets, self.seed, self.population_size = targets, seed, population_size
        self.rank, self.antithetic, self.per_call = rank, antithetic, members_per_call
        self.gradient = gradient  # True: write −ĝ into the weights' .grad for an optimizer (ESConfig.es_optimizer)

    @classmethod
    def check_config(cls, args, refuse) -> None:
        if args.lowrank_rank < 1:
            refuse("lowrank_rank", "the rank must be ≥ 1")
        if args.lowrank_members_per_call is not None and args.lowrank_members_per_call < 1:
            refuse("lowrank_members_per_call", "each call needs at least one member")
        if args.weight_decay and not args.es_optimizer:
            refuse("weight_decay", "the plain low-rank update moves θ only along the members' low-rank directions "
                   "(with es_optimizer the optimizer applies weight_decay)")  # fmt: skip
        if args.use_vllm and args.vllm_mode == "server":
            refuse("es_search_space", "low-rank members run as LoRA adapters inside an in-process vLLM engine: use "
                   "vllm_mode='colocate', or 'full' with a server")  # fmt: skip
        if args.use_vllm and args.lowrank_rank > 512:
            refuse("lowrank_rank", "vLLM's LoRA adapters have rank ≤ 512")

    @classmethod
    def from_config(cls, args, model, weights, load_model=None) -> LowRankSpace:
        """From ESConfig: the weights backend's `lowrank_names` (the targets its forward pass perturbs), rank
        `lowrank_rank`."""
        common = (args.seed, args.population_size, args.lowrank_rank, args.antithetic)
        targets = list(weights.lowrank_names or ())
        return cls(weights, targets, *common, members_per_call(args), args.es_optimizer, UpdateRule.from_config(args))

    def _ask(self, step: int, sigma: float) -> list[Direction]:
        return directions(self.seed, step, self.population_size, self.antithetic, sigma)

    def members_per_call(self, n_local: int) -> int:
        return min(self.per_call, n_local) if self.per_call else n_local or 1

    def evaluating(self, members: list[Direction | None]):
        """The backend's `lowrank_members`: one entry per member, the centre's (None) of scale 0 (θ itself)."""
        return self.weights.lowrank_members([(0, 0.0) if m is None else (m.seed, m.sigma * m.sign) for m in members])

    def _tell(self, members: list[Direction], rewards: torch.Tensor, fitness: torch.Tensor, learning_rate: float):
        pairs, n_valid = [(m.seed, m.sign) for m in members], int((~torch.isnan(rewards)).sum())
        scale = 1 / members[0].sigma if self.gradient else learning_rate  # ĝ's 1/(Nσ), or the update's α/N
        coefficients = update_coefficients(fitness, pairs, scale, n_valid)
        record = {"coefficients": [[seed, c] for seed, c in coefficients.items()]}
        tensors = {name: self.weights.params[name] for name in self.targets}  # the trainer's, written in place
        if self.gradient:
            return {"es/gradient_norm": write_lowrank_gradient(tensors, coefficients, self.rank)}, record
        norm = apply_lowrank_update(tensors, coefficients, self.rank)
        self.weights.lowrank_update(norm, coefficients, self.targets, self.rank)
        return {"es/update_norm": norm}, record

    def chain_header(self) -> dict:
        return {"kind": self.name, "rank": self.rank, "targets": list(self.targets)}

    @staticmethod
    def check_chain_header(header: dict, parameters: list[str]) -> str | None:
        rank = header.get("rank")
        if type(rank) is not int or rank < 1:
            return "header.space.rank must be a positive integer"
        return names_problem("header.space.targets", header.get("targets"), parameters)

    @staticmethod
    def replayer(header: dict, weights, load_model=None):
        targets = {name: weights.params[name] for name in header["targets"]}
        write = write_lowrank_gradient if header.get("optimizer") else apply_lowrank_update

        def replay(update: dict) -> None:
            write(targets, {int(seed): float(c) for seed, c in update["coefficients"]}, header["rank"])

        return replay
