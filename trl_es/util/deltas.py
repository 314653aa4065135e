"""Sparse updates: how a tuned model differs from its base, magnitude thresholding, and a compact delta file.

The ES research finds that ES moves the whole model far, yet its task gain lives in a sparse set of larger-magnitude
changes. With Δ = θ_tuned − θ_base (computed in float32):

- statistics as reported there: relative L2 distance ‖Δ‖/‖θ_base‖, the number and share of nonzero updates,
  and s_τ = share of the nonzero updates with |Δ| ≤ τ, for the whole model and per tensor;
- thresholding keeps the entries with |Δ| > τ (or the top fraction by |Δ|): the thresholded model takes θ_tuned
  there and θ_base elsewhere;
- a delta file (safetensors) stores, per tensor, which entries are kept and θ_tuned's values there, with the base's
  identity and a hash of its weights; applied onto the same base it rebuilds the thresholded model bitwise. Kept
  positions are flat int32 indices when fewer than 1/32 of a tensor's entries are kept, else a packed bit mask
  (1 bit per entry), whichever is smaller; values keep the wider of the base's and the tuned parameter's dtype
  (exactness: a float32 θ trained over a bfloat16 base with `ESConfig.bf16` stays float32 where the delta applies).

Tensors are dicts name → tensor, e.g. `dict(model.named_parameters())` (tied weights appear once).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ..es.weights import weights_hash


FORMAT = "trl-es-sparse-delta/1"
DELTA_FILE = "sparse_delta.safetensors"
"""The delta's file name in a saved model's directory (`write_model_delta`)."""

MASTER_OVER_HALF = {(torch.float32, torch.bfloat16), (torch.float32, torch.float16)}
"""(values, base) dtypes a delta may pair besides equal ones: a float32 θ trained over a half-precision base."""


def check_same_architecture(base: Mapping[str, torch.Tensor], tuned: Mapping[str, torch.Tensor]) -> None:
    """Raise ValueError naming the first difference in parameter names or shapes (a different vocabulary shows as
    a different embedding shape)."""
    missing, extra = sorted(set(base) - set(tuned)), sorted(set(tuned) - set(base))
    if missing or extra:
        raise ValueError(
            f"the models have different parameters: only in base {missing[:5]}, only in tuned {extra[:5]}"
        )
    for name, tensor in base.items():
        if tensor.shape != tuned[name].shape:
            raise ValueError(
                f"parameter {name!r} has shape {tuple(tensor.shape)} in base and {tuple(tuned[name].shape)} in tuned "
                "(different architecture or vocabulary)"
            )


def weight_delta(base: Mapping[str, torch.Tensor], tuned: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Δ = tuned − base per tensor, in float32."""
    check_same_architecture(base, tuned)
    return {name: tuned[name].detach().float() - tensor.detach().float() for name, tensor in base.items()}


def update_statistics(
    base: Mapping[str, torch.Tensor], tuned: Mapping[str, torch.Tensor], taus: list[float] = (1e-3, 1.5e-3, 2e-3)
) -> dict:
    """Relative L2 ‖Δ‖/‖θ_base‖, nonzero count and share, s_τ for each τ: for the whole model and per tensor."""
    delta = weight_delta(base, tuned)
    rows, totals = {}, {"numel": 0, "nonzero": 0, "delta_sq": 0.0, "base_sq": 0.0, **dict.fromkeys(taus, 0)}
    for name, d in delta.items():
        magnitude = d.abs()
        nonzero = magnitude > 0
        row = {
            "numel": d.numel(),
            "nonzero": int(nonzero.sum()),
            "delta_sq": float(d.double().square().sum()),
            "base_sq": float(base[name].detach().double().square().sum()),
        }
        for tau in taus:
            row[tau] = int((nonzero & (magnitude <= tau)).sum())
        for key in totals:
            totals[key] += row[key]
        rows[name] = row
    return {"total": _summarize(totals, taus), "per_tensor": {name: _summarize(r, taus) for name, r in rows.items()}}


def _summarize(counts: dict, taus) -> dict:
    nonzero = counts["nonzero"]
    return {
        "numel": counts["numel"],
        "nonzero": nonzero,
        "nonzero_share": nonzero / counts["numel"] if counts["numel"] else 0.0,
        "relative_l2": math.sqrt(counts["delta_sq"] / counts["base_sq"]) if counts["base_sq"] else math.inf,
        "s_tau": {tau: counts[tau] / nonzero if nonzero else 0.0 for tau in taus},
    }


