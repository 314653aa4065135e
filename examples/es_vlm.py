"""TRL's examples/scripts/grpo_vlm.py with ESTrainer in place of GRPOTrainer: a vision-language model answers a
question about each prompt's image, and ES trains its language model on the rewards.

    python examples/es_vlm.py  # a tiny random Idefics3 built offline: shows the pipeline runs, learns nothing
    python examples/es_vlm.py --model_name_or_path HuggingFaceTB/SmolVLM-256M-Instruct --max_steps 20 \
        --population_size 16 --sigma 1e-3 --learning_rate 5e-4
    python examples/es_vlm.py --model_name_or_path Qwen/Qwen2.5-VL-3B-Instruct --use_peft \
        --lora_target_modules q_proj v_proj --bf16 true  # LoRA on the language model, as TRL's command

Each row is a conversation (a system prompt and a question) and an `image` column, as in TRL's script; the trainer
puts the image into the user message and shows it to every member. The dataset is made here, offline: pictures of
one grey shade, asked "Is this picture dark or light?"; `shade_reward` gives 1 for the right word, and TRL's
`think_format_reward` checks the <think> format, as TRL's script does. What changes for ES: ESConfig's fields (the
population, σ, α), the dataset (TRL's downloads lmms-lab/multimodal-open-r1-8k-verified), and vLLM (`--use_vllm`) in
colocate mode with full-rank members only (not with `--use_peft`). By default ES perturbs the language model only: the vision tower stays as it is
unless `--es_parameter_patterns` selects it (docs/vlm.md).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path


SYSTEM_PROMPT = (
    "A conversation between user and assistant. The user asks a question about a picture, and the assistant answers "
    "it. The assistant first thinks about the reasoning process and then gives the answer, the reasoning enclosed in "
    "<think></think> tags, i.e., <think>\nThis is my reasoning.\n</think>\nThis is my answer."
)
DEFAULTS = ["--output_dir", "outputs/es-vlm", "--max_steps", "2", "--population_size", "4", "--sigma", "0.02",
            "--learning_rate", "0.02", "--per_device_train_batch_size", "2", "--num_generations", "2",
            "--max_completion_length", "16", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
            "--bf16", "false"]  # fmt: skip


def shade_dataset(rows: int, seed: int = 0):
    """`rows` conversations asking whether the row's picture (56×56, one grey shade) is dark or light."""
    from datasets import Dataset
    from PIL import Image

    shades = random.Random(seed).choices(range(256), k=rows)
    question = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": "Is this picture dark or light?"}]  # fmt: skip
    return Dataset.from_dict({
        "prompt": [question] * rows,
        "image": [Image.new("RGB", (56, 56), (shade,) * 3) for shade in shades],
        "shade": shades,
    })  # fmt: skip


def shade_reward(completions, shade, **kwargs) -> list[float]:
    """1 when the answer after the reasoning says the picture's shade (dark below grey level 128, else light)."""
    rewards = []
    for completion, level in zip(completions, shade, strict=True):
        answer = completion[0]["content"].split("</think>")[-1].lower()
        right, wrong = ("dark", "light") if level < 128 else ("light", "dark")
        rewards.append(float(right in answer and wrong not in answer))
    return rewards


def tiny_model(folder: Path) -> str:
    """The tests' tiny random Idefics3 (tests/helpers.py `build_tiny_vlm`), built once into `folder`."""
    if not (folder / "config.json").is_file():
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from helpers import build_tiny_vlm

        from trl_es.util.models import smollm2_tokenizer_dir

        build_tiny_vlm(folder, smollm2_tokenizer_dir())
    return str(folder)


def main(argv: list[str] | None = None):
    import torch
    from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config, get_quantization_config
    from trl.rewards import think_format_reward

    from trl_es import ESConfig, ESTrainer

    parser = TrlParser((ScriptArguments, ESConfig, ModelConfig))
    argv = sys.argv[1:] if argv is None else argv
    script_args, training_args, model_args = parser.parse_args_and_config(DEFAULTS + list(argv))
    dtype = model_args.dtype if model_args.dtype in ["auto", None] else getattr(torch, model_args.dtype)
    training_args.model_init_kwargs = dict(
        revision=model_args.model_revision, attn_implementation=model_args.attn_implementation, dtype=dtype
    )
    model = model_args.model_name_or_path or tiny_model(Path(training_args.output_dir) / "tiny-vlm")
    trainer = ESTrainer(
        model=model,
        args=training_args,
        reward_funcs=[think_format_reward, shade_reward],
        train_dataset=shade_dataset(64),
        eval_dataset=shade_dataset(16, seed=1) if training_args.eval_strategy != "no" else None,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)
    return trainer


if __name__ == "__main__":
    main()
