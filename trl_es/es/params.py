"""Which parameters ES moves, and the exact copy of them that makes restoring bitwise."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from .noise import NoiseTable, Region, member_noise, region_noise


LAYER = re.compile(r"(?:^|\.)layers?\.(\d+)\.")
"""A transformer layer's parameters: `model.layers.3.mlp.up_proj.weight` (Llama, Qwen…), `encoder.layer.3.…`."""


def layer_index(name: str) -> int | None:
    """The transformer layer a parameter belongs to (`…layers.<i>.…`), or None (embeddings, final norm, head)."""
    match = LAYER.search(name)
    return int(match.group(1)) if match else None


def is_quantized(p: torch.Tensor) -> bool:
    """Whether `p` is stored quantized: an integer dtype (bitsandbytes' Int8Params, Params4bit) or a tensor subclass
    (torchao's quantized tensors report a float dtype). Writing θ + σ·ε into one corrupts it silently."""
    return not p.dtype.is_floating_point or type(p) not in (torch.Tensor, torch.nn.Parameter)


def is_int8_weight(p: torch.Tensor) -> bool:
    """Whether `p` is an LLM.int8 weight: bitsandbytes' `Int8Params` holding the int8 integers its layer's forward
    reads (each row scaled by its own float, SCB), the θ of es_search_space='qes'."""
    return type(p).__name__ == "Int8Params" and p.dtype == torch.int8


def int8_parameters(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]], patterns: list[str] | None = None
) -> dict[str, torch.nn.Parameter]:
    """The θ of es_search_space='qes': the int8 weights (`is_int8_weight`) of an 8-bit model, those whose name
    matches one of the regular expressions in `patterns` (`re.search`) when given. A ValueError when there is none."""
    int8 = {name: p for name, p in named_parameters if is_int8_weight(p)}
    if patterns:
        compiled = [re.compile(pattern) for pattern in patterns]
        int8 = {name: p for name, p in int8.items() if any(c.search(name) for c in compiled)}
    if not int8:
        matching = f" matching `es_parameter_patterns` {patterns}" if patterns else ""
        raise ValueError(f"es_search_space='qes' found no int8 weight{matching} in the model to train")
    for name, p in int8.items():
        if not p.is_contiguous():
            raise ValueError(f"int8 weight {name!r} is not contiguous; QES steps flat views of its integers")
    return int8


def select_parameters(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]], patterns: list[str] | None = None
) -> dict[str, torch.nn.Parameter]:
    """The parameters θ that ES perturbs: every trainable one (`requires_grad`), or those whose name matches
    one of the regular expressions in `patterns` (`re.search`). Tied parameters appear once. Quantized parameters
    (`is_quantized`) are never selected: ES writes members and updates into θ, which quantized storage cannot
    hold."""
    trainable = {name: p for name, p in named_parameters if p.requires_grad}
    if patterns:
        compiled = [re.compile(pattern) for pattern in patterns]
        trainable = {name: p for name, p in trainable.items() if any(c.search(name) for c in compiled)}
        if not trainable:
            raise ValueError(f"`es_parameter_patterns` {patterns} match no trainable parameter of the model")
    quantized = [name for name, p in trainable.items() if is_quantized(p)]
    if quantized and len(quantized) == len(trainable):
        raise ValueError(
            f"the parameters ES would perturb are all quantized (e.g. {quantized[0]!r}): ES writes θ + σ·ε into "
            "them, which quantized storage cannot hold. Train an adapter on the quantized model (peft_config, or "
            "es_adapter_only=True with an adapter)"
        )
    trainable = {name: p for name, p in trainable.items() if not is_quantized(p)}
    if not trainable:
        raise ValueError("the model has no trainable parameters (requires_grad=True) for ES to perturb")
    for name, p in trainable.items():
        if not p.is_contiguous():
            raise ValueError(f"parameter {name!r} is not contiguous; ES perturbs flat views of parameters")
    return trainable


def is_fused_experts(p: torch.Tensor) -> bool:
    """Whether `p` is a mixture of experts' fused expert tensor: one matrix per expert, stacked (3-D)."""
    return p.dim() > 2


HALF_PRECISION = (torch.bfloat16, torch.float16)


@torch.no_grad()
def upcast(params: dict[str, torch.nn.Parameter]) -> list[str]:
    """Make every bfloat16/float16 tensor of `params` float32 in place (its values exact, on its device); returns the
    names upcast. Mixed precision keeps θ and its updates in float32 this way (ESConfig.bf16)."""
    upcast = [name for name, p in params.items() if p.dtype in HALF_PRECISION]
    for name in upcast:
        params[name].data = params[name].data.float()
    return upcast


class ParameterSnapshot:
    """An exact copy of θ kept beside the model (on `storage_device`, the host when there is an accelerator).

    Members are built from it, `θ_i = θ + scale·ε_i` (one fused add per noise window, in the copy's precision, cast
    once into the parameter), and `restore` copies it back, so the model returns to θ bitwise whatever happened in
    between. Restoring by subtracting the noise again is not exact (fp32 drifts ~1e-7 per member; bf16 by about the
    size of an ES update).

    With `master` (θ in a wider dtype than the parameters, e.g. float32 for a bfloat16 engine) the copy *is* θ: the
    parameters hold its cast, `capture` leaves it as it is, and updates are applied to it (`LocalWeights.update`).
    A tensor of `regions` is that region of its parameter (a tensor-parallel shard) and takes that region's noise.
    """

    def __init__(
        self,
        params: dict[str, torch.nn.Parameter],
        storage_device: torch.device | str = "cpu",
        master: dict[str, torch.Tensor] | None = None,
        regions: dict[str, Region] | None = None,
    ):
        self.params, self.regions = params, regions or {}
        self.is_master = master is not None
        self.copies = master if master is not None else {
            name: torch.empty_like(p, device=storage_device, memory_format=torch.contiguous_format)
            for name, p in params.items()
        }  # fmt: skip

    @torch.no_grad()
    def capture(self, names: Iterable[str] | None = None) -> None:
        """Take θ from the model (the parameters `names`, default all); a master copy is θ already."""
        if self.is_master:
            return
        for name in self.params if names is None else names:
            self.copies[name].copy_(self.params[name].detach())

    @torch.no_grad()
    def restore(self, names: Iterable[str] | None = None) -> None:
        """Put θ back into the model (the parameters `names`, default all), bitwise."""
        for name in self.params if names is None else names:
            self.params[name].copy_(self.copies[name])

    @torch.no_grad()
    def perturb(self, table: NoiseTable, seed: int, scale: float, names: Iterable[str] | None = None) -> None:
        """Set the model's parameters (those in `names`, default all) to θ + scale·ε(seed), computed from the
        snapshot in its precision and cast once (never accumulated)."""
        for name in self.params if names is None else names:
            p = self.params[name]
            flat, base = p.data.view(-1), self.copies[name].view(-1)
            for a, b, window in self.noise(table, seed, name):
                if base.device == flat.device:
                    torch.add(base[a:b], window, alpha=scale, out=flat[a:b])
                else:
                    flat[a:b].copy_(base[a:b].to(flat.device).add_(window, alpha=scale))

    def noise(self, table: NoiseTable, seed: int, name: str):
        """ε(seed) of parameter `name` in windows (`member_noise`), over its region where it has one."""
        if name in self.regions:
            return region_noise(table, seed, name, self.regions[name])
        return member_noise(table, seed, name, self.params[name].numel())