def threshold_masks(
    base: Mapping[str, torch.Tensor],
    tuned: Mapping[str, torch.Tensor],
    tau: float | None = None,
    top_fraction: float | None = None,
) -> dict[str, torch.Tensor]:
    """Boolean masks of the entries kept: |Δ| > τ, or the `top_fraction` of all entries with the largest |Δ|
    (ties at the cut-off kept). Exactly one of `tau` and `top_fraction`."""
    if (tau is None) == (top_fraction is None):
        raise ValueError("give exactly one of tau (keep |Δ| > tau) and top_fraction (keep the largest |Δ|)")
    if tau is not None and not tau >= 0:
        raise ValueError(f"tau must be >= 0, got {tau}")
    if top_fraction is not None and not 0 < top_fraction <= 1:
        raise ValueError(f"top_fraction must be in (0, 1], got {top_fraction}")
    magnitudes = {name: d.abs() for name, d in weight_delta(base, tuned).items()}
    if top_fraction is not None:
        everything = torch.cat([m.flatten() for m in magnitudes.values()])
        k = max(1, math.ceil(top_fraction * everything.numel()))
        cut = torch.topk(everything, k).values[-1].item()
        return {name: (m >= cut) & (m > 0) for name, m in magnitudes.items()}
    return {name: m > tau for name, m in magnitudes.items()}


def thresholded(
    base: Mapping[str, torch.Tensor], tuned: Mapping[str, torch.Tensor], masks: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """θ_tuned where the mask is set, θ_base elsewhere (each tensor in the base's dtype)."""
    return {name: torch.where(masks[name], tuned[name].detach().to(t.dtype), t.detach()) for name, t in base.items()}


def save_delta(
    path: str,
    base: Mapping[str, torch.Tensor],
    tuned: Mapping[str, torch.Tensor],
    masks: Mapping[str, torch.Tensor],
    base_model: str = "",
    base_revision: str = "",
    tau: float | None = None,
    top_fraction: float | None = None,
) -> dict:
    """Write the kept entries (their positions and θ_tuned's values, per tensor) to a safetensors file; written
    to a temporary name and renamed, so an existing file is never left half-written. Returns the metadata."""
    tensors, kept = {}, 0
    for name, mask in masks.items():
        flat = mask.flatten().cpu()
        count = int(flat.sum())
        if not count:
            continue
        if count * 32 < flat.numel():  # 32 bits per kept entry beat 1 bit per entry
            index_dtype = torch.int32 if flat.numel() < 2**31 else torch.int64
            tensors[f"{name}.indices"] = flat.nonzero().flatten().to(index_dtype)
        else:
            tensors[f"{name}.mask"] = torch.from_numpy(np.packbits(flat.numpy()))
        dtype = torch.promote_types(base[name].dtype, tuned[name].dtype)
        tensors[f"{name}.values"] = tuned[name].detach().flatten().cpu()[flat].to(dtype).contiguous()
        kept += count
    total = sum(t.numel() for t in base.values())
    metadata = {
        "format": FORMAT,
        "base_model": base_model,
        "base_revision": base_revision,
        "base_hash": weights_hash(base),
        "tau": "" if tau is None else repr(tau),
        "top_fraction": "" if top_fraction is None else repr(top_fraction),
        "kept": str(kept),
        "sparsity": repr(1 - kept / total),
        "shapes": json.dumps({name: list(t.shape) for name, t in base.items()}),
    }
    partial = f"{path}.partial"
    save_file(tensors, partial, metadata=metadata)
    os.replace(partial, path)
    return metadata


def load_delta(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, metadata) of a delta file; a clear ValueError when the file is missing, corrupt or not a delta."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"sparse delta file {path!r} does not exist")
    try:
        with safe_open(path, "pt") as f:
            metadata = f.metadata() or {}
        tensors = load_file(path)
    except (SafetensorError, OSError) as error:
        raise ValueError(f"sparse delta file {path!r} is corrupt or truncated: {error}") from error
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{path!r} is not a trl-es sparse delta (format {metadata.get('format')!r})")
    return tensors, metadata


METADATA_KEYS = (
    "format",
    "base_model",
    "base_revision",
    "base_hash",
    "tau",
    "top_fraction",
    "kept",
    "sparsity",
    "shapes",
)


def apply_delta(base: Mapping[str, torch.Tensor], path: str, force: bool = False) -> dict[str, torch.Tensor]:
    """The thresholded model: a copy of `base` with the delta's entries written in (a half-precision tensor given
    float32 values becomes float32). Every field of the file is checked against the base before anything is written
    (`delta_entries`); a delta made from other base weights (hash mismatch) is refused unless `force`."""
    tensors, metadata = load_delta(path)
    entries = delta_entries(tensors, metadata, base, path)
    if not force and metadata["base_hash"] != weights_hash(base):
        raise ValueError(
            f"the delta {path!r} was made from other base weights ({metadata['base_model'] or 'unnamed base'}, hash "
            f"{metadata['base_hash'][:12]}…, this base {weights_hash(base)[:12]}…); pass force=True to apply it "
            "anyway"
        )
    result = {name: t.detach().clone() for name, t in base.items()}
    for name, (positions, values) in entries.items():
        target = result[name] = result[name].to(values.dtype)
        target.view(-1)[positions.to(target.device)] = values.to(target.device)
    return result


def delta_entries(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str], base: Mapping[str, torch.Tensor], path: str
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{parameter: (flat positions, values)} of a delta, each field checked against `base`: the metadata keys and
    shapes, every tensor's name, positions (integers in range, no duplicates; a mask of the parameter's length), as
    many values as positions, in the parameter's dtype (or float32 over a half-precision one), finite. A ValueError
    names the first problem."""
    missing = [key for key in METADATA_KEYS if key not in metadata]
    try:
        shapes = json.loads(metadata["shapes"]) if not missing else None
        kept = int(metadata["kept"]) if not missing else None
    except (ValueError, TypeError) as error:
        raise ValueError(f"the delta {path!r} has unreadable metadata: {error}") from error
    if missing:
        raise ValueError(f"the delta {path!r} lacks metadata {missing}")
    if shapes != {name: list(t.shape) for name, t in base.items()}:
        raise ValueError(f"the delta {path!r} was made for a model with other parameters or shapes than this base")
    for key in tensors:
        name, _, kind = key.rpartition(".")
        if name not in base or kind not in ("indices", "mask", "values"):
            raise ValueError(f"the delta {path!r} holds {key!r}, which names no parameter of this base")
    entries = {}
    for name, target in base.items():
        kinds = [kind for kind in ("indices", "mask", "values") if f"{name}.{kind}" in tensors]
        if not kinds:
            continue
        if kinds not in (["indices", "values"], ["mask", "values"]):
            raise ValueError(f"the delta {path!r} has {kinds} for {name!r}: it needs values and indices or a mask")
        positions = _positions(tensors, name, target.numel(), path)
        values = tensors[f"{name}.values"]
        if values.dim() != 1 or values.numel() != positions.numel():
            raise ValueError(
                f"the delta {path!r} has {values.numel()} values of {name!r} for {positions.numel()} entries"
            )
        if values.dtype != target.dtype and (values.dtype, target.dtype) not in MASTER_OVER_HALF:
            raise ValueError(f"the delta {path!r} has values of {name!r} in dtype {values.dtype}, not {target.dtype}")
        if not torch.isfinite(values).all():
            raise ValueError(f"the delta {path!r} has values of {name!r} that are not finite")
        entries[name] = (positions, values)
    if sum(positions.numel() for positions, _ in entries.values()) != kept:
        raise ValueError(f"the delta {path!r} says it kept {kept} entries but holds another number")
    return entries


def _positions(tensors: Mapping[str, torch.Tensor], name: str, numel: int, path: str) -> torch.Tensor:
    """The checked flat positions of parameter `name`'s kept entries."""
    if f"{name}.mask" in tensors:
        mask = tensors[f"{name}.mask"]
        if mask.dtype != torch.uint8 or mask.dim() != 1 or mask.numel() != (numel + 7) // 8:
            raise ValueError(f"the delta {path!r} has a mask of {name!r} that does not fit its {numel} entries")
        return torch.from_numpy(np.unpackbits(mask.numpy(), count=numel).astype(bool)).nonzero().flatten()
    indices = tensors[f"{name}.indices"]
    if indices.dtype not in (torch.int32, torch.int64) or indices.dim() != 1:
        raise ValueError(f"the delta {path!r} has indices of {name!r} that are not a list of integers")
    positions = indices.long()
    if positions.numel() and (positions.min() < 0 or positions.max() >= numel):
        raise ValueError(f"the delta {path!r} has indices of {name!r} outside 0..{numel - 1}")
    if positions.unique().numel() != positions.numel():
        raise ValueError(f"the delta {path!r} has duplicate indices of {name!r}")
    return positions


