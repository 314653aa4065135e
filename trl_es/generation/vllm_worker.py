"""The ES worker extension for vLLM: members are written into vLLM's weights from their seeds, inside the worker.

vLLM mixes this class into its worker (`worker_extension_cls`) and the trainer reaches it through
`collective_rpc` (in process in colocate mode, over `POST /collective_rpc` of `vllm serve` in server mode, where
arguments travel as JSON strings). Every tensor-parallel worker runs the same call.

The worker keeps θ under the trainer's (Hugging Face) parameter names in a `LocalWeights`, the trainer's own weights
backend, and builds every member with it, so a member's weights are bitwise the HF path's perturbed parameters.
Where it can, the worker's tensors *are* vLLM's weights: each HF tensor is a view of the rows of vLLM's parameter
that hold it (q_proj is the first rows of the fused qkv_proj, gate_proj the first half of gate_up_proj), found by
name through vLLM's `packed_modules_mapping` and checked bitwise at `es_init`. A member is then written into vLLM
in place, with no copy and no reload:

- on GPU nothing more is needed;
- on CPU vLLM multiplies by packed copies of its linear weights (oneDNN handles) and would empty `.weight`: the
  worker has it keep them (`_cpu_skip_gemm_dispatch` while loading θ once), and after each write re-packs the
  handles of the layers whose weights changed (`dispatch_cpu_unquantized_gemm`, vLLM's own packing).

A mixture of experts' fused tensors (transformers' `mlp.experts.gate_up_proj` and `down_proj`) are vLLM's fused-MoE
`w13_weight` and `w2_weight`, in the same layout (`EXPERT_TENSORS`): views of them under Triton's kernel; under
vLLM's CPU kernel, which multiplies by a packed copy, the worker keeps its own tensors and packs each write into
vLLM's packed ones in place (`_pack_experts`). Other MoE kernels are refused (`MOE_KERNELS`).

Where the views cannot be formed (a tensor-parallel shard, a model whose weights vLLM transforms on loading) the
worker keeps separate tensors and sends each write through vLLM's loading path: `load_weights` of the changed
tensors on GPU, a whole-model `reload_weights` plus re-packing on CPU (slow: ~1 s per member for 135M).

Low-rank members (`es_search_space="lowrank"`) are never written into the weights: the engine runs with LoRA
enabled, one adapter slot per member of a generate call, and `es_lowrank_members` writes member m's factors into
its slot in place (vLLM's `lora_a_stacked` ← Bᵀ, `lora_b_stacked` ← σ·sign/√r·A: the adapter's B·A is the member's
σ·sign·A·Bᵀ/√r), so one generate call carries all of them, each request routed to its member's adapter. The
adapters are zero-initialised placeholders registered once (`es_lowrank_init`), pinned, and never loaded from files.

Adapter mode (ES trains a LoRA adapter, `es_adapter_init`): the worker's tensors are the adapter's A and B weights,
the base holds the trainer's base weights (loaded once), and what a full model's tensors are written into goes into
LoRA slots instead — slot 0 holds the evaluated adapter (θ, or `es_perturb`'s member), slots 1.. the members of one
call (`es_adapter_members`), each A + scale·ε_A and scaling·(B + scale·ε_B) built with the trainer's `LocalWeights`.

With a float32 θ over a bfloat16 or float16 engine (mixed precision), the worker keeps θ as a float32 master on the
host; vLLM's tensors hold its cast (`LocalWeights(master=...)`).

The trainer resets vLLM's prefix cache after each call that changes weights or adapters.
"""

from __future__ import annotations

import ctypes
import glob
import os

import torch

from ..es.lowrank import apply_lowrank_update
from ..es.weights import LocalWeights, weights_hash
from .vllm_payload import parse_payload
from .vllm_shards import EXPERT_TENSORS, MOE_KERNELS, expert_region, pack_experts, shard_region
from .vllm_worker_lora import LoRASlots
from .vllm_worker_state import AdapterState, FullState


M_MMAP_THRESHOLD = -3
"""glibc's `mallopt` parameter: the size from which `malloc` maps a block of its own (returned to the system on free)."""


