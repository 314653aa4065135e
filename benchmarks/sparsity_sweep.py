"""Held-out accuracy of magnitude-thresholded ES updates, and the size of their sparse deltas.

    python benchmarks/sparsity_sweep.py --tuned outputs/demo [--base smollm2] [--taus 1e-3,1.5e-3,2e-3] [--top 0.01]

For the built-in small-sums task (the demo's held-out 64 problems, greedy, 12 new tokens): the base, the tuned
model, and for each τ (and each top fraction) the thresholded model θ_base + [|Δ| > τ]·Δ, with the entries kept and
the `trl_es.sparse` delta file's size against the full weights. Other tasks wait for the evaluation API (Pass@K).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tuned", required=True)
    parser.add_argument("--base", default="smollm2")
    parser.add_argument("--taus", default="1e-3,1.5e-3,2e-3")
    parser.add_argument("--top", default="0.01", help="top fractions of entries to keep, comma separated")
    options = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from trl_es import ESConfig, ESTrainer
    from trl_es.demo import held_out_accuracy
    from trl_es.models import smollm2_dir
    from trl_es.sparse import save_delta, threshold_masks, thresholded
    from trl_es.tasks import first_integer_reward, small_sums

    base_dir = smollm2_dir() if options.base == "smollm2" else options.base
    base = dict(AutoModelForCausalLM.from_pretrained(base_dir).named_parameters())
    tuned = dict(AutoModelForCausalLM.from_pretrained(options.tuned).named_parameters())
    args = ESConfig(output_dir=tempfile.mkdtemp(), max_completion_length=12, generation_kwargs={"do_sample": False},
                    report_to="none")
    trainer = ESTrainer(base_dir, first_integer_reward, args=args, train_dataset=small_sums("train"))
    held_out, full = small_sums("test"), sum(t.numel() * t.element_size() for t in base.values())
    params = dict(trainer.model.named_parameters())

    def accuracy(weights) -> float:
        with torch.no_grad():
            for name, tensor in weights.items():
                params[name].copy_(tensor)
        return held_out_accuracy(trainer, held_out)

    print(f"{'model':24} {'kept':>8} {'delta MiB':>10} {'/ full':>7} {'held-out':>9}")
    print(f"{'base':24} {'':>8} {'':>10} {'':>7} {accuracy(base):9.3f}")
    print(f"{'tuned':24} {'100%':>8} {'':>10} {'':>7} {accuracy(tuned):9.3f}")
    settings = [("tau", float(t)) for t in options.taus.split(",") if t] + [
        ("top_fraction", float(f)) for f in options.top.split(",") if f
    ]
    with tempfile.TemporaryDirectory() as scratch:
        for key, value in settings:
            masks = threshold_masks(base, tuned, **{key: value})
            path = os.path.join(scratch, "delta.safetensors")
            metadata = save_delta(path, base, tuned, masks, **{key: value})
            size = os.path.getsize(path)
            kept = 1 - float(metadata["sparsity"])
            score = accuracy(thresholded(base, tuned, masks))
            print(f"{f'{key} {value:g}':24} {kept:8.2%} {size / 2**20:10.1f} {size / full:7.2f} {score:9.3f}")


if __name__ == "__main__":
    main()