def write_model_delta(model, output_dir: str, tau: float) -> dict[str, str] | None:
    """Write `output_dir/sparse_delta.safetensors` for a trained `model` (|θ − θ_start| > τ, θ_start reloaded from
    the model's own path in its stored dtype, as `trl-es apply-delta` loads it) and return its statistics for the model card; None, with a warning, when the starting
    weights cannot be loaded."""
    import warnings

    from trl.trainer.utils import get_config_model_id

    base_path = get_config_model_id(model.config)
    try:
        base_model = type(model).from_pretrained(base_path, dtype="auto")
    except OSError as error:
        warnings.warn(f"No sparse delta written: cannot load the starting weights at {base_path!r} ({error}).")
        return None
    base, tuned = dict(base_model.named_parameters()), dict(model.named_parameters())
    path = os.path.join(output_dir, DELTA_FILE)
    metadata = save_delta(path, base, tuned, threshold_masks(base, tuned, tau=tau), base_model=base_path, tau=tau)
    total = update_statistics(base, tuned, [tau])["total"]
    return {
        "sparse delta": f"{DELTA_FILE}, τ = {tau}",
        "entries kept": f"{int(metadata['kept'])} (sparsity {float(metadata['sparsity']):.4%})",
        "delta file size": f"{os.path.getsize(path) / 2**20:.2f} MiB",
        "relative L2 ‖Δ‖/‖θ_start‖": f"{total['relative_l2']:.4g}",
        "nonzero updates": f"{total['nonzero_share']:.2%}",
        f"s_τ (share of nonzero |Δ| ≤ {tau})": f"{total['s_tau'][tau]:.2%}",
    }
