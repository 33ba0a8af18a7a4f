"""Numerics on every mesh against a single-process Hugging Face reference (fp32, gloo).

The mesh runs (tests/workers/mesh_runs.py) train through dtrain's real trainer on 1 and 4 processes
(1x4 and 4x1 stand for 1x2 and 2x1); the reference here is `from_pretrained` + a plain PyTorch loop
over the same global batches in one micro-batch, so accumulation, sharding and loss parallel must all
be exact.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, get_scheduler

from dtrain.config import TrainConfig
from dtrain.data.pipeline import build_data
from dtrain.loss import IGNORE
from dtrain.parallel.context import local_token_indices
from tests.helpers import (
    FAMILIES,
    GLOBAL_BATCH,
    MAX_LEN,
    STEPS,
    TOKENIZER,
    cross_rank_row,
    fixed_batch,
    packed_documents,
    parity_config,
    save_tiny_family,
    save_tiny_llama,
    torchrun,
    worker,
)

RTOL = 1e-5
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
    """All scenarios: one torchrun per world size, each sharing its process group across scenarios."""
    out = tmp_path_factory.mktemp("mesh_runs")
    for nproc in (1, 4):
        args = ["--out", str(out), "--untied", str(models["untied"]), "--tied", str(models["tied"])]
        args += ["--families", str(models["qwen2"].parent)]
        result = torchrun(nproc, *worker("mesh_runs"), *args, timeout=400)
        assert result.returncode == 0, f"{nproc} processes:\n{result.stdout[-6000:]}"
    return {path.stem: torch.load(path) for path in out.glob("*.pt")}


def reference_run(model_dir, steps: int = STEPS, packed: bool = False):
    """Single process, plain HF model and torch AdamW, one micro-batch of the whole global batch.
    Packed rows are run document by document (HF's sdpa attends across a row's documents)."""
    config = parity_config(model_dir, dp=1, tp=1)
    config.data.packing = packed
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
        lr=config.optim.lr,
        betas=config.optim.betas,
        eps=config.optim.eps,
    )
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=2, num_training_steps=steps)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    # dtrain's loader gives the global batches (the stream is mesh-independent: see test_data.py).
    one_batch = TrainConfig(
        global_batch_size=GLOBAL_BATCH, micro_batch_size=GLOBAL_BATCH, seed=config.train.seed
    )
    batches = build_data(config.data, one_batch, tokenizer, dp_rank=0, dp_size=1).train
    losses, norms = [], []
    for _ in range(steps):
        (batch,) = batches.next_step()
        if packed:
            loss = unpacked_summed_loss(model, batch) / (batch["labels"] != IGNORE).sum()
        else:
            logits = model(input_ids=batch["input_ids"], use_cache=False).logits
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        losses.append(loss.item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return losses, norms, dict(model.named_parameters())


def documents(batch: dict) -> list[tuple[int, int, int]]:
    """(row, start, stop) of every document of a packed batch: each starts where position_ids is 0,
    the last one of a row stops at its filled length."""
    spans = []
    for row, (positions, filled) in enumerate(zip(batch["position_ids"], batch["num_tokens"], strict=True)):
        starts = (positions == 0).nonzero().flatten().tolist()
        stops = [*starts[1:], int(filled)]
        spans += [(row, start, stop) for start, stop in zip(starts, stops, strict=True) if start < stop]
    return spans


def unpacked_summed_loss(model, batch: dict) -> torch.Tensor:
    total = torch.zeros(())
    for row, start, stop in documents(batch):
        logits = model(input_ids=batch["input_ids"][row : row + 1, start:stop], use_cache=False).logits
        labels = batch["labels"][row, start:stop]
        total = total + F.cross_entropy(logits[0], labels, ignore_index=IGNORE, reduction="sum")
    return total


@pytest.fixture(scope="module")
def references(models):
    runs = {kind: reference_run(path) for kind, path in models.items()}
    runs["packed"] = reference_run(models["untied"], packed=True)
    return runs


def test_packed_documents_cross_the_cp_chunk_borders(models):
    """What the cp runs must get right: documents that span several ranks' chunks."""
    config = parity_config(models["untied"], dp=1, tp=1)
    config.data.packing = True
    one_batch = TrainConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=GLOBAL_BATCH)
    batch = build_data(
        config.data, one_batch, AutoTokenizer.from_pretrained(TOKENIZER), 0, 1
    ).train.next_step()[0]
    chunk = config.data.max_len // 8  # cp = 4: 8 chunks per row
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
    index = local_token_indices(MAX_LEN, cp=4, rank=0)
    whole_row, local_only = [], []
    with torch.no_grad():
        for batch in cross_rank_row():
            logits = model(input_ids=batch["input_ids"]).logits[0]
            losses = F.cross_entropy(logits, batch["labels"][0], ignore_index=IGNORE, reduction="none")
            whole_row.append(losses[index].sum().item())
            own = model(input_ids=batch["input_ids"][:, index], position_ids=index[None]).logits[0]
            local_only.append(F.cross_entropy(own, batch["labels"][0, index], reduction="sum").item())
    cp_losses = mesh_runs["cp4"]["cp_rank_losses"]
    # The tiny model attends almost uniformly, so the effects are small (~1e-4 of the loss), but
    # each is many times the float noise of one fp32 forward (~1e-7), which 1e-6 here allows.
    assert cp_losses == pytest.approx(whole_row, rel=1e-6)
    reach = whole_row[1] - whole_row[0]
    assert abs(reach) > 1e-5 * whole_row[0]  # rank 3's token reaches rank 0's loss ...
    assert cp_losses[1] - cp_losses[0] == pytest.approx(reach, rel=1e-2)  # ... in the cp run too
    assert local_only[1] == local_only[0]  # ... and cannot without the gather
    assert abs(cp_losses[0] - local_only[0]) > 1e-5 * local_only[0]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@pytest.mark.slow
