"""Low-rank perturbations applied in the forward pass, the whole population in one batch (EGGROLL: Sarkar et al.
2025, "Evolution Strategies at the Hyperscale").

Member i's noise for a weight W (out × in) is the rank-r matrix E_i = A_i·B_iᵀ/√r, with A_i (out × r) and
B_i (in × r) i.i.d. N(0, 1) drawn from (seed_i, parameter name): each entry of E_i has unit variance, and
θ_i's weight is W + σ·sign_i·E_i (antithetic members share a seed and differ by sign). A mixture of experts' fused
expert tensor W (E × out × in) gets one such matrix per expert e, E_i,e = A_i,e·B_i,eᵀ/√r (factors E × out × r and
E × in × r).

Members are never written into the weights: the modules that apply the target weights add
σ·sign_m/√r·(x·B_m)·A_mᵀ to the product x·Wᵀ of every batch row whose member is m, computed for all rows at once as
((x·[B_1 … B_M]) ⊙ row mask)·[A_1 … A_M]ᵀ, two dense matmuls of O(batch·seq·(in + out)·M·r), the second one
adding into the output in place; a row of member −1 is the centre θ. The model's parameters stay bitwise unchanged.
Three kinds of modules carry targets (`lowrank_targets`):

- an `nn.Linear`: a forward hook adds the term to its output;
- a mixture of experts' fused experts (transformers' `gate_up_proj` E × 2I × H and `down_proj` E × H × I): within
  the population their forward is `LowRankPopulation`'s, which runs the experts one at a time (transformers' eager
  algorithm, whatever `experts_implementation` the model chose) and adds expert e's term to the tokens routed to it;
- a router beside such experts (a 2-D `weight`, E × H, that is no `nn.Linear`): the term is added to the result of
  its `F.linear(x, weight)`, so the perturbed logits choose the experts.

Other parameters ES selects (norms, embeddings, biases, a Linear weight tied to an embedding such as a tied
`lm_head`, fused experts of another layout, and the LoRA factors of a PEFT adapter on parameters) are left at θ
by this strategy.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable

import torch

from .params import is_fused_experts
from .seeds import lowrank_seed
from .space import Direction, SearchSpace, directions, names_problem, register
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


FUSED_EXPERTS = ("gate_up_proj", "down_proj")
"""The fused expert tensors of transformers' experts modules (E × 2I × H and E × H × I)."""


def fused_experts(module: torch.nn.Module) -> bool:
    """Whether `module` holds a mixture of experts' experts in the layout `LowRankPopulation` runs: transformers'
    `gate_up_proj` and `down_proj` as 3-D parameters applied as x·W_eᵀ, gated (`_apply_gate`), without biases."""
    layout = getattr(module, "has_gate", False) and not getattr(module, "is_transposed", True)
    tensors = all(isinstance(getattr(module, a, None), torch.nn.Parameter) for a in FUSED_EXPERTS)
    return layout and tensors and not module.has_bias and module.gate_up_proj.dim() == 3


def lowrank_targets(model: torch.nn.Module, params: dict[str, torch.nn.Parameter]) -> dict[str, torch.nn.Module]:
    """The module that applies each of `params` (by identity) this strategy perturbs, keyed by that parameter's name:
    an `nn.Linear` (its weight), fused experts (`fused_experts`: `gate_up_proj`, `down_proj`), or a router beside
    them (a 2-D `weight` with a row per expert, on a module that is no `nn.Linear`).

    A Linear whose weight is also an `nn.Embedding`'s (a tied `lm_head`) is left out: a low-rank perturbation of
    its output would disagree with the unperturbed embedding lookup of the same tensor. So are the LoRA factors of a
    PEFT adapter on parameters (`target_parameters`): their Linears are never called, the adapter reads their
    weights (`parameter_adapters`).
    """
    names = {id(p): name for name, p in params.items()}
    excluded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    excluded |= {id(p) for p in parameter_adapters(model).values()}
    targets = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and id(module.weight) not in excluded:
            targets[names.get(id(module.weight))] = module
        if fused_experts(module):
            targets |= {names.get(id(getattr(module, a))): module for a in FUSED_EXPERTS}
        experts = [c for c in module.children() if fused_experts(c)]
        for child in module.children() if experts else ():
            weight = getattr(child, "weight", None)
            router = not isinstance(child, torch.nn.Linear) and isinstance(weight, torch.nn.Parameter)
            if router and weight.dim() == 2 and weight.shape[0] == experts[0].gate_up_proj.shape[0]:
                targets[names.get(id(weight))] = child
    targets.pop(None, None)  # a module whose tensor ES does not select
    return targets


