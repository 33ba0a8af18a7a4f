"""Vocabularies that tp does not divide (dtrain.parallel.vocab): 1025 = 1024 + one added token, at
tp=2 on a 2x2 mesh, padded to 1026 rows. The training runs (tests/workers/vocab_runs.py) must give
the unpadded single-process Hugging Face model's losses, gradient norms and weights, untied with
the plain loss and tied with the chunked loss; resume from the padded checkpoint on another mesh;
and export folders that `from_pretrained` loads with 1025 rows and the trained model's logits."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dtrain.checks import check_config
from dtrain.config import ConfigError
from dtrain.model import build_meta_model, load_model_config
from dtrain.parallel.vocab import mask_padded_logits, padded_vocab_size
from tests.helpers import TINY, TOKENIZER, fixed_batch, parity_config, run_worker
from tests.test_parity import assert_matches_reference, reference_cache_dir, reference_run
from tests.tolerance import assert_logits_close, assert_scalar_close

VOCAB, PADDED = 1025, 1026  # the tokenizer's 1024 tokens and one added; tp=2 pads one row
RUNS = {"pad": "untied", "pad_tied_chunk": "tied"}  # the second with parallel.loss_chunk
STEPS, CHECKPOINT = 5, 3  # as in the worker


def test_padded_vocab_size_rounds_up_to_tp_or_keeps_the_checkpoints_rows(caplog):
    with caplog.at_level(logging.INFO, logger="dtrain"):
        assert padded_vocab_size(32001, 2) == 32002
    assert "vocab padded from 32001 to 32002 for tp=2" in caplog.text
    assert padded_vocab_size(1025, 4) == 1028
    assert padded_vocab_size(1024, 4) == 1024
    assert padded_vocab_size(1025, 1, saved=1026) == 1026  # resuming a tp=2 checkpoint on tp=1
    assert padded_vocab_size(1025, 2, saved=1024) == 1026  # another model's: its shape check says so
    with pytest.raises(ConfigError, match="padded to 1026 rows.*parallel.tp=4"):
        padded_vocab_size(1025, 4, saved=1026)


def test_config_check_accepts_a_vocab_tp_does_not_divide():
    config = parity_config(None, dp=1, tp=2)
    config.model.config["vocab_size"] = 32001
    assert check_config(config, 2, load_model_config(config.model)).tp == 2
    config.model.config["intermediate_size"] = 129  # the other divisibility checks stay
    with pytest.raises(ConfigError, match="intermediate_size=129"):
        check_config(config, 2, load_model_config(config.model))


@pytest.mark.parametrize("tied", [False, True])
def test_meta_model_is_padded_and_masks_the_padded_logits(tied):
    config = LlamaConfig(**{**TINY, "vocab_size": VOCAB}, tie_word_embeddings=tied)
    model = build_meta_model(config, vocab_rows=PADDED)
    assert model.config.vocab_size == VOCAB
    assert model.model.embed_tokens.weight.shape == model.lm_head.weight.shape == (PADDED, 64)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    logits = mask_padded_logits(torch.zeros(2, 3, PADDED), VOCAB)
    assert torch.isneginf(logits[..., VOCAB:]).all() and (logits[..., :VOCAB] == 0).all()


def save_model(folder, tied):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**TINY, "vocab_size": VOCAB}, tie_word_embeddings=tied)).save_pretrained(
        folder
    )
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab_models")
    return {kind: save_model(root / kind, kind == "tied") for kind in ("untied", "tied")}


@pytest.fixture(scope="module")
def out(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("vocab_runs")
    args = ["--out", str(out), "--untied", str(models["untied"]), "--tied", str(models["tied"])]
    result = run_worker(4, "vocab_runs", *args, timeout=400)
    assert result.returncode == 0, result.stdout[-6000:]
    return out


@pytest.fixture(scope="module")
def runs(out):
    return {path.stem: torch.load(path) for path in out.glob("*.pt")}


@pytest.fixture(scope="module")
def references(models, tmp_path_factory):
    cache = reference_cache_dir(tmp_path_factory)
    return {kind: reference_run(cache, path, STEPS) for kind, path in models.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_padded_training_matches_the_unpadded_hf_model(runs, references, name):
    reference = references[RUNS[name]]
    history, trained = runs[name]["history"], runs[name]["params"]
    assert len(history) == STEPS
    unpadded = {
        n: tensor[: reference["params"][n].shape[0]]
        for n, tensor in trained.items()
        if n in reference["params"]
    }
    assert_matches_reference(history, {**trained, **unpadded}, reference, name)
    for param_name in ("model.embed_tokens.weight", "lm_head.weight"):
        if param_name in trained:
            assert trained[param_name].shape[0] == PADDED
            assert (trained[param_name][VOCAB:] == 0).all(), f"{param_name}: padded rows moved"
    assert runs[name]["tied"] == (RUNS[name] == "tied")
    logits = runs[name]["logits"]
    assert logits.shape[-1] == PADDED and torch.isneginf(logits[..., VOCAB:]).all()


@pytest.mark.slow
def test_resume_from_the_padded_checkpoint_on_another_tp(runs):
    uninterrupted, resumed = runs["pad"]["history"], runs["resume_4x1"]["history"]
    assert [h["step"] for h in resumed] == list(range(CHECKPOINT + 1, STEPS + 1))
    for a, b in zip(uninterrupted[CHECKPOINT:], resumed, strict=True):
        assert_scalar_close(b["loss"], a["loss"], f"resume_4x1 step {b['step']} loss")


@pytest.mark.slow
@pytest.mark.parametrize(
    "folder,name", [("pad/hf", "pad"), ("pad_tied_chunk/hf", "pad_tied_chunk"), ("hf_checkpoint", "pad")]
)
def test_export_strips_the_padding_and_loads_in_transformers(out, runs, folder, name):
    model = AutoModelForCausalLM.from_pretrained(
        out / folder, dtype=torch.float32, attn_implementation="sdpa"
    )
    assert model.config.vocab_size == VOCAB
    assert model.model.embed_tokens.weight.shape[0] == model.lm_head.weight.shape[0] == VOCAB
    with torch.no_grad():
        logits = model(input_ids=fixed_batch()).logits
    assert_logits_close(logits, runs[name]["logits"][..., :VOCAB])


def test_planner_counts_the_padded_rows():
    from dtrain.estimate.planner import plan

    config = parity_config(None, dp=2, tp=2)
    config.model.config["vocab_size"] = VOCAB
    layers = plan(config, world_size=4).layers
    hidden = TINY["hidden_size"]
    for name in ("embedding", "lm_head"):
        assert layers[name]["total"] == PADDED * hidden * 4, name  # fp32 master weights
        # tp=2 splits the 1026 rows evenly (513 each), FSDP's dp=2 into 257 + 256 (its storage: 257)
        assert layers[name]["local"] == -(-(PADDED // 2) // 2) * hidden * 4, name
