"""Agent episodes of growing length: peak memory of an ES step next to a TRL GRPOTrainer step (SmolLM2-135M, CPU).

    python benchmarks/agent_memory.py [--history 64,256,1024] [--answer 16]

The same episodes for both trainers, through the `rollout_func` both take: a conversational prompt, the model's
tool call, a tool result of `history` tokens (environment tokens, `env_mask` 0), then the model's answer generated
greedily after all of it (`answer` tokens). GRPOTrainer then computes log-probabilities over the whole episode and
back-propagates through it (AdamW, its default); ES only generates, for each of its members. Both steps see 4
episodes per policy: GRPO 4 prompts × 1, ES 4 members × 2 prompts × 2 generations.

Each measurement runs in a fresh process; the peak RSS is sampled during the step only (model loading excluded);
"above base" subtracts the RSS just before it. Prints one table with the ES / GRPO ratio of each length. The CoPES
research reports the same effect at scale: ES post-training an agent at 128K context on one 24 GB GPU, where
full-parameter GRPO needs 8 × 48 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


sys.path.insert(0, os.path.dirname(__file__))
from step_memory_time import PeakRSS  # noqa: E402


CALL = '<tool_call>\n{"name": "read_log", "arguments": {}}\n</tool_call><|im_end|>\n'


def episodes_rollout(history: int, answer: int):
    """A `rollout_func` playing the benchmark's episodes with `trainer.model` (the member, for ES)."""
    import torch

    def rollout(prompts, trainer):
        tokenizer, model = trainer.processing_class, trainer.model
        prompt_ids = [
            tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
            for p in prompts
        ]
        call = tokenizer(CALL, add_special_tokens=False)["input_ids"]
        result = tokenizer("<|im_start|>user\n<tool_response>\n", add_special_tokens=False)["input_ids"]
        result += [tokenizer.convert_tokens_to_ids("Ġlog")] * history + tokenizer(
            "\n</tool_response><|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
        )["input_ids"]
        inputs = torch.tensor([ids + call + result for ids in prompt_ids])  # the same length: no padding
        was_training = model.training
        model.eval()
        with torch.no_grad():
            out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=answer,
                                 min_new_tokens=answer, do_sample=False)  # fmt: skip
        model.train(was_training)
        answers = out[:, inputs.shape[1] :].tolist()
        completions = [call + result + a for a in answers]
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completions,
            "logprobs": [[0.0] * len(c) for c in completions],
            "env_mask": [[1] * len(call) + [0] * len(result) + [1] * len(a) for a in answers],
        }

    return rollout


def length_reward(completion_ids, **kwargs):
    return [float(sum(ids) % 7) for ids in completion_ids]  # any spread will do: only memory is measured


def dataset(n: int):
    from datasets import Dataset

    return Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"Read the log and count entry {k}."}] for k in range(n)]}
    )


def run(method: str, history: int, answer: int) -> dict:
    import torch

    from trl_es.util.models import smollm2_dir

    torch.manual_seed(0)
    common = dict(output_dir=f"/tmp/agent-memory-{method}", max_steps=1, report_to="none", save_strategy="no",
                  disable_tqdm=True, max_completion_length=history + answer + 64)  # fmt: skip
    rollout = episodes_rollout(history, answer)
    if method == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        args = GRPOConfig(**common, per_device_train_batch_size=4, num_generations=4, bf16=False, learning_rate=1e-6)
        trainer = GRPOTrainer(smollm2_dir(), length_reward, args=args, train_dataset=dataset(4), rollout_func=rollout)
    else:
        from trl_es import ESConfig, ESTrainer

        args = ESConfig(**common, population_size=4, per_device_train_batch_size=2, num_generations=2)
        trainer = ESTrainer(smollm2_dir(), length_reward, args=args, train_dataset=dataset(2), rollout_func=rollout)
    with PeakRSS() as rss:
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "above_base": rss.peak - rss.base, "peak": rss.peak}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--history", default="64,256,1024", help="tool-result tokens per episode")
    parser.add_argument("--answer", type=int, default=16, help="tokens the model generates after the tool result")
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "HISTORY"), help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        method, history = options.worker
        print("RESULT " + json.dumps(run(method, int(history), options.answer)))
        return
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"}
    rows = []
    for history in map(int, options.history.split(",")):
        results = {}
        for method in ("es", "grpo"):
            command = [sys.executable, __file__, "--worker", method, str(history), "--answer", str(options.answer)]
            process = subprocess.run(command, capture_output=True, text=True, env=env)
            line = next((ln for ln in process.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"{method} at {history} tokens failed:\n{process.stderr[-3000:]}")
            results[method] = json.loads(line.removeprefix("RESULT "))
        rows.append((history, results))
        es, grpo = results["es"], results["grpo"]
        print(f"history {history:5d}: ES {es['above_base'] / 2**30:.2f} GiB above base ({es['seconds']:.1f} s), "
              f"GRPO {grpo['above_base'] / 2**30:.2f} GiB ({grpo['seconds']:.1f} s), "
              f"ES/GRPO {es['above_base'] / grpo['above_base']:.2f}", flush=True)  # fmt: skip
    print("\n| history tokens | ES step peak above base | GRPO step peak above base | ES / GRPO | ES s | GRPO s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for history, results in rows:
        es, grpo = results["es"], results["grpo"]
        print(
            f"| {history} | {es['above_base'] / 2**30:.2f} GiB | {grpo['above_base'] / 2**30:.2f} GiB | "
            f"{es['above_base'] / grpo['above_base']:.2f} | {es['seconds']:.1f} | {grpo['seconds']:.1f} |"
        )


if __name__ == "__main__":
    main()