def parameter_adapters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The LoRA factors of a PEFT adapter on parameters (peft's `ParamWrapper`, `LoraConfig.target_parameters`, e.g.
    on fused experts), by name: the adapter builds its weight delta from them inside the wrapped module's forward."""
    try:
        from peft.tuners.lora import ParamWrapper
    except ImportError:
        return {}
    return {
        f"{prefix}.{name}": p
        for prefix, module in model.named_modules()
        if isinstance(module, ParamWrapper)
        for name, p in module.named_parameters()
        if name.startswith("lora_")
    }


def add_lowrank_(output: torch.Tensor, x: torch.Tensor, b_all: torch.Tensor, a_all: torch.Tensor, mask) -> None:
    """output += ((x·B_all) ⊙ mask)·A_all, in place: the projection x·B_all, then one `addmm_` that multiplies by
    A_all and adds into `output` (contiguous, … × out) with no temporary of its size (those cost ~20% of a batched
    generate on CPU, this ~7%). `mask` broadcasts to x·B_all: each row's (or token's) member columns. Under autocast
    (bf16=True: float32 factors of a float32 θ, a bfloat16 output) A_all is cast to the output's dtype."""
    z = torch.matmul(x, b_all).mul_(mask)
    output.view(-1, output.shape[-1]).addmm_(z.view(-1, z.shape[-1]).to(output.dtype), a_all.to(output.dtype))


