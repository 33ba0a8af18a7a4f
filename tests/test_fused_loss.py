"""parallel.loss_impl=fused (dtrain/fused_loss.py): the autograd function's gradients against
autograd through the dense loss, and dtrain's training against loss_impl=dense over 5 steps, on
1×1, 2×2 and tied 2×2 with a padded vocabulary (tests/workers/fused_runs.py); the planner's
memory figures for the motivating run's head and loss. Through the CLI: test_estimate's
auto-against-dense sweep (auto is fused for the embedded default) and test_cli's refusal of an
unknown loss_impl."""

from __future__ import annotations

import pytest

from dtrain.checks import check_config
from dtrain.config import ConfigError
from dtrain.estimate.app import compose
from dtrain.estimate.planner import plan
from dtrain.model import load_model_config
from tests.helpers import parity_config, run_worker, worker

WORKER = worker("fused_runs")
# The memory constant (docs/estimate.md): the loss's temporaries are at most this many fp32 logits
# chunks (rows × local vocabulary × 4 bytes).
CHUNKS_OF_LOGITS = 2


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 4], ids=["1x1", "2x2+tied2x2"])
def test_fused_loss_matches_the_dense_loss(tmp_path, nproc):
    done = tmp_path / "done"
    result = run_worker(nproc, "fused_runs", "--done", str(done), timeout=400)
    assert result.returncode == 0 and done.exists(), result.stdout[-6000:]


@pytest.mark.parametrize("impl", ["chunked", "fused"])
def test_chunked_losses_need_a_chunk(impl):
    config = parity_config(None, dp=1, tp=1)
    config.parallel.loss_impl, config.parallel.loss_chunk = impl, 0
    with pytest.raises(
        ConfigError, match=f"parallel.loss_chunk=0: must be >= 1 with parallel.loss_impl={impl}"
    ):
        check_config(config, 1, load_model_config(config.model))


@pytest.mark.parametrize("impl", ["chunked", "fused"])
def test_chunked_losses_refuse_a_family_whose_head_they_do_not_know(impl):
    """gpt_neox trains FSDP-only with the dense loss: its head is embed_out, not lm_head."""
    config = parity_config(None, dp=1, tp=1)
    config.model.config = dict(config.model.config, model_type="gpt_neox")
    config.parallel.loss_impl = impl
    model_config = load_model_config(config.model)
    with pytest.raises(ConfigError, match=f"parallel.loss_impl={impl}: .*'gpt_neox' trains with"):
        check_config(config, 1, model_config)
    config.parallel.loss_impl = "dense"
    check_config(config, 1, model_config)


@pytest.mark.slow
def test_planner_fused_peak_and_loss_temporaries_on_the_motivating_head():
    """The motivating run (Llama-3-8B, tp=4, micro batch 4 × 2048, bf16, full checkpointing) with 2
    of its 32 layers (the loss sees the same hidden states, head and labels; the plan is 15× cheaper):
    the fused peak is below the dense one, and the fused loss's temporaries are at most
    CHUNKS_OF_LOGITS fp32 chunks of logits and the head shard in bf16: tp alone has no FSDP to gather
    the weights in bf16, so the loss casts the fp32 shard under autocast (fused_loss._local_operands)."""
    overrides = ["+experiment=llama3_tp4", "estimate.world_size=4", "+model.config.num_hidden_layers=2"]
    dense = plan(compose([*overrides, "parallel.loss_impl=dense"]), 4)
    fused = plan(compose([*overrides, "parallel.loss_impl=fused"]), 4)
    assert fused.step.peak < dense.step.peak, (fused.step.peak, dense.step.peak)
    assert dense.step.loss_temporaries is None and fused.step.logits == 0
    config = compose(overrides)
    tp, chunk = config.parallel.tp, config.parallel.loss_chunk
    rows = config.train.micro_batch_size * min(chunk, config.data.max_len // tp) * tp  # gathered chunk
    hidden_size = load_model_config(config.model, offline=True).hidden_size
    local_vocab = fused.layers["lm_head"]["total"] // (4 * hidden_size) // tp
    logits_chunk = rows * local_vocab * 4
    head_copy = local_vocab * hidden_size * 2
    assert logits_chunk < fused.step.loss_temporaries <= CHUNKS_OF_LOGITS * logits_chunk + head_copy, (
        fused.step.loss_temporaries / logits_chunk
    )


@pytest.mark.parametrize("impl", ["chunked", "fused"])
def test_chunked_losses_refuse_post_processed_logits(impl):
    """Granite divides its logits by logits_scaling after lm_head, which lm_head(hidden) would skip."""
    config = parity_config(None, dp=1, tp=1)
    config.model.config = dict(config.model.config, model_type="granite", logits_scaling=16.0)
    config.parallel.loss_impl = impl
    model_config = load_model_config(config.model)
    with pytest.raises(ConfigError, match="logits_scaling=16.0 post-processes the logits"):
        check_config(config, 1, model_config)
    config.parallel.loss_impl = "dense"
    check_config(config, 1, model_config)
