"""Low-rank members in the trainer's model's forward pass (EGGROLL's batched evaluation; the noise and the update
are `trl_es.es.lowrank`'s): which modules of a transformers model carry the targets, and the hooks and forwards that
add each batch row's member to them. `TransformersWeights.lowrank_members` uses it for `es_search_space="lowrank"`.

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

import math
from collections.abc import Callable

import torch

from ..es.lowrank import lowrank_factors


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


def target_modules(model: torch.nn.Module, names) -> dict[str, torch.nn.Module]:
    """The module that applies each target weight of `names` (`lowrank_targets`' names): the one holding it."""
    return {name: model.get_submodule(name.rpartition(".")[0]) for name in names}


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
