"""Vision-language models on the transformers generation path, as GRPOTrainer takes them: the tiny Idefics3 of
`helpers.build_tiny_vlm` (SigLIP tower, connector, Llama) sees each prompt's image in every member's rows; ES moves
its language model and leaves the vision tower as it is unless es_parameter_patterns selects it."""

import pytest
import torch
from datasets import Dataset
from helpers import assert_same_weights, solid_image, weights
from helpers import es_config as config
from transformers import AutoModelForImageTextToText, AutoProcessor, Idefics3Processor

from trl_es import ESTrainer


QUESTION = [{"role": "user", "content": "What shade is this?"}]


def even_token_share(completion_ids, **kwargs):
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def shades(*levels, column="image"):
    """One conversational prompt per grey level, with its image in `column` ('image', or 'images': a list)."""
    images = [solid_image(level) for level in levels]
    return Dataset.from_dict(
        {"prompt": [QUESTION] * len(levels), column: images if column == "image" else [[i] for i in images]}
    )


def vlm_trainer(tmp_path, model_dir, dataset=None, **overrides):
    settings = dict(per_device_train_batch_size=2, max_completion_length=8)
    dataset = shades(0, 255) if dataset is None else dataset
    return ESTrainer(model_dir, even_token_share, args=config(tmp_path, **{**settings, **overrides}),
                     train_dataset=dataset)  # fmt: skip


def recording_generate(model):
    """Wrap `model.generate` (the real one runs) to keep each call's keyword arguments."""
    real, calls = model.generate, []

    def generate(**kwargs):
        calls.append(kwargs)
        return real(**kwargs)

    model.generate = generate
    return calls


def test_the_processor_is_loaded_and_completions_depend_on_the_image(tmp_path, tiny_vlm_dir):
    """Without processing_class the model's processor is loaded (AutoProcessor, as GRPOTrainer does); the same
    question on a black and a white image, sampled with the same seeds, gives other completions."""
    trainer = vlm_trainer(tmp_path, tiny_vlm_dir)
    assert isinstance(trainer.processing_class, Idefics3Processor)
    rows = list(shades(0, 255, 0))
    completions = trainer.rollout(rows, 2, [11, 12] * 3)
    black, white, black_again = (completions.completion_ids[k : k + 2] for k in (0, 2, 4))
    assert black == black_again  # a prompt's tokens depend on its image and seeds alone
    assert black != white


def test_generation_equals_transformers_generate_on_the_processor_inputs(tmp_path, tiny_vlm_dir):
    """Greedy completions of ESTrainer's generation equal transformers' own `generate` on what the processor makes
    of the prompt and its image: the image tensors ESTrainer builds for the token ids are the processor's."""
    trainer = vlm_trainer(tmp_path, tiny_vlm_dir, generation_kwargs={"do_sample": False})
    rows = list(shades(40, 200))
    ours = trainer.rollout(rows, 1, [0, 0]).completion_ids
    processor, model = (
        AutoProcessor.from_pretrained(tiny_vlm_dir),
        AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir),
    )
    for row, completion in zip(rows, ours, strict=True):
        messages = [{"role": "user", "content": [{"type": "image", "image": row["image"]},
                                                  {"type": "text", "text": QUESTION[0]["content"]}]}]  # fmt: skip
        inputs = processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
        )
        output = model.generate(**inputs, max_new_tokens=len(completion), do_sample=False,
                                suppress_tokens=[model.config.image_token_id])  # fmt: skip
        assert output[0, inputs["input_ids"].shape[1] :].tolist() == completion


@pytest.mark.parametrize("column", ["image", "images"])
def test_every_member_row_of_the_mixed_batch_carries_its_prompt_image(tmp_path, tiny_vlm_dir, column):
    """The population's batch (members × prompts × generations, member-major) gives every row its prompt's image,
    and each member's completions in it equal those the member generates alone."""
    trainer = vlm_trainer(tmp_path, tiny_vlm_dir)
    rows, n, members = list(shades(0, 255, column=column)), 2, 3
    calls = recording_generate(trainer.model)
    alone = trainer.rollout(rows, n, [5, 6, 7, 8]).completion_ids
    mixed = trainer.rollout(rows, n, [5, 6, 7, 8] * members, n_members=members).completion_ids
    assert [mixed[j * 4 : (j + 1) * 4] for j in range(members)] == [alone] * members
    pixels = calls[-1]["pixel_values"]  # (rows, images a row, 3, 56, 56): black rows −1 after normalization, white +1
    assert pixels.shape[:2] == (members * len(rows) * n, 1)
    levels = pixels.mean(dim=(1, 2, 3, 4)).tolist()
    assert [round(level) for level in levels] == [-1, -1, 1, 1] * members


