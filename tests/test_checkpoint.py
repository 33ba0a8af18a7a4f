"""Checkpoints: exact resume, resharding to other meshes and world sizes, a save killed mid-write,
Hugging Face export round trip, and bad checkpoints (gloo, CPU)."""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dtrain.checkpoint import COMPLETE, find_resume_path
from dtrain.config import CheckpointConfig, ConfigError
from tests.helpers import fixed_batch, read_metrics, run, run_worker, save_tiny_llama, sft


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    untied = save_tiny_llama(root / "untied", tied=False, seed=1)
    tied = save_tiny_llama(root / "tied", tied=True, seed=2)
    save_tiny_llama(root / "sharded", tied=False, seed=3, max_shard_size="100KB")
    args = ["--out", str(root), "--untied", str(untied), "--tied", str(tied)]
    for nproc in (1, 4, 1):  # the first writes a 1×1 checkpoint the others resume (checkpoint_runs)
        result = run_worker(nproc, "checkpoint_runs", *args)
        assert result.returncode == 0, f"{nproc} processes:\n{result.stdout[-6000:]}"
    saved = {path.stem: torch.load(path) for path in root.glob("*.pt")}
    return root, saved


def losses(history, steps):
    return [h["loss"] for h in history if h["step"] in steps]


@pytest.mark.slow
def test_checkpoint_folder_is_complete(runs):
    root, _ = runs
    step4 = root / "checkpoints" / "step-00000004"
    assert (step4 / COMPLETE).is_file() and (step4 / ".metadata").is_file()
    marker = json.loads((step4 / COMPLETE).read_text())
    assert marker["step"] == 4 and marker["tokens"] > 0
    assert find_resume_path(CheckpointConfig(resume="auto"), root / "checkpoints").name == "step-00000008"


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,rtol,start",
    [
        ("resume_2x2", 1e-6, 4),
        ("resume_1x4", 1e-5, 4),
        ("resume_4x1", 1e-5, 4),
        ("resume_1x1", 1e-5, 4),
        # written without FSDP (plain tensors on 1×1, tp's DTensors on 1×4), read with it and back
        ("resume_2x2_from_1x1", 1e-5, 4),
        ("resume_1x4_from_1x1", 1e-5, 4),
        ("resume_2x2_from_1x4", 1e-5, 6),
        ("resume_1x1_from_1x4", 1e-5, 6),
    ],
)
def test_resume_continues_the_uninterrupted_curve(runs, name, rtol, start):
    """A checkpoint of step `start` (2×2's, 1×1's or 1×4's: see checkpoint_runs) resumed on another
    mesh continues the uninterrupted 2×2 run: loss, grad norm and learning rate of every later step."""
    _, saved = runs
    full = saved["full"]["history"]
    resumed = saved[name]["history"]
    assert [h["step"] for h in resumed] == list(range(start + 1, 9))
    assert losses(resumed, range(start + 1, 9)) == pytest.approx(losses(full, range(start + 1, 9)), rel=rtol)
    for a, b in zip(resumed, full[start:], strict=True):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=rtol)
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-12)  # the schedule resumed too


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_export_loads_in_transformers_with_the_same_logits(runs, kind):
    root, saved = runs
    folder = root / f"hf_{kind}"
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.dtype == torch.float32
    assert model.config.tie_word_embeddings == (kind == "tied")
    if kind == "tied":
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = fixed_batch()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    expected = saved["full" if kind == "untied" else "tied"]["logits"]
    assert ((logits - expected).abs().max() / expected.abs().max()).item() < 1e-5
    assert len(AutoTokenizer.from_pretrained(folder)) == 1024
    assert (folder / "generation_config.json").is_file()
    assert not (folder / "sharded").exists()


@pytest.mark.slow
def test_other_architecture_is_refused_naming_the_tensor(runs):
    _, saved = runs
    error = saved["other_arch"]["error"]
    assert error is not None
    assert "model.layers.0.mlp.gate_proj.weight" in error and "(128, 64)" in error and "(96, 64)" in error


def test_explicit_missing_or_incomplete_checkpoint_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="no such checkpoint folder"):
        find_resume_path(CheckpointConfig(resume=str(tmp_path / "nope")), tmp_path)
    (tmp_path / "step-00000003").mkdir()
    with pytest.raises(ConfigError, match="incomplete checkpoint"):
        find_resume_path(CheckpointConfig(resume=str(tmp_path / "step-00000003")), tmp_path)
    assert find_resume_path(CheckpointConfig(resume="auto"), tmp_path) is None


