"""Sparse updates: statistics by hand, thresholding, the delta file (bitwise round trip, refusals, corruption)."""

import math
import os
import tempfile

import pytest
import torch

from trl_es.util.deltas import (
    apply_delta,
    check_same_architecture,
    load_delta,
    save_delta,
    threshold_masks,
    thresholded,
    update_statistics,
    weights_hash,
)


@pytest.fixture
def pair():
    base = {"a.weight": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "b.bias": torch.tensor([0.5, -0.5, 0.0])}
    tuned = {
        "a.weight": torch.tensor([[1.0, 2.002], [2.9995, 4.0]]),  # Δ: 0, 0.002, -0.0005, 0
        "b.bias": torch.tensor([0.5, -0.49, 0.001]),  # Δ: 0, 0.01, 0.001
    }
    return base, tuned


def test_statistics_by_hand(pair):
    base, tuned = pair
    stats = update_statistics(base, tuned, taus=[1e-3, 5e-3])
    total = stats["total"]
    assert (total["numel"], total["nonzero"]) == (7, 4)
    assert total["nonzero_share"] == pytest.approx(4 / 7)
    deltas = [
        t - b
        for name in base
        for b, t in zip(base[name].flatten().tolist(), tuned[name].flatten().tolist(), strict=False)
    ]
    base_norm = math.sqrt(sum(v * v for name in base for v in base[name].flatten().tolist()))
    assert total["relative_l2"] == pytest.approx(math.sqrt(sum(d * d for d in deltas)) / base_norm, rel=1e-4)
    # nonzero |Δ| ≈ 0.002, 0.0005, 0.01, 0.001: ≤ 1e-3 → 2 of 4 (0.0005 and 0.001), ≤ 5e-3 → 3 of 4
    assert total["s_tau"] == {1e-3: pytest.approx(0.5), 5e-3: pytest.approx(0.75)}
    assert stats["per_tensor"]["b.bias"]["nonzero"] == 2


def test_threshold_by_tau_and_by_top_fraction(pair):
    base, tuned = pair
    masks = threshold_masks(base, tuned, tau=1.5e-3)
    assert masks["a.weight"].tolist() == [[False, True], [False, False]]
    assert masks["b.bias"].tolist() == [False, True, False]
    model = thresholded(base, tuned, masks)
    assert model["a.weight"].tolist() == [[1.0, tuned["a.weight"][0, 1].item()], [3.0, 4.0]]
    top = threshold_masks(base, tuned, top_fraction=2 / 7)  # the two largest |Δ|: 0.01 and 0.002
    assert top["b.bias"].tolist() == [False, True, False] and top["a.weight"][0, 1]
    with pytest.raises(ValueError, match="exactly one"):
        threshold_masks(base, tuned)
    with pytest.raises(ValueError, match="top_fraction"):
        threshold_masks(base, tuned, top_fraction=1.5)


def test_delta_file_rebuilds_the_thresholded_model_bitwise(tmp_path, pair):
    base, tuned = pair
    base["c.weight"] = torch.arange(100.0).view(10, 10)  # 1 of 100 kept: stored as an index, the others as masks
    tuned["c.weight"] = base["c.weight"].clone()
    tuned["c.weight"][7, 3] += 0.5
    masks = threshold_masks(base, tuned, tau=1e-3)
    path = str(tmp_path / "delta.safetensors")
    metadata = save_delta(path, base, tuned, masks, base_model="tiny", tau=1e-3)
    assert metadata["kept"] == "3" and float(metadata["sparsity"]) == pytest.approx(1 - 3 / 107)
    stored = load_delta(path)[0]
    assert stored["c.weight.indices"].tolist() == [73] and "a.weight.mask" in stored
    rebuilt = apply_delta(base, path)
    expected = thresholded(base, tuned, masks)
    assert all(torch.equal(rebuilt[name], expected[name]) for name in expected)
    assert all(torch.equal(base[name], pair[0][name]) for name in base)  # the base is not modified


def test_delta_for_other_base_weights_is_refused_unless_forced(tmp_path, pair):
    base, tuned = pair
    path = str(tmp_path / "delta.safetensors")
    save_delta(path, base, tuned, threshold_masks(base, tuned, tau=0.0))
    other = {name: t + 1 for name, t in base.items()}
    assert weights_hash(other) != weights_hash(base)
    with pytest.raises(ValueError, match="other base weights"):
        apply_delta(other, path)
    forced = apply_delta(other, path, force=True)
    assert torch.equal(forced["b.bias"], torch.tensor([1.5, -0.49, 0.001]))
    with pytest.raises(ValueError, match="other parameters or shapes"):
        apply_delta({"a.weight": base["a.weight"]}, path)


