"""The 8-process meshes on CPU with gloo: HSDP (parallel.dp_replicate > 1, the 3-D mesh dp_replicate,
dp_shard, tp), context parallel (dp 2 × cp 2 × tp 2, packed rows) and a mixture of experts at
dp_shard 4 × tp 2 with ep 2 (experts split over ep, FSDP-sharded over efsdp 2, replicated over tp)
match the single-process Hugging Face reference; checkpoints reshard from HSDP to plain FSDP and back,
and from cp 2 to cp 4 and cp 1, continuing the uninterrupted curve; the TP coverage check refuses a
Linear no plan names.

All 8-process work is one launch of 8 ranks (tests/workers/hsdp_runs.py, helpers.run_worker)."""

from __future__ import annotations

import os

import pytest
import torch

from dtrain.checks import mesh_shape
from dtrain.config import ConfigError, MeshShape, ParallelConfig
from tests.helpers import STEPS, run_worker, save_tiny_llama, save_tiny_moe
from tests.test_parity import assert_matches_reference, reference_cache_dir, reference_run
from tests.tolerance import assert_scalar_close


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hsdp_models")
    # test_moe's model (the same seed, so the same files and the same cached reference)
    return {"untied": save_tiny_llama(root / "untied", tied=False), "moe": save_tiny_moe(root / "moe")}


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("hsdp_runs")
    args = ["--out", str(out), "--untied", str(models["untied"]), "--moe", str(models["moe"])]
    # while developing: DTRAIN_HSDP_ONLY=moe (or dense) runs only those scenarios (the other tests fail)
    args += ["--only", os.environ.get("DTRAIN_HSDP_ONLY", "")]
    result = run_worker(8, "hsdp_runs", *args, timeout=1200)
    assert result.returncode == 0, f"8 processes:\n{result.stdout[-6000:]}"
    return {path.stem: torch.load(path) for path in out.glob("*.pt")}


@pytest.fixture(scope="module")
def references(models, tmp_path_factory):
    """test_parity's untied and packed references and test_moe's (the same models, saved with the
    same seeds): read from the session's cache when those tests computed them first (the cache key is
    the files' bytes, the data and the recipe)."""
    cache = reference_cache_dir(tmp_path_factory)
    return {
        "untied": reference_run(cache, models["untied"]),
        "packed": reference_run(cache, models["untied"], packed=True),
        "moe": reference_run(cache, models["moe"]),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name,kind", [("hsdp", "untied"), ("cp", "packed")])
def test_2x2x2_matches_single_process_hf(runs, references, name, kind):
    """HSDP 2×2×2 (dp_replicate, dp_shard, tp) on plain rows, and dp 2 × cp 2 × tp 2 on packed rows
    against HF run document by document, at test_parity's tolerances."""
    assert len(runs[name]["history"]) == STEPS
    assert_matches_reference(runs[name]["history"], runs[name]["params"], references[kind], name)


@pytest.mark.slow
def test_experts_over_efsdp_ep_and_tp_match_single_process_hf(runs, references):
    """The tiny Qwen3-MoE (8 experts, top-2, HF's aux loss on) at dp_shard 4 × tp 2 with ep 2, 10
    steps (test_moe's config: one micro-batch a step here; test_moe's ep2_tp2 accumulates): every
    step's loss (with the aux loss), aux loss and grad norm and the final weights against
    `from_pretrained` + a plain loop with HF's aux_loss, as in test_moe. The worker asserted the
    sharding: experts Shard(0) over ep, sharded over efsdp 2, replicated over tp
    (check_expert_sharding), the dense parameters over dp_shard 4 and tp 2 (check_sharding)."""
    run, ref = runs["moe"], references["moe"]
    assert len(run["history"]) == STEPS
    assert_matches_reference(run["history"], run["params"], ref, "efsdp2_ep2_tp2")
    assert ref["aux_losses"][0] > 1.0  # top-2 of 8: about 2 when balanced; a real share of the loss
    for record, aux in zip(run["history"], ref["aux_losses"], strict=True):
        assert_scalar_close(record["aux_loss"], aux, f"step {record['step']} aux loss")


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,steps,full_run",
    [
        ("resume_fsdp", range(5, STEPS + 1), "hsdp"),
        ("resume_hsdp", (9, 10), "hsdp"),
        ("resume_cp4", (9, 10), "cp"),
        ("resume_cp1", (9, 10), "cp"),
    ],
)
def test_checkpoint_reshards_between_meshes(runs, name, steps, full_run):
    """hsdp (2×2×2) step 4 → FSDP 4×2 (resume_fsdp) step 8 → HSDP 2×4×1 (resume_hsdp); cp (dp 2 ×
    cp 2 × tp 2) step 8 → cp 4 (resume_cp4) and → cp 1 (resume_cp1): the uninterrupted curve."""
    full = {h["step"]: h for h in runs[full_run]["history"]}
    resumed = runs[name]["history"]
    assert [h["step"] for h in resumed] == list(steps)
    for record in resumed:
        expected = full[record["step"]]
        assert_scalar_close(record["loss"], expected["loss"], f"{name} step {record['step']} loss")
        assert_scalar_close(record["grad_norm"], expected["grad_norm"], f"{name} step {record['step']} norm")
        assert record["lr"] == pytest.approx(expected["lr"], rel=1e-12)


@pytest.mark.slow
def test_unplanned_linear_is_refused_by_the_coverage_check(runs):
    error = runs["unplanned"]["error"]
    assert error is not None, "parallelize accepted a Linear that no TP style covers"
    assert "model.layers.1.mlp.extra_proj.weight" in error and "model.layers.1.mlp.extra_proj.bias" in error
    assert "gate_proj" not in error  # only the unplanned module is named


def test_mesh_shape_with_dp_replicate():
    assert mesh_shape(ParallelConfig(tp=2, dp_replicate=2), 8) == MeshShape(2, 2, 1, 2)
    assert mesh_shape(ParallelConfig(tp=1, dp_shard=2, dp_replicate=4), 8) == MeshShape(4, 2, 1, 1)
    with pytest.raises(ConfigError, match=r"parallel\.tp=2 × parallel\.dp_replicate=3 does not divide"):
        mesh_shape(ParallelConfig(tp=2, dp_replicate=3), 8)
    with pytest.raises(ConfigError, match=r"tp=2 × parallel\.dp_replicate=3 × parallel\.dp_shard=2 = 12,"):
        mesh_shape(ParallelConfig(tp=2, dp_shard=2, dp_replicate=3), 8)
    # only the axes above 1 are named
    with pytest.raises(ConfigError, match=r"^parallel\.tp=2 × parallel\.cp=3 does not divide"):
        mesh_shape(ParallelConfig(tp=2, cp=3), 8)
    with pytest.raises(ConfigError, match=r"parallel\.dp_replicate=0: must be >= 1"):
        mesh_shape(ParallelConfig(tp=2, dp_replicate=0), 8)