@pytest.mark.slow
def test_async_saves_keep_the_newest_and_resume_exactly(tmp_path):
    """checkpoint.async_save=true: the run keeps its newest two (checkpoint.keep=2), and one of them,
    named explicitly, resumes steps 5-6 as the saving run computed them. (A save killed mid-write:
    test_lifecycle.)"""
    args = ["parallel.tp=1", "train.max_steps=6", "train.log_every=1"]
    args.append("checkpoint.every=2")
    reference_dir = tmp_path / "reference"
    reference = sft(2, *args, "checkpoint.async_save=true", f"hydra.run.dir={reference_dir}")
    assert reference.returncode == 0, reference.stdout[-3000:]
    kept = sorted(p.name for p in (reference_dir / "checkpoints").iterdir())
    assert kept == ["step-00000004", "step-00000006"]  # checkpoint.keep=2
    expected = read_metrics(reference_dir)
    from_async = tmp_path / "from_async"
    step4 = reference_dir / "checkpoints" / "step-00000004"
    resumed = sft(2, *args, f"checkpoint.resume={step4}", f"hydra.run.dir={from_async}", timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    records = read_metrics(from_async)
    assert [r["step"] for r in records] == [5, 6]
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in expected[4:]], rel=1e-6)


@pytest.mark.slow
def test_export_cli_writes_a_loadable_folder(runs, tmp_path):
    root, saved = runs
    out = tmp_path / "exported"
    result = run(
        [sys.executable, "-m", "dtrain.export", str(root / "checkpoints" / "step-00000008"), str(out)]
    )
    assert result.returncode == 0, result.stdout[-3000:]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16  # the default export dtype
    ids = fixed_batch()
    with torch.no_grad():
        logits = model.float()(input_ids=ids).logits
    expected = saved["full"]["logits"]
    assert ((logits - expected).abs().max() / expected.abs().max()).item() < 0.05  # bf16 rounding only
    missing = run([sys.executable, "-m", "dtrain.export", str(Path(tmp_path) / "none"), str(out)])
    assert missing.returncode == 2 and "not a complete dtrain checkpoint" in missing.stdout


@pytest.mark.slow
def test_a_sharded_hf_folder_imports_slice_by_slice(runs):
    """save_pretrained with a small max_shard_size: several safetensors files and an index."""
    root, saved = runs
    folder = root / "sharded"
    assert len(list(folder.glob("*.safetensors"))) > 1 and (folder / "model.safetensors.index.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    ids = fixed_batch()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    assert ((saved["sharded_import"]["logits"] - expected).abs().max() / expected.abs().max()).item() < 1e-5


@pytest.mark.slow
def test_each_rank_reads_and_writes_only_its_slices(runs):
    """ "Each rank reads only its slices" (docs/models.md) and "every rank writes its shards"
    (docs/checkpoints.md) on 2×2, by what the files returned and what the write plans carried: on
    import each rank read exactly the elements of its own shard of every tensor, no more; on export
    each rank wrote at most its shard, and the ranks together wrote every element once."""
    _, saved = runs
    for rank, (reads, sizes) in enumerate(saved["sharded_import"]["reads"]):
        assert set(reads) == set(sizes), (rank, sorted(set(reads) ^ set(sizes)))
        for key, count in reads.items():
            local, whole = sizes[key]
            assert count == local < whole, (rank, key, count, local, whole)
    written = collections.Counter()
    for rank, (writes, sizes) in enumerate(saved["export_writes"]):
        assert set(writes) <= set(sizes), (rank, sorted(set(writes) - set(sizes)))
        for key, count in writes.items():
            assert count <= sizes[key][0], (rank, key, count, sizes[key])
        written.update(writes)
    sizes = saved["export_writes"][0][1]
    assert written == {key: whole for key, (_, whole) in sizes.items()}


@pytest.mark.slow
@pytest.mark.parametrize("key", ["seed", "shuffle"])
def test_a_resume_whose_seed_or_shuffle_differ_is_refused(runs, key):
    """train.seed=7 or data.shuffle=false against a checkpoint saved with seed 0, shuffled: the data
    order would not continue the saved one, so the loader's state is refused, naming the key."""
    _, saved = runs
    error = saved[f"changed_{key}"]["error"]
    checkpointed, now = {"seed": ("0", "7"), "shuffle": ("True", "False")}[key]
    assert error == (
        f"data loader state: {key}={checkpointed} in the checkpoint, {now} now; "
        "the data, packing, train.seed or data.shuffle changed since it was saved"
    )