def test_training_moves_the_language_model_and_leaves_the_vision_tower(tmp_path, tiny_vlm_dir):
    """By default ES perturbs the language model alone (the decoder and its output head): two steps change its
    weights and leave the vision tower and the connector bitwise as they were. The completions' token entropy is
    logged, finite though the image token is suppressed (its probability 0)."""
    trainer = vlm_trainer(tmp_path, tiny_vlm_dir, log_completion_entropy=True)
    assert trainer.es_params and all(name.startswith("model.text_model.") for name in trainer.es_params)
    before = weights(trainer.model)
    trainer.train()
    moved = {name for name, p in trainer.model.named_parameters() if not torch.equal(p, before[name])}
    assert moved == set(trainer.es_params)
    assert not any(name.startswith(("model.vision_model.", "model.connector.")) for name in moved)
    entropies = [log["completions/mean_token_entropy"] for log in trainer.state.log_history if "reward" in log]
    assert len(entropies) == 2 and all(0 < entropy < 20 for entropy in entropies)  # nats; NaN fails both


def test_es_parameter_patterns_can_select_the_vision_tower(tmp_path, tiny_vlm_dir):
    trainer = vlm_trainer(tmp_path, tiny_vlm_dir, es_parameter_patterns=[r"vision_model\.encoder"])
    before = weights(trainer.model)
    trainer.train()
    moved = {name for name, p in trainer.model.named_parameters() if not torch.equal(p, before[name])}
    assert moved and all(name.startswith("model.vision_model.encoder.") for name in moved)


def test_a_failing_member_restores_the_weights_bitwise(tmp_path, tiny_vlm_dir):
    calls = []

    def flaky(completion_ids, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # the third member, after two were formed, evaluated and restored
            raise RuntimeError("reward service down")
        return even_token_share(completion_ids)

    trainer = ESTrainer(tiny_vlm_dir, flaky, args=config(tmp_path, per_device_train_batch_size=2),
                        train_dataset=shades(0, 255))  # fmt: skip
    before = weights(trainer.model)
    with pytest.raises(RuntimeError, match="reward service down"):
        trainer.train()
    assert_same_weights(trainer.model, before)


@pytest.mark.slow  # a further variant: resume (tests/training/test_trainer.py) with a processor
def test_resume_from_checkpoint_gives_the_uninterrupted_weights(tmp_path, tiny_vlm_dir):
    full = vlm_trainer(tmp_path / "full", tiny_vlm_dir, max_steps=4)
    full.train()
    first = vlm_trainer(tmp_path / "resumed", tiny_vlm_dir, max_steps=4, save_strategy="steps", save_steps=2)
    first.train()
    checkpoint = tmp_path / "resumed" / "out" / "checkpoint-2"
    assert isinstance(AutoProcessor.from_pretrained(checkpoint), Idefics3Processor)  # saved with its processor
    resumed = vlm_trainer(tmp_path / "resumed", tiny_vlm_dir, max_steps=4)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4
    assert_same_weights(resumed.model, weights(full.model))


def test_the_seed_chain_replays_to_the_trained_weights_with_the_processor(tmp_path, tiny_vlm_dir):
    """`trl-es replay` of a VLM run's chain (its base found from the chain) rebuilds the trained weights bitwise, as
    a model directory that loads as a VLM again, with its processor."""
    from trl_es.cli import main as cli

    trainer = vlm_trainer(tmp_path, tiny_vlm_dir, max_steps=3)
    trainer.train()
    trainer.save_model()
    trained = weights(trainer.model)
    assert cli(["replay", "--chain", str(tmp_path / "out"), "--out", str(tmp_path / "rebuilt")]) == 0
    assert isinstance(AutoProcessor.from_pretrained(tmp_path / "rebuilt"), Idefics3Processor)
    rebuilt = AutoModelForImageTextToText.from_pretrained(tmp_path / "rebuilt")
    assert_same_weights(rebuilt, trained)
    start = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir)
    assert any(not torch.equal(p, trained[n]) for n, p in start.named_parameters())  # training moved the weights