def _reuse_freed_memory() -> None:
    """Have glibc's malloc keep blocks of up to 2 GiB in its heap when freed. By default it unmaps every large block
    on free, so each member's re-packed weights (the model's size, allocated as the previous member's are freed)
    would be faulted into fresh pages again: re-packing 135M parameters took 0.35–0.5 s per member that way, 0.13 s
    with this."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "mallopt"):
        libc.mallopt(M_MMAP_THRESHOLD, 2**31 - 1)


class ESWorkerExtension(LoRASlots):
    """Methods that vLLM's worker gains, each taking its arguments as one JSON string (what vLLM's HTTP
    `/collective_rpc` passes). `es_init` (or `es_adapter_init`) first, which sets the run's state (`_es`: a
    `FullState` or an `AdapterState`); then `es_perturb`, `es_restore`, `es_update`."""

    _es: FullState | AdapterState

    def es_extension(self, payload: str) -> dict:
        """{"extension": "trl-es"}: this vLLM runs the ES worker extension (a server started by `trl-es vllm-serve`)."""
        return {"extension": "trl-es"}

    def es_init(self, payload: str, weights: list[tuple[str, torch.Tensor]] | None = None) -> dict:
        """Take θ, write it into vLLM and build the noise table. `payload`: {"seed", "noise_table_size", "dtype",
        "names", "path"} — the run's seed and table size (the trainer's), the dtype of the trainer's parameters, the
        names ES perturbs, and optionally a directory of safetensors (a checkpoint to resume from). θ comes from
        `weights` (colocate: the trainer's own tensors), else `path`, else the served model's files through vLLM's
        loader. Returns {"fingerprint"} of θ over `names` and {"in_place"}: whether members are written into vLLM's
        weights directly (module docstring), or {"error"} when a name is not among the weights."""
        args = parse_payload(payload, "seed", "noise_table_size", "dtype", "names")
        if args["names"] is None:
            raise ValueError("es_init needs the names of the parameters ES perturbs")
        model = self.model_runner.model
        device = next(model.parameters()).device
        weights = self._es_theta(weights, args.get("path"))
        if isinstance(weights, str):
            return {"error": weights}
        dtype = getattr(torch, args["dtype"])
        names, engine_dtype = set(args["names"]), self.vllm_config.model_config.dtype
        missing = sorted(names - {name for name, _ in weights})
        if missing:
            return {"error": f"the served model has no weights named {missing[:3]} (it has {weights[0][0]!r}…)"}
        # θ in its own dtype on the host (the exact copy); vLLM computes with its cast when the engine is narrower
        # (bf16/fp16: a float32 master, each member cast from θ + σ·ε computed in float32)
        master = None
        if engine_dtype != dtype:
            master = {name: tensor.detach().to("cpu", dtype, copy=True) for name, tensor in weights if name in names}
        # The working tensors live where vLLM's weights do, in its dtype.
        working = {name: tensor.detach().to(device, engine_dtype, copy=True).contiguous() for name, tensor in weights}
        table = (args["seed"], args["noise_table_size"])
        state = FullState(LocalWeights(working, *table, storage_device="cpu", master=master), list(args["names"]),
                          repacked=device.type == "cpu")  # fmt: skip
        error = self._es_find_experts(model, set(working), state)
        if error:
            return {"error": error}
        if state.repacked:
            self._es_keep_cpu_weights(model)
        self._es = state
        self._es_push(set(working))  # vLLM may hold other weights (an earlier run's, on a server)
        found, regions = self._es_find_views(model, working), {}
        if found:
            views, regions = found
            if master is not None:  # each rank's float32 θ is the region its tensors hold
                master = {name: regions[name].cut(t).clone() if name in regions else t for name, t in master.items()}
            state.weights = LocalWeights(views, *table, storage_device="cpu", master=master, regions=regions)
            state.in_place = True
            if state.repacked:
                _reuse_freed_memory()
        state.weights.capture()
        return {
            "fingerprint": self._es_fingerprint_theta(),
            "in_place": state.in_place,
            "regions": {name: region.to_json() for name, region in regions.items()},
        }

    def _es_theta(self, weights: list[tuple[str, torch.Tensor]] | None, path: str | None) -> list | str:
        """θ by name: `weights` (the trainer's tensors), else the safetensors files in `path` (a checkpoint), else
        the served model's files through vLLM's loader; or an error."""
        if weights is None and path:
            from safetensors.torch import load_file

            files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
            if not files:
                return f"no *.safetensors weights in {path}"
            weights = [item for file in files for item in load_file(file).items()]
        elif weights is None:
            from vllm.model_executor.model_loader import get_model_loader

            loader = get_model_loader(self.vllm_config.load_config)
            weights = loader.get_all_weights(self.vllm_config.model_config, self.model_runner.model)
        return list(weights)

    @staticmethod
    def _es_keep_cpu_weights(model) -> None:
        """Make vLLM's CPU linear layers keep their unpacked `.weight` (full size again) through the next load, so
        that members can be written into it; their packed handles are made from it (`_es_push`)."""
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if not hasattr(module, "cpu_linear") or not isinstance(weight, torch.Tensor):
                continue
            if not weight.numel() and hasattr(module, "output_partition_sizes"):
                columns = getattr(module, "input_size_per_partition", module.input_size)  # replicated: a MoE's router
                shape = (sum(module.output_partition_sizes), columns)
                weight.data = torch.empty(shape, dtype=weight.dtype, device=weight.device)
            module._cpu_skip_gemm_dispatch = True

    @staticmethod
    def _es_find_experts(model, names: set[str], state: FullState) -> str | None:
        """Record vLLM's fused-MoE layers by the transformers name of their experts module (`state.moe`), and which
        of the transformers tensors `names` vLLM's CPU kernel multiplies by a packed copy of (`state.packed_experts`:
        name -> (the packed parameter, the ISA it is packed for)); or say why members could not be written into the
        experts (`MOE_KERNELS`)."""
        for name, layer in model.named_modules():
            if not isinstance(getattr(layer, "w13_weight", None), torch.Tensor):
                continue
            method = getattr(layer, "quant_method", None)
            backend = getattr(method, "unquantized_backend", None)
            if backend is None or backend.name not in MOE_KERNELS:
                kernel = f"{backend.value} MoE kernel" if backend else f"{type(method).__name__} (quantized experts)"
                return (
                    f"{name} runs vLLM's {kernel}, which holds the experts in its own layout: ES writes members into "
                    "the experts of vLLM's Triton (GPU) and CPU kernels only"
                )
            module = name.removesuffix(".routed_experts")
            state.moe[module] = layer
            kernel = method.moe_kernel.fused_experts
            isa = None if getattr(kernel, "_use_zentorch", False) else getattr(kernel, "isa", None)
            for leaf, param in EXPERT_TENSORS.items():
                if isa and f"{module}.{leaf}" in names:
                    state.packed_experts[f"{module}.{leaf}"] = (getattr(layer, param).data, isa)
        return None

    def _es_find_views(self, model, working: dict[str, torch.Tensor]) -> tuple[dict, dict] | None:
        """For each ES name, the part of vLLM's parameter that holds it (module docstring) and, under tensor
        parallelism, the region of the whole tensor that part is (`shard_region`, `expert_region`), when every one
        is found and equals that region of the worker's tensor bitwise; None otherwise. On CPU also records, per
        name, the layers to re-pack after it changes (the tied head shares the embedding's weight), and for the
        experts that vLLM's CPU kernel packs, the worker's own tensor (`_es_push` packs it)."""
        params = dict(model.named_parameters(remove_duplicate=False))
        fused = {
            part: (whole, parts)
            for whole, parts in getattr(model, "packed_modules_mapping", {}).items()
            for part in parts
            if whole != part
        }
        state = self._es
        packing = [m for m in model.modules() if hasattr(m, "cpu_linear")] if state.repacked else []
        views, regions = {}, {}
        for name in state.names:
            tensor = working[name]
            module, _, leaf = name.rpartition(".")
            prefix, _, part = module.rpartition(".")
            if module in state.moe and leaf in EXPERT_TENSORS:  # a fused expert tensor: the layer's w13/w2
                experts = getattr(state.moe[module], EXPERT_TENSORS[leaf])
                region = expert_region(leaf, tensor.shape, len(experts))
                if region is False:
                    return None
                held = tensor if region is None else region.cut(tensor)
                if name in state.packed_experts:  # the worker's own tensor, packed into vLLM's at each write
                    views[name], state.packed[name] = held.clone(), []
                    regions.update({name: region} if region else {})
                    continue
                param, rows = None, experts.data
            else:
                target, index = module, 0
                if part in fused:
                    whole, parts = fused[part]
                    target, index = f"{prefix}.{whole}", parts.index(part)
                if f"{target}.{leaf}" not in params:  # with LoRA enabled, vLLM wraps the layer: the base layer's
                    target = f"{target}.base_layer"
                param = params.get(f"{target}.{leaf}")
                siblings = [working.get(f"{prefix}.{sibling}.{leaf}") for sibling in fused.get(part, ("", [part]))[1]]
                if param is None or any(sibling is None for sibling in siblings):
                    return None
                layer = model.get_submodule(target)
                lengths = [len(sibling) for sibling in siblings]  # the parts' rows: whole, or each rank's share
                lengths = (
                    getattr(layer, "output_partition_sizes", lengths) if getattr(layer, "tp_size", 1) > 1 else lengths
                )
                offset = sum(lengths[:index])
                region = shard_region(layer, tensor.shape, (lengths[index], *param.shape[1:]))
                held = tensor if region is None else region.cut(tensor)
                rows = param.data.narrow(0, offset, len(held)) if offset + len(held) <= len(param) else None
            if rows is None or rows.dtype != held.dtype or rows.shape != held.shape or not torch.equal(rows, held):
                return None
            views[name] = rows
            regions.update({name: region} if region else {})
            state.packed[name] = [m for m in packing if param is not None and m.weight.data_ptr() == param.data_ptr()]
        return views, regions

    def es_perturb(self, payload: str) -> dict:
        """vLLM's weights ← θ + scale·ε(seed) over `names` (default: all ES names), θ elsewhere; {"written": how many
        tensors changed} (a few bytes back per member: the trainer knows which)."""
        args = parse_payload(payload, "seed", "scale")
        names = self._es_known(args.get("names"))
        written = self._es.weights.member(args["seed"], args["scale"], names)
        self._es_push(written)
        return {"written": len(written)}

    def es_restore(self, payload: str) -> dict:
        """vLLM's weights ← θ; {"written": how many tensors changed}."""
        written = self._es.weights.center()
        if written:
            self._es_push(written)
        return {"written": len(written)}

    def es_update(self, payload: str) -> dict:
        """θ ← θ + Σ_s c_s ε(s) − decay·θ over `names` (default: all ES names), with the trainer's arithmetic (the
        same bits); vLLM then holds the new θ. `coefficients`: [[seed, c_s], ...].
        Returns {"update_norm": ‖Δθ‖₂} for the trainer to check against its own update."""
        args = parse_payload(payload, "coefficients")
        names = self._es_known(args.get("names"))
        weights = self._es.weights
        written = weights.center() | set(names)
        coefficients = {int(seed): float(c) for seed, c in args["coefficients"]}
        if "rank" in args:  # the low-rank update W ← W + Σ_s c_s·A_s·B_sᵀ/√r, written into θ's tensors in place
            try:
                norm = self._es_whole_norm(
                    names, lambda part: self._es_lowrank_update(part, coefficients, args["rank"])
                )
            except BaseException:
                weights.snapshot.restore(names)  # a non-finite update stops half-way: θ back everywhere
                self._es_push(set(names))
                raise
        else:
            decay = args.get("decay", 0.0)
            norm = self._es_whole_norm(names, lambda part: weights.update(coefficients, decay=decay, names=part))
        weights.capture(names)
        self._es_push(written)
        return {"update_norm": norm}

    def _es_whole_norm(self, names: list[str], update) -> float:
        """‖Δθ‖₂ over the whole parameters `names`, from `update(part)` (which updates the tensors `part` held here and
        returns the norm of their update): each tensor-parallel rank's held parts are summed over vLLM's
        tensor-parallel group, a part that c ranks hold alike (a norm, a replicated key/value head) counted 1/c."""
        from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group

        size = get_tensor_model_parallel_world_size()
        if size == 1:
            return update(names)
        copies = {}
        for name in names:
            held, region = self._es.weights.params[name].numel(), self._es.weights.regions.get(name)
            copies.setdefault(size * held // (region.numel if region else held), []).append(name)
        squared = torch.tensor([sum(update(part) ** 2 / c for c, part in copies.items())], dtype=torch.float64)
        torch.distributed.all_reduce(squared, group=get_tp_group().cpu_group)
        return float(squared) ** 0.5

    def _es_lowrank_update(self, names: list[str], coefficients: dict[int, float], rank: int) -> float:
        """`apply_lowrank_update` on θ: vLLM's tensors themselves, or with a float32 master the master (each weight
        updated on vLLM's device, as the trainer updates it, then cast into vLLM's tensor)."""
        weights = self._es.weights
        regions = weights.regions
        if weights.master is None:
            return apply_lowrank_update({n: weights.params[n] for n in names}, coefficients, rank, regions)
        squared = 0.0
        for name in names:
            theta = {name: weights.master[name].to(weights.params[name].device)}
            squared += apply_lowrank_update(theta, coefficients, rank, regions) ** 2
            weights.master[name].copy_(theta[name])
        weights.snapshot.restore(names)
        return squared**0.5

    def _es_fingerprint_theta(self) -> str:
        """`weights_hash` of θ over the ES names: the float32 master when there is one, else vLLM's tensors."""
        weights = self._es.weights
        held = weights.master if weights.master is not None else weights.params
        return weights_hash({name: held[name] for name in self._es.names})

    def _es_known(self, names: list[str] | None) -> list[str]:
        """`names` (default: every ES name), each one of the ES names `es_init` took."""
        unknown = sorted(set(names or ()) - set(self._es.names))
        if unknown:
            raise ValueError(f"the ES worker holds no parameters named {unknown[:3]}")
        return names or self._es.names

    def es_fingerprint(self, payload: str) -> dict:
        """{"fingerprint"} over the ES names of the weights vLLM holds now (θ, or the member's); with a float32
        master, of θ (the master)."""
        if self._es.weights.master is not None:
            return {"fingerprint": self._es_fingerprint_theta()}
        return {"fingerprint": weights_hash({name: self._es.weights.params[name] for name in self._es.names})}

    @torch.no_grad()
    def _es_push(self, names: set[str]) -> None:
        """Make vLLM compute with the worker's tensors `names` (module docstring): with views, re-pack the CPU
        layers they feed, and the experts vLLM's CPU kernel packs into their packed tensors; otherwise copy them in
        (`load_weights` on GPU, a whole reload on CPU, then packed again). In adapter mode, write them into LoRA
        slot 0, through which generation goes outside a members call."""
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        state = self._es
        if isinstance(state, AdapterState):  # the evaluated adapter is LoRA slot 0
            self._es_write_adapter(state.slots[0])
            return
        working = state.weights.params
        if state.in_place:
            for module in {id(m): m for name in names for m in state.packed[name]}.values():
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            for name in names & state.packed_experts.keys():
                pack_experts(working[name], *state.packed_experts[name])
            return
        # on CPU a whole reload, without the packed experts: vLLM's reload would write them unpacked (and fails on
        # padded ones), the worker packs them itself
        loaded = [name for name in working if name not in state.packed_experts] if state.repacked else names
        self._es_load([(name, working[name]) for name in loaded], state.repacked)
        for name in names & state.packed_experts.keys():
            pack_experts(working[name], *state.packed_experts[name])

    @torch.no_grad()
    def _es_load(self, weights: list[tuple[str, torch.Tensor]], repacked: bool) -> None:
        """Copy `weights` (HF names) into vLLM's: `load_weights` on GPU; on CPU (`repacked`) a reload (into the linear
        layers' kept `.weight`, `_es_keep_cpu_weights`), then every linear layer re-packed."""
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        model = self.model_runner.model
        if not repacked:
            model.load_weights(weights)
            return
        self.model_runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        for module in model.modules():  # vLLM 0.32 does not re-pack layers that keep `.weight` (tied heads)
            weight = getattr(module, "weight", None)
            if hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor) and weight.numel():
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)