def test_corrupt_truncated_or_missing_delta_is_a_clear_error(tmp_path, pair):
    base, tuned = pair
    path = tmp_path / "delta.safetensors"
    save_delta(str(path), base, tuned, threshold_masks(base, tuned, tau=0.0))
    data = path.read_bytes()
    (tmp_path / "truncated.safetensors").write_bytes(data[: len(data) - 7])
    (tmp_path / "garbage.safetensors").write_bytes(b"\x00" * 3 + os.urandom(64))
    for name in ("truncated", "garbage"):
        with pytest.raises(ValueError, match="corrupt or truncated"):
            load_delta(str(tmp_path / f"{name}.safetensors"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_delta(str(tmp_path / "missing.safetensors"))


def test_different_architectures_are_named(pair):
    base, tuned = pair
    with pytest.raises(ValueError, match="only in base"):
        check_same_architecture(base, {"a.weight": tuned["a.weight"]})
    with pytest.raises(ValueError, match="'a.weight' has shape"):
        check_same_architecture(base, {**tuned, "a.weight": torch.zeros(3, 2)})


def test_sparsify_and_apply_delta_commands_on_real_models(tmp_path, tiny_model_dir, capsys):
    from transformers import AutoModelForCausalLM

    from trl_es.cli import main

    tuned_dir = tmp_path / "tuned"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():  # a sparse set of large changes plus small noise everywhere
        generator = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 1e-4)
        model.model.layers[0].mlp.down_proj.weight[:, :4] += 0.05
    model.save_pretrained(tuned_dir)

    def cli(*args):
        """`trl-es ARGS` in this process: (exit status, stdout, stderr)."""
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as exit:  # argparse's errors
            code = exit.code
        return (code, *capsys.readouterr())

    delta = tmp_path / "delta.safetensors"
    code, out_text, err = cli("sparsify", "--base", tiny_model_dir, "--tuned", str(tuned_dir), "--tau", "1e-3",
                              "--out", str(delta))  # fmt: skip
    assert code == 0, err[-2000:]
    assert "kept 64 entries" in out_text and delta.stat().st_size < 4096  # 16 rows × 4 columns
    out = tmp_path / "rebuilt"
    code, _, err = cli("apply-delta", "--base", tiny_model_dir, "--delta", str(delta), "--out", str(out))
    assert code == 0, err[-2000:]
    rebuilt = dict(AutoModelForCausalLM.from_pretrained(out).named_parameters())
    base = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    tuned = dict(AutoModelForCausalLM.from_pretrained(tuned_dir).named_parameters())
    expected = thresholded(base, tuned, threshold_masks(base, tuned, tau=1e-3))
    assert all(torch.equal(rebuilt[name], expected[name]) for name in expected)
    code, _, err = cli("apply-delta", "--base", tiny_model_dir, "--delta", str(delta), "--out", str(out))
    assert code != 0 and "already exists" in err  # nothing overwritten
    code, _, err = cli("apply-delta", "--base", str(tuned_dir), "--delta", str(delta), "--out", str(tmp_path / "x"))
    assert code == 1 and "other base weights" in err
    assert not (tmp_path / "x").exists()


def test_trainer_writes_the_sparse_delta_and_its_statistics_at_save(tmp_path, tiny_model_dir, prompt_dataset):
    from helpers import es_config
    from transformers import AutoModelForCausalLM

    from trl_es import ESTrainer

    def length_reward(completion_ids, **kwargs):
        return [float(len(ids)) + sum(ids) % 7 for ids in completion_ids]

    args = es_config(tmp_path, sparse_delta_tau=0.01)
    trainer = ESTrainer(tiny_model_dir, length_reward, args=args, train_dataset=prompt_dataset)
    trainer.train()
    trainer.save_model()
    delta = tmp_path / "out" / "sparse_delta.safetensors"
    base = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    tuned = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "out").named_parameters())
    masks = threshold_masks(base, tuned, tau=0.01)
    assert 0 < sum(int(m.sum()) for m in masks.values()) < sum(m.numel() for m in masks.values())
    rebuilt = apply_delta(base, str(delta))
    expected = thresholded(base, tuned, masks)
    assert all(torch.equal(rebuilt[name], expected[name]) for name in expected)
    card = (tmp_path / "out" / "README.md").read_text()
    assert "sparse_delta.safetensors, τ = 0.01" in card and "s_τ (share of nonzero |Δ| ≤ 0.01)" in card
    with pytest.raises(ValueError, match="sparse_delta_tau"):
        es_config(tmp_path, sparse_delta_tau=-1.0)


@pytest.mark.slow
def test_sparsity_sweep_scores_thresholded_models_and_plots(tmp_path, tiny_model_dir, monkeypatch):
    import json

    from transformers import AutoModelForCausalLM

    from trl_es.commands.sweep import main as sweep

    tuned_dir = tmp_path / "tuned"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 2e-3)
    model.save_pretrained(tuned_dir)
    out = tmp_path / "sweep"
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    rows = sweep(
        [
            "--base",
            tiny_model_dir,
            "--tuned",
            str(tuned_dir),
            "--taus",
            "1e-3,4e-3",
            "--top",
            "0.01",
            "--out-dir",
            str(out),
        ]
    )
    assert [row["model"] for row in rows] == ["base", "tuned", "tau=0.001", "tau=0.004", "top_fraction=0.01"]
    kept = {row["model"]: row["kept"] for row in rows}
    assert 1 > kept["tau=0.001"] > kept["tau=0.004"] > 0 and kept["top_fraction=0.01"] == pytest.approx(0.01, rel=0.01)
    assert all(0 <= row["score"] <= 1 for row in rows)
    assert json.loads((out / "sweep.json").read_text())["rows"] == rows
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(private) == [] and set(os.listdir(out)) == {"sweep.json", "sweep.png"}  # nothing left behind


def test_the_old_module_path_keeps_working_with_a_deprecation_warning():
    """trl_es.research.sparse moved to trl_es.util.deltas (save_model writes deltas with it): the old import still
    gives the same functions, for one release, and says where they went."""
    import importlib
    import sys

    from trl_es.util import deltas

    sys.modules.pop("trl_es.research.sparse", None)
    with pytest.warns(DeprecationWarning, match="moved to trl_es.util.deltas"):
        old = importlib.import_module("trl_es.research.sparse")
    assert old.save_delta is deltas.save_delta and old.update_statistics is deltas.update_statistics
