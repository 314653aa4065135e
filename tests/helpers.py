"""What several test modules share: tiny real models built offline, a small ESConfig, `accelerate launch` with 2 CPU
processes, weight comparisons, the rewards the tiny models are trained on. Imported as `helpers` (tests/ is on the
path; launched scripts get it through PYTHONPATH)."""

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import trl


TESTS = Path(__file__).parent
REPOSITORY = TESTS.parent
DATA = TESTS / "data"


def build_tiny_model(path, tokenizer_dir, dtype=torch.float32, seed=0, moe=False, **config_overrides):
    """A 2-layer Llama with SmolLM2's vocabulary (≈0.8M parameters), saved with the tokenizer as a model dir;
    `moe=True`: a 2-layer Qwen3-MoE instead (4 experts, top-2, fused 3-D expert tensors; heads of 32 dimensions so
    vLLM's CPU attention runs it too). `config_overrides` replace config fields (vLLM's CPU attention needs heads of
    ≥32 dimensions)."""
    from transformers import (
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    values = dict(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if moe:
        values.update(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, head_dim=32, num_experts=4,
                      num_experts_per_tok=2, norm_topk_prob=True)  # fmt: skip
    config_class, model_class = (Qwen3MoeConfig, Qwen3MoeForCausalLM) if moe else (LlamaConfig, LlamaForCausalLM)
    config = config_class(**{**values, **config_overrides})
    torch.manual_seed(seed)
    model = model_class(config).to(dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def es_config(tmp_path, **overrides):
    """A small, fast ESConfig for the tiny model; `overrides` replace any field."""
    from trl_es import ESConfig

    values = dict(
        output_dir=str(tmp_path / "out"),
        population_size=4,
        sigma=0.02,
        learning_rate=0.02,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        max_steps=2,
        seed=3,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    return ESConfig(**{**values, **overrides})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Finished:
    """A launcher that ended: its exit status, output and when it ended (`time.monotonic()`)."""

    returncode: int
    stdout: str
    stderr: str
    ended: float


def two_machines(commands: list[list[str]], envs: list[dict], cwd=None, timeout=600) -> list[Finished]:
    """Two launchers started at once, as two machines would (machine 0's command and environment first, each
    `accelerate launch … --num_machines 2 --machine_rank r` or a node script); each one's `Finished`."""
    base = {**os.environ, "PYTHONPATH": os.pathsep.join((str(TESTS), str(REPOSITORY)))}
    launchers = [
        subprocess.Popen(
            command, cwd=cwd, env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for command, env in zip(commands, envs, strict=True)
    ]
    ended, deadline = {}, time.monotonic() + timeout
    while len(ended) < len(launchers) and time.monotonic() < deadline:
        for k, launcher in enumerate(launchers):
            if k not in ended and launcher.poll() is not None:
                ended[k] = time.monotonic()
        time.sleep(0.2)
    finished = []
    for k, launcher in enumerate(launchers):
        if k not in ended:  # past the timeout: stopped, reported as it ended
            launcher.kill()
        stdout, stderr = launcher.communicate()
        finished.append(Finished(launcher.returncode, stdout, stderr, ended.get(k, time.monotonic())))
    return finished


def machine_launch(machine: int, port: int, *command: str, backend=("--multi_gpu",)) -> list[str]:
    """`accelerate launch` of one process on machine `machine` of 2 (`two_machines`), the main process at
    127.0.0.1:`port`."""
    return [sys.executable, "-m", "accelerate.commands.launch", *backend, "--num_processes", "2", "--num_machines", "2",
            "--machine_rank", str(machine), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
            "--mixed_precision", "no", "--dynamo_backend", "no", *command]  # fmt: skip


def accelerate_launch(num_processes: int, *command: str, backend=("--multi_gpu",), cwd=None, env=None, timeout=600):
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *backend,
        "--num_processes",
        str(num_processes),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
    ]
    # the helpers, and this checkout's trl_es (not another the environment may have installed)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(TESTS), str(REPOSITORY))), **(env or {})}
    return subprocess.run([*launch, *command], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same_weights(model, expected):
    for name, p in model.named_parameters():
        assert torch.equal(p, expected[name]), name


def upper_vocab_share(completion_ids, **kwargs):
    """Share of completion tokens from the upper half of the vocabulary (the tiny model's greedy output: none)."""
    return [sum(t >= 24576 for t in ids) / max(len(ids), 1) for ids in completion_ids]


class SandboxUids:
    """Records the throwaway uids the sandbox picks (`secrets.randbelow` wrapped), so that a test checks the
    processes of its own runs only: under pytest-xdist other tests run sandboxed programs at the same time."""

    def __init__(self, monkeypatch):
        from trl_es.rewards import sandbox

        self.uids, draw = [], sandbox.secrets.randbelow

        def recorded(n):
            value = draw(n)
            self.uids.append(200_000 + value)
            return value

        monkeypatch.setattr(sandbox.secrets, "randbelow", recorded)

    def live_processes(self) -> list[int]:
        """Live processes whose real uid one of the recorded runs had."""
        pids = []
        for name in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{name}/status") as file:
                    fields = dict(line.split(":", 1) for line in file if ":" in line)
            except OSError:
                continue
            if int(fields["Uid"].split()[0]) in self.uids and not fields["State"].strip().startswith("Z"):
                pids.append(int(name))
        return pids


# ---- A search space defined outside trl-es (registered on import): tests/training/test_search_space_registry.py,
# the regression guard's `registered_space` scenario


from trl_es.es import SEARCH_SPACES, Direction, SearchSpace, register, update_coefficients  # noqa: E402
from trl_es.es.space import UpdateRule, one_member  # noqa: E402


class NormsOnlySpace(SearchSpace):
    """Antithetic Gaussian members over the normalisation weights alone; the plain ES update on them."""

    name = "test-norms-only"

    def __init__(self, weights, seed: int, population_size: int, rule: UpdateRule):
        super().__init__(weights, rule)
        self.seed, self.population_size = seed, population_size
        self.names = [name for name in weights.params if "norm" in name]

    @classmethod
    def check_config(cls, args, refuse):
        if args.population_size % 2:
            refuse("population_size", "this space pairs its members")

    @classmethod
    def from_config(cls, args, model, weights, load_model=None):
        return cls(weights, args.seed, args.population_size, UpdateRule.from_config(args))

    def _ask(self, step, sigma):
        seeds = [self.seed * 1000 + step * 100 + i // 2 for i in range(self.population_size)]
        return [Direction(seed, 1 - 2 * (i % 2), sigma=sigma) for i, seed in enumerate(seeds)]

    @contextlib.contextmanager
    def evaluating(self, members):
        route = one_member(members)
        (member,) = members
        if member is None:
            self.weights.center()
        else:
            self.weights.member(member.seed, member.sign * member.sigma, self.names)
        yield route

    def _tell(self, members, rewards, fitness, learning_rate):
        pairs = [(m.seed, m.sign) for m in members]
        coefficients = update_coefficients(fitness, pairs, learning_rate, len(members))
        norm = self.weights.update(coefficients, 0.0, self.names)
        return {"es/update_norm": norm}, {"coefficients": [[s, c] for s, c in coefficients.items()]}

    def chain_header(self):
        return {"kind": self.name, "names": self.names}

    @staticmethod
    def replayer(header, weights, load_model=None):
        def replay(update):
            weights.update({int(s): float(c) for s, c in update["coefficients"]}, 0.0, header["names"])

        return replay


if NormsOnlySpace.name not in SEARCH_SPACES:
    register(NormsOnlySpace)


# ---- The agent scenario: tests/training/test_agents.py and the regression guard's `agents` scenario. As TRL's
# tests do, the model's `generate` is patched to decide when a completion calls a tool (`scripted`).


QWEN_TEMPLATE = Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja"
CALL = '<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call><|im_end|>'


def tool_tokenizer(model_dir):
    """SmolLM2's tokenizer with TRL's Qwen2.5 template (the same special tokens; it can call tools)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = QWEN_TEMPLATE.read_text()
    return tokenizer


def scripted(trainer, script):
    """Patch `trainer.model.generate`: the real `generate` runs, then `script(row, prompt_text, generated_ids)` gives
    each row's completion text. Returns the list of batch sizes of the calls."""
    real, tokenizer, calls = trainer.model.generate, trainer.generation.tokenizer, []

    def generate(input_ids, **kwargs):
        output = real(input_ids=input_ids, **kwargs)
        width, rows = input_ids.shape[1], []
        calls.append(input_ids.shape[0])
        for i in range(input_ids.shape[0]):
            text = script(i, tokenizer.decode(input_ids[i]), output[i, width:].tolist())
            rows.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        longest = max(map(len, rows))
        padded = [row + [tokenizer.pad_token_id] * (longest - len(row)) for row in rows]
        return torch.cat([input_ids, torch.tensor(padded, device=input_ids.device)], dim=1)

    trainer.model.generate = generate
    return calls


def digits(ids, k=2) -> str:
    """Part of what the member generated, as text the reward can see: its first token ids' last digits."""
    return "".join(str(t % 10) for t in ids[:k])


def answer_digits(completions, **kwargs):
    """The digits of the completion's last message, read as a number / 100: differs between members."""
    return [sum(int(c) for c in m[-1]["content"] if c.isdigit()) / 100 for m in completions]


def agent_config(tmp_path, **overrides):
    values = dict(per_device_train_batch_size=3, num_generations=1, max_completion_length=96, max_steps=1)
    return es_config(tmp_path, **{**values, **overrides})


class Dice:
    """An environment drawing its episode from Python's RNG: trl-es seeds it, so every member faces the same one."""

    def reset(self, **kwargs):
        import random

        self.target, self.hit = random.randint(1, 9), False
        return f" Roll a {self.target}."

    def roll(self, guess: int) -> str:
        """Roll.

        Args:
            guess: The number to roll.

        Returns:
            Whether the roll hit.
        """
        self.hit = guess == self.target
        return "hit" if self.hit else "miss"

    def get_reward(self) -> float:
        return float(self.hit)


def dice_script(row, prompt, ids):
    if "tool_response" in prompt:
        return f"Done {digits(ids)}<|im_end|>"
    return CALL.format(name="roll", arguments=f'{{"guess": {1 + ids[0] % 9}}}')


def dice_trainer(model_dir, out, **overrides):
    from trl_es import ESTrainer

    settings = dict(population_size=4, sigma=0.5, learning_rate=0.5, per_device_train_batch_size=2, num_generations=2,
                    max_steps=2)  # fmt: skip
    args = agent_config(out, **{**settings, **overrides})
    trainer = ESTrainer(model_dir, answer_digits, args=args, environment_factory=Dice,
                        processing_class=tool_tokenizer(model_dir))  # fmt: skip
    scripted(trainer, dice_script)
    return trainer


# ---- A tiny vision-language model: tests/training/test_vlm.py and examples/es_vlm.py.


def build_tiny_vlm(path, tokenizer_dir, seed=0):
    """A tiny Idefics3 (the SmolVLM architecture; ≈3.3M parameters): a 1-layer SigLIP vision tower over 56×56 images
    (14-pixel patches, pixel shuffle by 2: 4 image tokens an image), a connector, and a 2-layer Llama on SmolLM2's
    vocabulary, saved with its processor (transformers' PIL image processor, no torchvision; SmolLM2's tokenizer with
    the image tokens; TRL's Idefics3 chat template). Weights drawn with std 0.2, so that completions depend on the
    image visibly. Loadable with AutoProcessor and AutoModelForImageTextToText."""
    from transformers import (
        AutoTokenizer,
        GenerationConfig,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from trl.chat_template_utils import idefics3_chat_template

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": 56}, max_image_size={"longest_edge": 56}, do_image_splitting=False
    )
    processor = Idefics3Processor(image_processor, tokenizer, image_seq_len=4, chat_template=idefics3_chat_template)
    end_of_turn = tokenizer.convert_tokens_to_ids(processor.end_of_utterance_token)
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                initializer_range=0.2, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=56,
                  patch_size=14, initializer_range=0.2)  # fmt: skip
    config = Idefics3Config(text_config=text, vision_config=vision, image_token_id=processor.image_token_id,
                            scale_factor=2, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, end_of_turn],
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)


def solid_image(value: int, size: int = 56):
    """A size×size RGB image of one grey level."""
    from PIL import Image

    return Image.new("RGB", (size, size), (value, value, value))