def test_lora_on_the_language_model_trains_the_adapter_alone(tmp_path, tiny_vlm_dir):
    from peft import LoraConfig

    lora = LoraConfig(r=2, lora_alpha=4, target_modules=r".*text_model.*\.(q_proj|v_proj)")
    trainer = ESTrainer(tiny_vlm_dir, even_token_share, args=config(tmp_path, per_device_train_batch_size=2),
                        train_dataset=shades(0, 255), peft_config=lora)  # fmt: skip
    assert trainer.es_params and all("lora_" in name and ".text_model." in name for name in trainer.es_params)
    before = weights(trainer.model)
    trainer.train()
    moved = {name for name, p in trainer.model.named_parameters() if not torch.equal(p, before[name])}
    assert moved and moved <= set(trainer.es_params)


def test_lowrank_search_space_trains_the_language_model(tmp_path, tiny_vlm_dir):
    trainer = vlm_trainer(tmp_path, tiny_vlm_dir, es_search_space="lowrank")
    before = weights(trainer.model)
    trainer.train()
    moved = {name for name, p in trainer.model.named_parameters() if not torch.equal(p, before[name])}
    assert moved and all(name.startswith("model.text_model.") for name in moved)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"vllm_mode": "server"}, r"vllm_mode='server' sends token ids over HTTP, without the images"),
        ({"es_search_space": "lowrank"}, r"es_search_space='lowrank' evaluates members as LoRA adapters"),
        ({"peft": True}, r"an adapter's members are LoRA adapters"),
    ],
)
def test_what_vllm_cannot_show_a_vision_language_model_is_refused_before_the_engine_starts(
    tmp_path, tiny_vlm_dir, overrides, message
):
    """vLLM takes images in colocate mode with full-rank members (tests/vllm); a server, low-rank members and an
    adapter's members are refused, naming why."""
    from peft import LoraConfig

    lora = LoraConfig(r=2, target_modules=r".*text_model.*\.q_proj") if overrides.pop("peft", False) else None
    args = config(tmp_path, per_device_train_batch_size=2, use_vllm=True, **overrides)
    with pytest.raises(ValueError, match=rf"use_vllm=True with a vision-language model .*{message}"):
        ESTrainer(tiny_vlm_dir, even_token_share, args=args, train_dataset=shades(0, 255), peft_config=lora)


def test_images_need_the_processor_and_conversational_prompts(tmp_path, tiny_vlm_dir, tiny_model_dir):
    from transformers import AutoTokenizer

    with pytest.raises(ValueError, match="'image' column.*a processing class that is a tokenizer"):
        ESTrainer(tiny_vlm_dir, even_token_share, args=config(tmp_path), train_dataset=shades(0, 255),
                  processing_class=AutoTokenizer.from_pretrained(tiny_vlm_dir))  # fmt: skip
    text = Dataset.from_dict({"prompt": ["What shade is this?"] * 2, "image": [solid_image(0), solid_image(9)]})
    with pytest.raises(ValueError, match="'image' column and text prompts.*lists of chat messages"):
        vlm_trainer(tmp_path, tiny_vlm_dir, text)
    processor = AutoProcessor.from_pretrained(tiny_vlm_dir)
    with pytest.raises(TypeError, match="is a processor .*not a vision-language model"):
        ESTrainer(tiny_model_dir, even_token_share, args=config(tmp_path),
                  train_dataset=Dataset.from_dict({"prompt": [QUESTION] * 2}), processing_class=processor)  # fmt: skip


def test_log_multimodal_sends_each_row_image_with_the_completions_table(tmp_path, tiny_vlm_dir, trackio_store):
    """As GRPOTrainer: the completions table's prompts keep an image block without its picture (parquet), and the
    table sent to trackio has an `image` column with each row's image; log_multimodal=False leaves it out."""
    import pandas as pd
    import trackio
    from trackio.sqlite_storage import SQLiteStorage

    for project, multimodal in (("vlm-images", True), ("vlm-text", False)):
        vlm_trainer(tmp_path / project, tiny_vlm_dir, max_steps=1, log_completions=True, report_to="trackio",
                    project=project, log_multimodal=multimodal).train()  # fmt: skip
        parquet = pd.read_parquet(tmp_path / project / "out" / "completions" / "completions_00001.parquet")
        blocks = [block for prompt in parquet["prompt"] for message in prompt for block in message["content"]]
        assert {block["type"] for block in blocks} == {"image", "text"}
        assert all(block.get("image") is None for block in blocks)
        (run,) = trackio.Api().runs(project)
        (table,) = [log["completions"] for log in SQLiteStorage.get_logs(project, run.name) if "completions" in log]
        rows = table["_value"]
        assert len(rows) == 2 * 2  # the first member's completions: prompts × num_generations
        if multimodal:
            assert all(len(row["image"]) == 1 and row["image"][0]["_type"] == trackio.Image.TYPE for row in rows)
        else:
            assert "image" not in rows[0]


