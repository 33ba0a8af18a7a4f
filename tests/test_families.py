"""Single-process checks of the family support: dtrain's sliding-window mask is HF's, and the CUDA
path (flex attention with a block mask) computes what the sdpa path does, for windows with and
without packed rows. The families' numerics on the 2x2 mesh are test_parity's."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig
from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay

from dtrain.attention import dense_mask, set_backend
from dtrain.model import allocate, build_meta_model, init_weights
from tests.helpers import FAMILIES, MAX_LEN, TINY
from tests.tolerance import assert_logits_close


def hf_window_mask(seq: int, window: int) -> torch.Tensor:
    """HF's sliding-window causal mask, evaluated on every (query, key) pair from its own functions."""
    allowed = and_masks(sliding_window_overlay(window), causal_mask_function)
    index = torch.arange(seq)
    zero = torch.tensor(0)
    return allowed(zero, zero, index[:, None], index[None, :]).expand(seq, seq)


@pytest.mark.parametrize("window", [1, 3, 8])
def test_window_mask_is_hf_sliding_window_causal_mask(window):
    positions = torch.arange(12)[None]
    assert torch.equal(dense_mask(positions, packed=False, window=window)[0, 0], hf_window_mask(12, window))
    # packed: the window within each document, nothing across documents
    packed = dense_mask(torch.cat([torch.arange(7), torch.arange(5)])[None], packed=True, window=window)[0, 0]
    expected = torch.zeros(12, 12, dtype=torch.bool)
    expected[:7, :7], expected[7:, 7:] = hf_window_mask(7, window), hf_window_mask(5, window)
    assert torch.equal(packed, expected)


@pytest.mark.parametrize("packed", [False, True])
def test_flex_with_a_window_matches_sdpa(packed):
    """Gemma 3's interleaved local (window 8) and global layers; forward only (flex has no CPU
    backward), eager flex as on CUDA outside compiled layers."""
    config = AutoConfig.for_model("gemma3_text", **{**TINY, **FAMILIES["gemma3_text"]})
    model = build_meta_model(config, packed=packed)
    allocate(model, torch.device("cpu"))
    init_weights(model, seed=0)
    model.lm_head.weight = model.model.embed_tokens.weight  # allocating (to_empty) unties them
    ids = torch.arange(2 * MAX_LEN).reshape(2, MAX_LEN) * 7 % TINY["vocab_size"]
    starts = [[0, 11], [0, 5, 25]] if packed else [[0], [0]]
    positions = torch.stack(
        [torch.cat([torch.arange(b - a) for a, b in zip(s, [*s[1:], MAX_LEN], strict=True)]) for s in starts]
    )
    with torch.no_grad():
        sdpa = model(input_ids=ids, position_ids=positions).logits
        set_backend(model, "flex")
        flex = model(input_ids=ids, position_ids=positions).logits
        for layer in model.model.layers:  # without the window: a different model (the test bites)
            layer.self_attn.sliding_window = None
        unwindowed = model(input_ids=ids, position_ids=positions).logits
    assert_logits_close(flex, sdpa)  # tests/tolerance.py: a forward's outputs
    assert (unwindowed - sdpa).abs().max() > 1e-3
