"""Numerics on every mesh against a single-process Hugging Face reference (fp32, gloo).

The mesh runs (tests/workers/mesh_runs.py) train through dtrain's real trainer on 1 and 4 processes
(1x4 and 4x1 stand for 1x2 and 2x1); the reference here is `from_pretrained` + a plain PyTorch loop
over the same global batches in one micro-batch, so accumulation, sharding and loss parallel must all
be exact.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from dtrain.parallel.context import local_token_indices
from tests import reference
from tests.helpers import (
    CROSS_RANK_TOKEN,
    FAMILIES,
    GLOBAL_BATCH,
    MAX_LEN,
    STEPS,
    cross_rank_row,
    fixed_batch,
    packed_documents,
    parity_config,
    run_worker,
    save_tiny_family,
    save_tiny_llama,
)
from tests.tolerance import assert_logits_close, assert_scalar_close, assert_weights_close

MESH_RUNS = {
    # 1x4 and 4x1 stand for 1x2 and 2x1; checkpointing's numerics are test_perf's (2x2)
    "untied": ["1x1", "2x2", "1x4", "4x1", "2x2_no_sp"],
    "tied": ["1x1_tied", "2x2_tied"],
    "packed": ["cp4", "cp2_tp2", "cp2_dp2"],  # context parallel, against HF on the unpacked documents
    **{family: [f"2x2_{family}"] for family in FAMILIES},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "untied": save_tiny_llama(root / "untied", tied=False),
        "tied": save_tiny_llama(root / "tied", tied=True),
        **{family: save_tiny_family(root / "families" / family, family) for family in FAMILIES},
    }


@pytest.fixture(scope="module")
def mesh_runs(models, tmp_path_factory):
    """All scenarios: one launch per world size, each sharing its process group across scenarios."""
    out = tmp_path_factory.mktemp("mesh_runs")
    for nproc in (1, 4):
        args = ["--out", str(out), "--untied", str(models["untied"]), "--tied", str(models["tied"])]
        args += ["--families", str(models["qwen2"].parent)]
        result = run_worker(nproc, "mesh_runs", *args, timeout=1200)
        assert result.returncode == 0, f"{nproc} processes:\n{result.stdout[-6000:]}"
    return {path.stem: torch.load(path) for path in out.glob("*.pt")}


def reference_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the HF reference runs are cached: one folder for the whole pytest session, its xdist
    workers included (each worker's basetemp is a folder of the session's own)."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "hf-references"


def reference_run(
    cache_dir: Path,
    model_dir: Path,
    steps: int = STEPS,
    packed: bool = False,
    micro_batch: int | None = None,
    attention_mask: bool = False,
) -> dict:
    """The parity run in tests/reference.py (independent of dtrain, data included): the config's
    numbers only, read from parity_config. {"losses", "norms", "params"}. A mixture of experts with
    HF's aux loss: `micro_batch` and `attention_mask` as reference.Recipe's."""
    config = parity_config(model_dir, dp=1, tp=1)
    data = reference.Data(
        path=Path(config.data.path),
        tokenizer=Path(model_dir),  # dtrain reads the model folder's tokenizer (no model.tokenizer)
        max_len=config.data.max_len,
        packing=packed,
        seed=config.train.seed,
        shuffle=config.data.shuffle,
    )
    optim = config.optim
    recipe = reference.Recipe(
        steps=steps,
        global_batch=config.train.global_batch_size,
        lr=optim.lr,
        betas=tuple(optim.betas),
        eps=optim.eps,
        weight_decay=optim.weight_decay,
        warmup_steps=optim.warmup_steps,
        max_grad_norm=optim.max_grad_norm,
        micro_batch=micro_batch,
        attention_mask=attention_mask,
    )
    return reference.cached_run(cache_dir, Path(model_dir), data, recipe)


@pytest.fixture(scope="module")
def references(models, tmp_path_factory):
    cache = reference_cache_dir(tmp_path_factory)
    runs = {kind: reference_run(cache, path) for kind, path in models.items()}
    runs["packed"] = reference_run(cache, models["untied"], packed=True)
    return runs


def documents(batch: list[reference.Row]) -> list[tuple[int, int, int]]:
    """(row, start, stop) of every document of a global batch, as the reference packed them."""
    return [(index, start, stop) for index, row in enumerate(batch) for start, stop in row.spans]


@pytest.mark.slow  # renders the 4000 records
def test_packed_documents_cross_the_cp_chunk_borders(models):
    """What the cp runs must get right: documents that span several ranks' chunks (the first global
    batch of the packed stream; test_reference_data shows dtrain's is the same)."""
    config = parity_config(models["untied"], dp=1, tp=1)
    data = reference.Data(
        path=Path(config.data.path), tokenizer=models["untied"], max_len=MAX_LEN, packing=True
    )
    batch = next(reference.stream(data, GLOBAL_BATCH))
    chunk = MAX_LEN // 8  # cp = 4: 8 chunks per row
    crossing = [span for span in documents(batch) if span[1] // chunk != (span[2] - 1) // chunk]
    assert len(crossing) >= GLOBAL_BATCH, documents(batch)
    assert any(row_docs > 1 for row_docs in torch.bincount(torch.tensor([s[0] for s in documents(batch)])))


@pytest.mark.slow
def test_cp_rank_zero_attends_to_the_tokens_the_other_ranks_hold(models, mesh_runs):
    """At cp = 4, rank 0's own summed loss on one row (its chunks 0 and 7) is HF's on the whole row
    at those tokens, and it moves when a token only rank 3 holds changes; attending to rank 0's own
    tokens alone (HF on just those tokens, at their global positions) gives another loss."""
    model = AutoModelForCausalLM.from_pretrained(
        models["untied"], dtype=torch.float32, attn_implementation="sdpa"
    )
    model.load_state_dict(mesh_runs["cp4"]["params"])  # the cp run's trained weights
    # The load-balanced layout (design: rank r holds chunks r and 2·cp-1-r of 2·cp): rank 0 holds
    # tokens 0-3 and 28-31, so the changed token is one it does not hold.
    chunk = MAX_LEN // 8
    index = torch.cat([torch.arange(0, chunk), torch.arange(7 * chunk, 8 * chunk)])
    assert torch.equal(local_token_indices(MAX_LEN, cp=4, rank=0), index)
    assert CROSS_RANK_TOKEN not in index.tolist()
    whole_row = []
    with torch.no_grad():
        for batch in cross_rank_row():
            logits = model(input_ids=batch["input_ids"]).logits[0]
            losses = F.cross_entropy(
                logits, batch["labels"][0], ignore_index=reference.IGNORE, reduction="none"
            )
            whole_row.append(losses[index].sum().item())
        # rank 0's tokens alone at their global positions: what it would compute without the gather
        batch = cross_rank_row()[0]
        own = model(input_ids=batch["input_ids"][:, index], position_ids=index[None]).logits[0]
        local_only = F.cross_entropy(own, batch["labels"][0, index], reduction="sum").item()
    cp_losses = mesh_runs["cp4"]["cp_rank_losses"]
    # The tiny model attends almost uniformly, so the effects are small (~1e-4 of the loss), but
    # each is many times the float noise of one fp32 forward (~1e-7), which 1e-6 here allows.
    assert cp_losses == pytest.approx(whole_row, rel=1e-6)
    reach = whole_row[1] - whole_row[0]
    assert abs(reach) > 1e-5 * whole_row[0]  # rank 3's token reaches rank 0's loss ...
    assert cp_losses[1] - cp_losses[0] == pytest.approx(reach, rel=1e-2)  # ... in the cp run too
    assert abs(cp_losses[0] - local_only) > 1e-5 * local_only  # ... which attends beyond its own tokens


def assert_matches_reference(history: list[dict], trained: dict, ref: dict, run: str) -> None:
    """Every logged loss and grad norm within RTOL, every final weight element within RTOL of itself
    plus the AdamW allowance the reference sized for it (tests/tolerance.py; tests/README.md, "The
    error model"): one rule for every family and mesh."""
    assert [h["step"] for h in history] == list(range(1, len(ref["losses"]) + 1))
    assert ref["losses"][-1] < ref["losses"][0]  # the reference itself learns: the comparison is not vacuous
    for step, (record, loss, norm) in enumerate(
        zip(history, ref["losses"], ref["norms"], strict=True), start=1
    ):
        assert_scalar_close(record["loss"], loss, f"{run} step {step} loss")
        assert_scalar_close(record["grad_norm"], norm, f"{run} step {step} grad norm")
    assert_weights_close(trained, ref["params"], ref["allowance"], run)


@pytest.mark.slow
@pytest.mark.parametrize("kind,name", [(k, n) for k, names in MESH_RUNS.items() for n in names])
def test_loss_grad_norm_and_weights_match_single_process_hf(mesh_runs, references, kind, name):
    assert_matches_reference(mesh_runs[name]["history"], mesh_runs[name]["params"], references[kind], name)


@pytest.mark.slow
@pytest.mark.parametrize("kind,name", [("untied", "2x2"), ("tied", "2x2_tied")])
def test_loaded_checkpoint_gives_from_pretrained_logits(models, mesh_runs, kind, name):
    model = AutoModelForCausalLM.from_pretrained(
        models[kind], dtype=torch.float32, attn_implementation="sdpa"
    )
    ids = fixed_batch()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    assert_logits_close(mesh_runs[name]["logits"], expected)


@pytest.mark.slow
def test_tied_embeddings_stay_tied(mesh_runs):
    for name in MESH_RUNS["tied"]:
        assert "lm_head.weight" not in mesh_runs[name]["params"], name  # one shared parameter


@pytest.mark.slow
def test_random_init_is_the_same_on_every_mesh(mesh_runs):
    single, sharded = mesh_runs["1x1_random"], mesh_runs["2x2_random"]
    assert set(single["init"]) == set(sharded["init"])
    for name, tensor in single["init"].items():
        assert torch.equal(tensor, sharded["init"][name]), name
    std = single["init"]["model.layers.0.mlp.up_proj.weight"].std().item()
    assert 0.015 < std < 0.025  # HF Llama's initializer_range 0.02, not zeros or garbage
    for a, b in zip(single["history"], sharded["history"], strict=True):
        assert_scalar_close(b["loss"], a["loss"], f"random init: 2x2 step {b['step']} loss")


@pytest.mark.slow
def test_bf16_tracks_fp32_and_keeps_fp32_master_weights(mesh_runs, references):
    """bf16 compute cannot match to 1e-5; it must stay close and train the same model."""
    losses, params = references["untied"]["losses"], references["untied"]["params"]
    history = mesh_runs["2x2_bf16"]["history"]
    for record, loss in zip(history, losses, strict=True):
        assert record["loss"] == pytest.approx(loss, rel=2e-2)
    trained = mesh_runs["2x2_bf16"]["params"]
    assert all(tensor.dtype == torch.float32 for tensor in trained.values())
    name = "model.layers.1.mlp.down_proj.weight"
    assert (trained[name] - params[name]).norm() < 0.05 * params[name].norm()


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_of_the_trained_family_gives_its_logits_in_transformers(mesh_runs, family):
    """Exported at the end of the 2x2 run: from_pretrained reads the HF layout (Phi-3's fused
    projections included) and computes the trained model's logits."""
    run = mesh_runs[f"2x2_{family}"]
    model = AutoModelForCausalLM.from_pretrained(run["hf"], dtype=torch.float32, attn_implementation="sdpa")
    written = set().union(*(safe_open(f, "pt").keys() for f in Path(run["hf"]).glob("*.safetensors")))
    expected = set(model.state_dict()) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    assert written == expected  # HF's own names and layout: nothing missing for from_pretrained to init
    with torch.no_grad():
        logits = model(input_ids=fixed_batch()).logits
    assert_logits_close(logits, run["trained_logits"])


@pytest.mark.slow
def test_gemma3_packed_rows_with_a_short_window_match_hf_on_each_document(models, mesh_runs):
    """tp=2, packed: every document longer than the sliding window; HF's own sliding-window
    attention (sdpa, its mask) on each document alone is the reference."""
    model = AutoModelForCausalLM.from_pretrained(
        models["gemma3_text"], dtype=torch.float32, attn_implementation="sdpa"
    )
    assert model.config.sliding_window < 11  # the documents below are longer
    ids, positions = packed_documents()
    packed = mesh_runs["2x2_gemma3_text"]["packed_logits"][0]
    starts = (positions[0] == 0).nonzero().flatten().tolist() + [positions.shape[-1]]
    for start, stop in zip(starts[:-1], starts[1:], strict=True):
        with torch.no_grad():
            alone = model(input_ids=ids[:, start:stop], use_cache=False).logits[0]
        assert_logits_close(packed[start:stop], alone, f"document {start}:{stop}")


@pytest.mark.slow
def test_olmo2_whole_width_q_norm_at_tp2_is_the_unsharded_norm(models, mesh_runs):
    """Layer 0's q_norm output at tp=2 (each rank: half the columns) against HF's unsharded one; a
    norm over each rank's columns alone (computed here from HF's q_proj output) is far from it."""
    model = AutoModelForCausalLM.from_pretrained(
        models["olmo2"], dtype=torch.float32, attn_implementation="sdpa"
    )
    attention = model.model.layers[0].self_attn
    seen = {}
    attention.q_proj.register_forward_hook(lambda module, args, output: seen.update(q=output))
    attention.q_norm.register_forward_hook(lambda module, args, output: seen.update(normed=output))
    with torch.no_grad():
        model(input_ids=fixed_batch())
    assert_logits_close(mesh_runs["2x2_olmo2"]["q_norm"], seen["normed"], "q_norm")
    halves = zip(seen["q"].chunk(2, dim=-1), attention.q_norm.weight.chunk(2), strict=True)
    per_rank = torch.cat([w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) for x, w in halves], -1)
    assert (per_rank - seen["normed"]).abs().max() > 1e-3 * seen["normed"].abs().max()