class Lamp:
    """An environment without tools: its reset says where the lamp is."""

    def reset(self, **row) -> str:
        return " The lamp is on."


def test_agent_episodes_show_the_prompt_image_to_every_member(tmp_path, tiny_vlm_dir):
    """Agent episodes (an environment_factory) render the prompt, its image and the reset's observation through the
    processor: each episode's completion depends on its image, and a member's episodes in a batch of three equal
    its episodes alone."""
    args = config(tmp_path, per_device_train_batch_size=2, max_completion_length=8)
    trainer = ESTrainer(tiny_vlm_dir, even_token_share, args=args, train_dataset=shades(0, 255),
                        environment_factory=Lamp)  # fmt: skip
    rows = list(shades(0, 255, 0))
    alone = trainer.rollout(rows, 1, [3, 3, 3], key=0)
    black, white, black_again = alone.completion_ids
    assert black == black_again and black != white
    assert alone.prompts[0][-1]["content"][-1] == {"type": "text", "text": " The lamp is on."}
    mixed = trainer.rollout(rows, 1, [3, 3, 3] * 3, n_members=3, key=1).completion_ids
    assert mixed == alone.completion_ids * 3


def snapshot(zoom: int) -> list:
    """Takes a picture.

    Args:
        zoom: How close to look.

    Returns:
        The picture.
    """
    return [{"type": "image", "image": solid_image(zoom)}, {"type": "text", "text": "a picture"}]


def test_a_tool_image_reaches_the_model_for_the_rest_of_the_episode(tmp_path, tiny_vlm_dir):
    """As GRPOTrainer: a tool's image is expanded into the result's tokens and shown to the model with the turns
    that follow. Episodes whose tool returned the same picture continue alike; another picture, differently."""
    from helpers import CALL, scripted
    from trl.chat_template_utils import qwen3_template, qwen3_vl_chat_template

    processor = AutoProcessor.from_pretrained(tiny_vlm_dir)  # given TRL's Qwen3-VL template, which calls tools,
    processor.chat_template = qwen3_vl_chat_template.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>")
    processor.tokenizer.response_template = qwen3_template  # with Idefics3's image token, and its response parser
    args = config(tmp_path, per_device_train_batch_size=3, max_completion_length=96)
    trainer = ESTrainer(tiny_vlm_dir, even_token_share, args=args, processing_class=processor, tools=[snapshot],
                        train_dataset=Dataset.from_dict({"prompt": [QUESTION] * 3}))  # fmt: skip
    after_tool = {}

    def script(row, prompt, ids):
        if "<image>" in prompt:  # the turn after the tool's result: what the model generated, seeing its picture
            after_tool[row] = ids
            return "Done<|im_end|>"
        return CALL.format(name="snapshot", arguments=f'{{"zoom": {255 * (row % 2)}}}')  # rows 0, 2: black; 1: white

    scripted(trainer, script)
    calls = recording_generate(trainer.model)
    episodes = trainer.rollout([{"prompt": QUESTION}] * 3, 1, [4, 4, 4], key=0)
    roles = [[message["role"] for message in episode] for episode in episodes.completions]
    assert roles == [["assistant", "tool", "assistant"]] * 3
    assert after_tool[0] == after_tool[2] != after_tool[1]
    assert calls[-1]["pixel_values"].shape[:2] == (3, 1)  # the second turn: each row its tool's picture


def test_the_es_vlm_example_trains_and_saves_the_model_with_its_processor(tmp_path, tiny_vlm_dir):
    """examples/es_vlm.py (TRL's grpo_vlm.py with ESTrainer) on the tiny model: it parses its ESConfig with
    TrlParser, trains on the pictures and saves the model with its processor."""
    import importlib.util

    from helpers import REPOSITORY

    spec = importlib.util.spec_from_file_location("es_vlm", REPOSITORY / "examples" / "es_vlm.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = tmp_path / "es-vlm"
    trainer = example.main(["--output_dir", str(out), "--model_name_or_path", tiny_vlm_dir, "--max_steps", "1",
                            "--disable_tqdm", "true"])  # fmt: skip
    assert trainer.state.global_step == 1 and "rewards/shade_reward/mean" in trainer.state.log_history[0]
    assert isinstance(AutoProcessor.from_pretrained(out), Idefics3Processor)
    assert AutoModelForImageTextToText.from_pretrained(out).config.vision_config is not None