class LowRankPopulation:
    """Within the context, batch row b of every forward through `targets` sees member `row_members[b]` (set by
    `route`, before each generate call): y_b = x_b·Wᵀ (+ bias) + σ·sign_m/√r·(x_b·B_m)·A_mᵀ with
    m = row_members[b], and no perturbation when m = −1; a fused expert tensor's expert e adds its own factors' term
    for the tokens routed to it, and a router's perturbed logits choose the experts.

    Member m's factors come from `lowrank_factors(seeds[m], name, W.shape, rank)`, made once on entry. Works with
    KV-cached generation, whose rows keep their order; every forward must have `len(row_members)` rows (a mixture of
    experts sees them flattened, row-major, into tokens). Hooks and forwards are removed on exit, exceptions
    included; the weights are never modified.
    """

    def __init__(
        self, targets: dict[str, torch.nn.Module], seeds: list[int], signs: list[int], sigma: float, rank: int
    ):
        if len(seeds) != len(signs):
            raise ValueError(f"got {len(seeds)} seeds but {len(signs)} signs")
        self.targets, self.seeds, self.signs, self.sigma, self.rank = targets, seeds, signs, sigma, rank
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self.forwards: dict[torch.nn.Module, Callable | None] = {}  # a replaced forward: the instance's own before
        self.masks: dict[tuple, torch.Tensor] = {}  # per (device, dtype): row b's mask over the members' columns
        self.rows = torch.zeros(0, dtype=torch.long)

    def route(self, row_members) -> None:
        """The next forwards' batch row b evaluates member `row_members[b]` (−1: the centre θ); an int m: every row
        of any batch evaluates member m."""
        rows = torch.as_tensor(row_members, dtype=torch.long).flatten()
        if rows.numel() and not (-1 <= int(rows.min()) and int(rows.max()) < len(self.seeds)):
            raise ValueError(f"row_members must lie in [-1, {len(self.seeds)}), got {rows.tolist()}")
        columns = torch.arange(len(self.seeds) * self.rank) // self.rank
        self.masks = {None: (rows[:, None] == columns[None, :]).float()}  # a centre row: all zero
        self.rows = None if isinstance(row_members, int) else rows  # None: the one row's mask broadcasts

    def mask(self, like: torch.Tensor) -> torch.Tensor:
        key = (like.device, like.dtype)
        if key not in self.masks:
            self.masks[key] = self.masks[None].to(like.device, like.dtype)
        return self.masks[key]

    def check_rows(self, batch: int) -> None:
        if self.rows is not None and batch != self.rows.shape[0]:
            raise ValueError(f"the batch has {batch} rows but the population routes {self.rows.shape[0]} rows")

    def token_mask(self, tokens: int, like: torch.Tensor) -> torch.Tensor:
        """Each token's mask, for a mixture of experts' `tokens` = rows × sequence, flattened row-major."""
        if self.rows is None:
            return self.mask(like)
        if tokens % self.rows.shape[0]:
            raise ValueError(f"{tokens} tokens do not split into the {self.rows.shape[0]} rows the population routes")
        return self.mask(like).repeat_interleave(tokens // self.rows.shape[0], dim=0)

    def concatenated_factors(self, name: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """B_all (… × in × M·r) = [B_1 … B_M] and A_all (… × M·r × out) = [σ·sign_m/√r·A_m]ᵀ stacked by member."""
        factors = [lowrank_factors(seed, name, weight.shape, self.rank) for seed in self.seeds]
        b_all = torch.cat([b for _, b in factors], dim=-1)
        scales = [self.sigma * sign / math.sqrt(self.rank) for sign in self.signs]
        a_all = torch.cat([a * scale for (a, _), scale in zip(factors, scales, strict=True)], dim=-1).transpose(-1, -2)
        return b_all.to(weight.device, weight.dtype), a_all.contiguous().to(weight.device, weight.dtype)

    def __enter__(self) -> Callable[[list[int]], None]:
        modules: dict[torch.nn.Module, dict[str, tuple]] = {}  # each target module's factors, by its attribute
        try:
            for name, module in self.targets.items():
                attribute = name.rpartition(".")[2]
                factors = self.concatenated_factors(name, getattr(module, attribute))
                modules.setdefault(module, {})[attribute] = factors
            for module, factors in modules.items():
                if isinstance(module, torch.nn.Linear):
                    self.handles.append(module.register_forward_hook(self._hook(*factors["weight"])))
                else:
                    previous = module.__dict__.get("forward")
                    make = self._experts_forward if fused_experts(module) else self._router_forward
                    module.forward = make(module, factors)
                    self.forwards[module] = previous
        except BaseException:
            self.remove()
            raise
        return self.route

    def __exit__(self, *exc_info) -> None:
        self.remove()

    def remove(self) -> None:
        """Remove every hook and forward this population installed."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for module, forward in self.forwards.items():
            del module.forward
            if forward is not None:
                module.forward = forward
        self.forwards.clear()

    def _hook(self, b_all: torch.Tensor, a_all: torch.Tensor):
        """A forward hook adding ((x·B_all) ⊙ mask_b)·A_all to row b's output: the rows' own members' (x·B_m)·A_mᵀ
        (σ·sign/√r is folded into A_all; a centre row's mask is all zero; a Linear's output is contiguous)."""

        def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            x = args[0]
            self.check_rows(x.shape[0])
            add_lowrank_(output, x.reshape(x.shape[0], -1, x.shape[-1]), b_all, a_all, self.mask(a_all)[:, None, :])
            return output

        return hook

    def _experts_forward(self, experts: torch.nn.Module, factors: dict[str, tuple]):
        """The fused experts' forward (tokens × H, their top-k experts and weights): for each expert e, its tokens'
        x·W_eᵀ of `gate_up_proj` and of `down_proj`, each plus the tokens' members' ((x·B_e) ⊙ mask)·A_e where the
        tensor is a target; the gated product between; summed over the k experts with the routing weights."""

        def project(attribute: str, x: torch.Tensor, expert: int, mask: torch.Tensor) -> torch.Tensor:
            output = torch.nn.functional.linear(x, getattr(experts, attribute)[expert])
            if attribute in factors:
                b_all, a_all = factors[attribute]
                add_lowrank_(output, x, b_all[expert], a_all[expert], mask)
            return output

        def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
            mask = self.token_mask(hidden_states.shape[0], next(iter(factors.values()))[1])
            output = torch.zeros_like(hidden_states)
            for expert in top_k_index.unique().tolist():
                token, k = torch.where(top_k_index == expert)
                token_mask = mask[token] if mask.shape[0] > 1 else mask
                gated = experts._apply_gate(project("gate_up_proj", hidden_states[token], expert, token_mask))
                y = project("down_proj", gated, expert, token_mask) * top_k_weights[token, k, None]
                output.index_add_(0, token, y.to(output.dtype))
            return output

        return forward

    def _router_forward(self, router: torch.nn.Module, factors: dict[str, tuple]):
        """The router's own forward, with the tokens' members' ((x·B) ⊙ mask)·A added to its F.linear(x, weight):
        the logits that choose the experts. A router that computes them otherwise is an error, not left at θ."""
        forward, (b_all, a_all) = router.forward, factors["weight"]
        population = self

        class PerturbedLogits(torch.overrides.TorchFunctionMode):
            applied = False

            def __torch_function__(self, func, types, args=(), kwargs=None):
                output = func(*args, **(kwargs or {}))
                if func is torch.nn.functional.linear and len(args) > 1 and args[1] is router.weight:
                    x = args[0].reshape(-1, args[0].shape[-1])
                    add_lowrank_(output, x, b_all, a_all, population.token_mask(x.shape[0], a_all))
                    self.applied = True
                return output

        def perturbed(*args, **kwargs):
            with PerturbedLogits() as mode:
                output = forward(*args, **kwargs)
            if not mode.applied:
                raise ValueError(
                    f"low-rank ES perturbs a router's logits F.linear(x, weight), and {type(router).__name__} did not "
                    "compute them so: leave its weight out of es_parameter_patterns, or use es_search_space='full'"
                )
            return output

        return perturbed


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
    """EGGROLL: member i's noise is a rank-r matrix per target weight (`lowrank_targets`: nn.Linear weights, a
    mixture of experts' fused experts, one matrix per expert, and its routers), applied in the forward pass (the
    weights are never written for a member): by a `LowRankPopulation` on the trainer's model, or with
    `use_vllm` by vLLM's LoRA adapters, one per member (`adapters`: an `AdapterWeights` backend, whose `lowrank_members`
    writes them; `trl_es.generation.vllm_worker`). `members_per_call` members share one batched generate call
    (ESConfig: `members_per_call(args)`; None: all of this process's). Update: `apply_lowrank_update` on the targets' weights, which are the trainer's
    own tensors (`weights.params`: written in place, undone by `restore`), and the same update inside vLLM."""

    name = "lowrank"

    def __init__(
        self,
        weights,
        targets: dict[str, torch.nn.Module],
        seed: int,
        population_size: int,
        rank: int = 1,
        antithetic: bool = False,
        members_per_call: int | None = None,
        gradient: bool = False,
        adapters=None,
    ):
        if not targets:
            raise ValueError(
                "es_search_space='lowrank' perturbs nn.Linear weights and a mixture of experts' experts and routers, "
                "and none is among the parameters ES selects (es_parameter_patterns)"
            )
        fused = [name for name, p in weights.params.items() if is_fused_experts(p) and name not in targets]
        if fused:  # fused experts of a layout `LowRankPopulation` does not run
            warnings.warn(
                f"es_search_space='lowrank' perturbs fused experts stored as transformers' gate_up_proj (E × 2I × H) "
                f"and down_proj (E × H × I) without biases: {len(fused)} selected tensors of more than 2 dimensions "
                f"(e.g. {fused[0]!r}) stay fixed. Use es_search_space='full' or 'copes' to train them",
                stacklevel=3,
            )
        self.weights, self.targets, self.seed, self.population_size = weights, targets, seed, population_size
        self.rank, self.antithetic, self.per_call = rank, antithetic, members_per_call
        self.gradient = gradient  # True: write −ĝ into the weights' .grad for an optimizer (ESConfig.es_optimizer)
        self.adapters = adapters

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
        """From ESConfig: the weights ES selects that `lowrank_targets` finds in the model, rank `lowrank_rank`.
        A PEFT adapter on parameters (`target_parameters`) is refused: its factors are read inside the wrapped
        module's forward, where no member's perturbation can be added."""
        wrapped = [name for name in parameter_adapters(model) if name in weights.params]
        if wrapped:
            raise ValueError(
                f"es_search_space='lowrank' with a PEFT adapter on parameters (LoraConfig.target_parameters, e.g. "
                f"{wrapped[0]!r}): peft builds that adapter's weight delta from its LoRA factors inside the wrapped "
                "module's forward, where low-rank members cannot be added. Use es_search_space='full' or 'copes' "
                "with this adapter, or an adapter on modules (target_modules)"
            )
        common = (args.seed, args.population_size, args.lowrank_rank, args.antithetic)
        targets = lowrank_targets(model, weights.params)
        adapters = weights if isinstance(weights, AdapterWeights) else None  # vLLM's LoRA slots
        return cls(weights, targets, *common, members_per_call(args), args.es_optimizer, adapters)

    def _ask(self, step: int, sigma: float) -> list[Direction]:
        return directions(self.seed, step, self.population_size, self.antithetic, sigma)

    def members_per_call(self, n_local: int) -> int:
        return min(self.per_call, n_local) if self.per_call else n_local or 1

    @contextlib.contextmanager
    def evaluating(self, members: list[Direction | None]):
        """The members' `LowRankPopulation` (or vLLM adapters); rows routed to a None member (the centre) see θ."""
        if self.adapters is not None:  # one adapter per entry; the centre's is zero
            scales = [(0, 0.0) if m is None else (m.seed, m.sigma * m.sign) for m in members]
            with self.adapters.lowrank_members(scales) as route:
                yield route
            return
        perturbed = [m for m in members if m is not None]
        if not perturbed:  # the centre alone (e.g. lowrank_members_per_call=1 with es_baseline="center"): θ itself
            yield lambda rows: None
            return
        positions, k = [], 0
        for m in members:  # index into `members` → index into the perturbed ones (−1: the centre)
            positions.append(-1 if m is None else k)
            k += m is not None
        seeds, signs = [m.seed for m in perturbed], [m.sign for m in perturbed]
        with LowRankPopulation(self.targets, seeds, signs, perturbed[0].sigma, self.rank) as route:
            yield lambda rows: route(positions[rows] if isinstance(rows, int) else [positions[i] for i in rows])

    def _tell(self, members: list[Direction], rewards: torch.Tensor, fitness: torch.Tensor, learning_rate: float):
        pairs, n_valid = [(m.seed, m.sign) for m in members], int((~torch.isnan(rewards)).sum())
        scale = 1 / members[0].sigma if self.gradient else learning_rate  # ĝ's 1/(Nσ), or the update's α/N
        coefficients = update_coefficients(fitness, pairs, scale, n_valid)
        record = {"coefficients": [[seed, c] for seed, c in coefficients.items()]}
        tensors = {name: self.weights.params[name] for name in self.targets}  # the trainer's, written in place
        if self.gradient:
            return {"es/gradient_norm": write_lowrank_gradient(tensors, coefficients, self.rank)}, record
        norm = apply_lowrank_update(tensors, coefficients, self.rank)
        if self.adapters is not None:
            self.adapters.lowrank_update(norm, coefficients, list(self.targets), self.rank)
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