@pytest.mark.parametrize("kind,name", [(k, n) for k, names in MESH_RUNS.items() for n in names])
def test_loss_grad_norm_and_weights_match_single_process_hf(mesh_runs, references, kind, name):
    losses, norms, params = references[kind]
    history = mesh_runs[name]["history"]
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    assert losses[-1] < losses[0]  # the reference itself learns: the comparison is not vacuous
    for step, (record, loss, norm) in enumerate(zip(history, losses, norms, strict=True), start=1):
        assert record["loss"] == pytest.approx(loss, rel=RTOL), f"{name} step {step} loss"
        assert record["grad_norm"] == pytest.approx(norm, rel=RTOL), f"{name} step {step} grad norm"
    trained = mesh_runs[name]["params"]
    assert set(trained) == set(params)
    # The other families' weights get 1e-4: AdamW turns float noise on gradients that are zero in
    # exact arithmetic (k_proj's bias: softmax ignores a shift shared by all keys) into lr-sized steps.
    # The packed reference forwards each document on its own (another summation order): AdamW turns
    # the float noise on the near-zero gradients of rarely seen tokens' embedding rows into ~1e-6
    # steps, 1-2e-5 of the largest weight; every other tensor stays within 1e-5.
    weight_rtol = RTOL if kind in ("untied", "tied", "packed") else 1e-4
    for param_name, param in params.items():
        rtol = 5e-5 if kind == "packed" and "embed_tokens" in param_name else weight_rtol
        assert relative_error(trained[param_name], param.detach()) < rtol, param_name


@pytest.mark.slow
@pytest.mark.parametrize("kind,name", [("untied", "2x2"), ("tied", "2x2_tied")])
def test_loaded_checkpoint_gives_from_pretrained_logits(models, mesh_runs, kind, name):
    model = AutoModelForCausalLM.from_pretrained(
        models[kind], dtype=torch.float32, attn_implementation="sdpa"
    )
    ids = fixed_batch()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    assert relative_error(mesh_runs[name]["logits"], expected) < RTOL


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
        assert a["loss"] == pytest.approx(b["loss"], rel=RTOL)


@pytest.mark.slow
def test_bf16_tracks_fp32_and_keeps_fp32_master_weights(mesh_runs, references):
    """bf16 compute cannot match to 1e-5; it must stay close and train the same model."""
    losses, _, params = references["untied"]
    history = mesh_runs["2x2_bf16"]["history"]
    for record, loss in zip(history, losses, strict=True):
        assert record["loss"] == pytest.approx(loss, rel=2e-2)
    trained = mesh_runs["2x2_bf16"]["params"]
    assert all(tensor.dtype == torch.float32 for tensor in trained.values())
    name = "model.layers.1.mlp.down_proj.weight"
    assert relative_error(trained[name], params[name].detach()) < 0.05


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
    assert relative_error(logits, run["trained_logits"]) < RTOL


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
        assert relative_error(packed[start:stop], alone) < RTOL, (start, stop)


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
    assert relative_error(mesh_runs["2x2_olmo2"]["q_norm"], seen["normed"]) < RTOL
    halves = zip(seen["q"].chunk(2, dim=-1), attention.q_norm.weight.chunk(2), strict=True)
    per_rank = torch.cat([w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) for x, w in halves], -1)
    assert relative_error(per_rank, seen["normed"]) > 1e-3
