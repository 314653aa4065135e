"""report_to="wandb" and report_to="trackio", the trackers TRL's docs and examples log to, with the real packages: a
short run logs through Trainer's callbacks, then what each tracker wrote locally is read back — every GRPO and ES
metric at each logged step, the `completions` table under the step it shows, and the ES fields in the run's config.
Nothing leaves the machine: wandb runs offline, trackio writes its local SQLite store, both under tmp_path, and a
Python-side connection to another host fails the test."""

import json
import struct

import pytest
from datasets import Dataset
from helpers import es_config as config

from trl_es import ESTrainer


STEPS = (1, 2)
GRPO_KEYS = (
    "reward",
    "reward_std",
    "rewards/even_first_token/mean",
    "rewards/even_first_token/std",
    "frac_reward_zero_std",
    "num_tokens",
    "completions/mean_length",
    "completions/clipped_ratio",
    "learning_rate",
)
ES_KEYS = ("es/update_norm", "es/sigma", "es/population_reward_std", "es/population_reward_max", "es/skipped_update")
ES_FIELDS = ("population_size", "sigma", "sigma_decay", "antithetic", "fitness_shaping", "es_baseline")
TABLE_COLUMNS = ["step", "prompt", "completion", "even_first_token"]
ROWS = 2 * 2  # the first member's completions: prompts per step × num_generations


def even_first_token(completion_ids, **kwargs):
    return [float(ids[0] % 2 == 0) for ids in completion_ids]


def train(tiny_model_dir, tmp_path, report_to, **overrides):
    values = dict(report_to=report_to, logging_steps=1, log_completions=True, per_device_train_batch_size=2)
    args = config(tmp_path, **{**values, **overrides})
    prompts = Dataset.from_dict({"prompt": [f"Count to {n}:" for n in range(1, 9)]})
    trainer = ESTrainer(tiny_model_dir, even_first_token, args=args, train_dataset=prompts)
    trainer.train()
    return trainer


def wandb_records(path):
    """The records of an offline run's `.wandb` file, as wandb's protobuf `Record`s. wandb (0.31) ships no Python
    reader for it (its Go service writes it): it is a LevelDB log — a 7-byte header (":W&B", magic 0xBEE1, version
    0), then 32 KiB blocks of chunks, each with a header (CRC-32, length, type: full, first, middle, last)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block = path.read_bytes(), 32768
    assert data[:7] == b":W&B" + struct.pack("<HB", 0xBEE1, 0), data[:7]
    position, pending = 7, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a chunk header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # full, last
            record = Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_run(root):
    """The offline run's history rows (nested keys as dicts), config and folder, read from its `.wandb` file."""
    (path,) = root.glob("wandb/offline-run-*/run-*.wandb")
    history, run_config = [], {}
    for record in wandb_records(path):
        if record.HasField("history"):
            row = {}
            for item in record.history.item:
                *parents, key = list(item.nested_key) or [item.key]
                target = row
                for parent in parents:
                    target = target.setdefault(parent, {})
                target[key] = json.loads(item.value_json)
            history.append(row)
        elif record.HasField("config"):
            run_config.update({item.key: json.loads(item.value_json) for item in record.config.update})
    return history, run_config, path.parent


def latest_step_before(rows, index):
    return next((row["train/global_step"] for row in reversed(rows[:index]) if "train/global_step" in row), None)


def assert_a_value_per_step(rows, trainer):
    """Each logged step has one row with every GRPO and ES metric (`train/` as Trainer's callbacks prefix them), the
    value the trainer logged."""
    metric_rows = [row for row in rows if "train/reward" in row]
    assert [row["train/global_step"] for row in metric_rows] == list(STEPS)
    for row, logged in zip(metric_rows, trainer.state.log_history, strict=False):
        assert logged["step"] == row["train/global_step"]
        for key in GRPO_KEYS + ES_KEYS:
            assert row.get(f"train/{key}") == pytest.approx(logged[key]), key
        assert row["train/es/sigma"] == pytest.approx(0.02)


def test_wandb_offline_run_shows_grpo_and_es_metrics_each_step_completions_and_es_config(
    tmp_path, tiny_model_dir, wandb_offline
):
    import wandb

    trainer = train(tiny_model_dir, tmp_path, "wandb")
    wandb.finish()  # Trainer leaves the run open
    wandb.teardown()  # wandb's service writes the `.wandb` file to its end only when it stops
    history, run_config, run_dir = wandb_run(wandb_offline)

    assert_a_value_per_step(history, trainer)
    tables = [row for row in history if "completions" in row]
    assert [row["train/global_step"] for row in tables] == list(STEPS)
    for row in tables:
        assert row["completions"]["_type"] == "table-file"
        table = json.loads((run_dir / "files" / row["completions"]["path"]).read_text())
        assert table["columns"] == TABLE_COLUMNS and len(table["data"]) == ROWS
        steps = {values[0] for values in table["data"]}
        # filed under its completions' step: wandb gives the table the `train/global_step` logged last
        assert steps == {row["train/global_step"]}
        assert all(isinstance(values[2], str) and values[3] in (0.0, 1.0) for values in table["data"])
    for name in ES_FIELDS:
        assert run_config[name] == trainer.args.to_dict()[name], name
    assert run_config["population_size"] == 4


def test_trackio_local_run_shows_grpo_and_es_metrics_each_step_completions_and_es_config(
    tmp_path, tiny_model_dir, trackio_store
):
    import trackio
    from trackio.sqlite_storage import SQLiteStorage

    project = "trl-es-trackers"
    trainer = train(tiny_model_dir, tmp_path, "trackio", project=project)
    assert (trackio_store / f"{project}.db").is_file()
    (run,) = trackio.Api().runs(project)
    logs = SQLiteStorage.get_logs(project, run.name)

    assert_a_value_per_step(logs, trainer)
    tables = [(i, log["completions"]) for i, log in enumerate(logs) if "completions" in log]
    assert [table["_value"][0]["step"] for _, table in tables] == list(STEPS)
    for i, table in tables:
        assert table["_type"] == trackio.Table.TYPE
        assert list(table["_value"][0]) == TABLE_COLUMNS and len(table["_value"]) == ROWS
        # logged after its step's metrics, so the latest `train/global_step` before it is the table's step
        assert {row["step"] for row in table["_value"]} == {latest_step_before(logs, i)}
    for name in ES_FIELDS:
        assert run.config[name] == trainer.args.to_dict()[name], name
    assert SQLiteStorage.get_space_id(project) is None
