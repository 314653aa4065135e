"""The ES worker extension for vLLM: members are written into vLLM's weights from their seeds, inside the worker.

vLLM mixes this class into its worker (`worker_extension_cls`) and the trainer reaches it through
`collective_rpc` (in process in colocate mode, over `POST /collective_rpc` of `vllm serve` in server mode, where
arguments travel as JSON strings). Every tensor-parallel worker runs the same call.

The worker keeps θ under the trainer's (Hugging Face) parameter names in a `LocalWeights`, the trainer's own weights
backend, and builds every member with it, so the weights a member sends into vLLM are bitwise the HF path's
perturbed parameters. They go into vLLM through its weight-loading path,
which maps HF names onto fused parameters (qkv_proj, gate_up_proj) and tensor-parallel shards:

- on GPU (the fast path), `model.load_weights` of the changed tensors copies them into the parameters in place;
- on CPU, vLLM repacks every linear layer into oneDNN/SGL handles after loading and empties `.weight`, so in-place
  writes would change nothing: the whole model goes through `reload_weights` (which re-runs that repacking), and
  the handles of tied heads, which reloading misses (vLLM 0.32: the head still multiplies by the old embedding), are
  rebuilt.

The trainer resets vLLM's prefix cache after each call that changes weights.
"""

from __future__ import annotations

import glob
import json
import os

import torch

from ..es.weights import LocalWeights, weights_fingerprint


class ESWorkerExtension:
    """Methods that vLLM's worker gains, each taking its arguments as one JSON string (what vLLM's HTTP
    `/collective_rpc` passes). `es_init` first; then `es_perturb`, `es_restore`, `es_update`."""

    def es_init(self, payload: str, weights: list[tuple[str, torch.Tensor]] | None = None) -> dict:
        """Take θ, write it into vLLM and build the noise table. `payload`: {"seed", "noise_table_size", "dtype",
        "names", "path"} — the run's seed and table size (the trainer's), the dtype of the trainer's parameters, the
        names ES perturbs, and optionally a directory of safetensors (a checkpoint to resume from). θ comes from
        `weights` (colocate: the trainer's own tensors), else `path`, else the served model's files through vLLM's
        loader. Returns {"fingerprint"} of θ over `names`, or {"error"} when a name is not among the weights."""
        args = json.loads(payload)
        model = self.model_runner.model
        device = next(model.parameters()).device
        self._es_repacked = device.type == "cpu"
        if weights is None and args.get("path"):
            from safetensors.torch import load_file

            files = sorted(glob.glob(os.path.join(args["path"], "*.safetensors")))
            if not files:
                return {"error": f"no *.safetensors weights in {args['path']}"}
            weights = [item for file in files for item in load_file(file).items()]
        elif weights is None:
            from vllm.model_executor.model_loader import get_model_loader

            loader = get_model_loader(self.vllm_config.load_config)
            weights = loader.get_all_weights(self.vllm_config.model_config, model)
        dtype = getattr(torch, args["dtype"])
        # The working tensors live where vLLM's weights do; θ stays on the host (LocalWeights' exact copy).
        working = {name: tensor.detach().to(device, dtype, copy=True).contiguous() for name, tensor in weights}
        missing = [name for name in args["names"] if name not in working]
        if missing:
            return {"error": f"the served model has no weights named {missing[:3]} (it has {list(working)[:3]}…)"}
        self._es_names = list(args["names"])
        self._es_weights = LocalWeights(working, args["seed"], args["noise_table_size"], storage_device="cpu")
        self._es_weights.capture()
        self._es_push(set(working))  # vLLM may hold other weights (an earlier run's, on a server)
        return {"fingerprint": weights_fingerprint(working, self._es_names)}

    def es_perturb(self, payload: str) -> None:
        """vLLM's weights ← θ + scale·ε(seed) over `names` (default: all ES names), θ elsewhere."""
        args = json.loads(payload)
        names = args.get("names") or self._es_names
        self._es_push(self._es_weights.member(args["seed"], args["scale"], names))

    def es_restore(self, payload: str) -> None:
        """vLLM's weights ← θ."""
        written = self._es_weights.center()
        if written:
            self._es_push(written)

    def es_update(self, payload: str) -> dict:
        """θ ← θ + Σ_s c_s ε(s) − decay·θ over `names` (default: all ES names), with the trainer's arithmetic (the
        same bits); vLLM then holds the new θ. `coefficients`: [[seed, c_s], ...].
        Returns {"update_norm": ‖Δθ‖₂} for the trainer to check against its own update."""
        args = json.loads(payload)
        names = args.get("names") or self._es_names
        weights = self._es_weights
        written = weights.center() | set(names)
        coefficients = {int(seed): float(c) for seed, c in args["coefficients"]}
        norm = weights.update(coefficients, decay=args.get("decay", 0.0), names=names)
        weights.capture(names)
        self._es_push(written)
        return {"update_norm": norm}

    def es_fingerprint(self, payload: str) -> dict:
        """{"fingerprint"} over the ES names of the weights vLLM holds now (θ, or the member's)."""
        return {"fingerprint": weights_fingerprint(self._es_weights.params, self._es_names)}

    @torch.no_grad()
    def _es_push(self, names: set[str]) -> None:
        """Write the working tensors `names` into vLLM's weights (module docstring: in place on GPU, a whole reload
        with repacking on CPU)."""
        model, working = self.model_runner.model, self._es_weights.params
        if not self._es_repacked:
            model.load_weights([(name, working[name]) for name in names])
            return
        self.model_runner.reload_weights(weights_iterator=iter(working.items()), is_checkpoint_format=True)
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        for module in model.modules():  # layers that keep `.weight` (embeddings, tied heads) and pack it
            weight = getattr(module, "weight", None)
            if hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor) and weight.numel():
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)
