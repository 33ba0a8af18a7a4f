"""What docs/lora.md promises of one adapted model, module by module, against `peft` in this process
(no launch): dropout's inverted 1/(1 - p) rescale, activation checkpointing's recompute reusing the
forward's dropout mask, `lora.init=gaussian`'s distribution, and rsLoRA's alpha / sqrt(r). The model
is dtrain's own build on one process without a mesh (dtrain.model.build_meta_model, then
lora.apply_lora, apply_activation_checkpointing and materialize, as parallelize and build_model
call them at tp = 1 without FSDP); the reference is `peft.get_peft_model` on `from_pretrained`.
The mesh runs (tp, FSDP, the trainer) are test_lora's."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from dtrain.config import LoraConfig, ModelConfig
from dtrain.model import build_meta_model, materialize
from dtrain.parallel import lora
from dtrain.parallel.parallelize import apply_activation_checkpointing, decoder_layers
from tests.helpers import peft_saved_name, save_user_model
from tests.tolerance import assert_close, assert_logits_close

R, ALPHA, SEED = 8, 16.0, 3
IDS = (torch.arange(2 * 24).reshape(2, 24) * 7 + 3) % 300


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_user_model(tmp_path_factory.mktemp("lora_semantics") / "llama", num_key_value_heads=4)


def dtrain_model(folder: Path, settings: LoraConfig, checkpointing: str = "none") -> torch.nn.Module:
    """dtrain's adapted model on the CPU, one process: the base from the folder, the adapters by
    lora.init (B zero), in training mode."""
    model = build_meta_model(AutoConfig.from_pretrained(folder))
    lora.apply_lora(model, decoder_layers(model), settings, torch.float32, SEED)
    apply_activation_checkpointing(decoder_layers(model), checkpointing)
    materialize(model, torch.device("cpu"), ModelConfig(name_or_path=str(folder)), SEED, settings)
    return model.train()


def peft_model(folder: Path, settings: LoraConfig, **extra) -> torch.nn.Module:
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    config = PeftLoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        use_rslora=settings.use_rslora,
        target_modules="all-linear",
        **extra,
    )
    return get_peft_model(base, config).train()


def random_adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Non-zero A and B for every adapter of dtrain's model (seeded), under PEFT's saved names."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in lora.adapter_parameters(model).values():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return lora.peft_tensors(model)


def load_into_peft(peft: torch.nn.Module, adapters: dict[str, torch.Tensor]) -> None:
    state = peft.state_dict()
    with torch.no_grad():
        for key, tensor in adapters.items():  # base_model.model.X.lora_A.weight → X.lora_A.default.weight
            state[key.replace(".weight", ".default.weight")].copy_(tensor)


def logits(model: torch.nn.Module) -> torch.Tensor:
    positions = torch.arange(IDS.shape[1]).expand(len(IDS), -1)
    return model(input_ids=IDS, position_ids=positions).logits


@pytest.mark.parametrize("use_rslora", [False, True], ids=["alpha_over_r", "rslora"])
def test_scaling_is_peft_s_with_and_without_rslora(folder, use_rslora):
    """The same non-zero adapters give PEFT's logits: scaling alpha / r, and alpha / sqrt(r) with
    use_rslora (r = 8: a factor of 2.8 apart, so either scaling in place of the other fails)."""
    settings = LoraConfig(r=R, alpha=ALPHA, use_rslora=use_rslora)
    model = dtrain_model(folder, settings).eval()
    peft = peft_model(folder, settings).eval()
    load_into_peft(peft, random_adapters(model))
    with torch.no_grad():
        ours, theirs = logits(model), logits(peft)
    assert_logits_close(ours, theirs)


def test_dropout_rescales_as_torch_dropout_in_peft(folder, monkeypatch):
    """With lora.dropout = 0.3 in training mode, each adapter drops what PEFT's nn.Dropout drops on
    the same input: PEFT runs first with its own masks (torch's dropout, which scales what it keeps
    by 1 / (1 - p)); those masks, read off its dropout outputs, replace the uniform draws dtrain's
    dropout compares with p, so dtrain's own code turns them into its mask and rescale. The logits and
    every adapter's gradient must then be PEFT's: a dropout without the rescale, or with another,
    would not."""
    p = 0.3
    settings = LoraConfig(r=R, alpha=ALPHA, dropout=p)
    model = dtrain_model(folder, settings)
    peft = peft_model(folder, settings)
    load_into_peft(peft, random_adapters(model))
    masks: dict[str, torch.Tensor] = {}

    def keep_mask(name: str):
        def hook(module, args, output):  # noqa: ANN001, ANN202
            masks[name] = (output != 0) | (args[0] == 0)  # what nn.Dropout kept (a zero input: either)

        return hook

    for name, module in peft.named_modules():
        if name.endswith("lora_dropout.default"):
            module.register_forward_hook(keep_mask(name.removeprefix("base_model.model.").split(".lora_")[0]))
    torch.manual_seed(0)
    theirs = logits(peft)
    assert len(masks) == len(lora.adapter_modules(model)) and all(
        0.55 < m.float().mean() < 0.85 for m in masks.values()
    )

    current: list[str] = []
    for name, module in lora.adapter_modules(model).items():
        module.register_forward_pre_hook(lambda module, args, name=name: current.append(name))
    real_rand = torch.rand

    def drawn(shape, generator=None, device=None):  # noqa: ANN001, ANN202
        mask = masks[current[-1]]
        assert list(mask.shape) == list(shape)
        return torch.where(mask, 1.0, 0.0)  # kept: >= p; dropped: < p

    monkeypatch.setattr(torch, "rand", drawn)
    ours = logits(model)
    monkeypatch.setattr(torch, "rand", real_rand)
    assert_logits_close(ours, theirs)
    (ours.float().pow(2).mean()).backward()
    (theirs.float().pow(2).mean()).backward()
    peft_grads = {
        peft_saved_name(name): param.grad for name, param in peft.named_parameters() if param.requires_grad
    }
    ours_grads = {name: param.grad for name, param in lora.adapter_parameters(model).items()}
    for name, grad in ours_grads.items():
        theirs_grad = peft_grads[lora.PEFT_PREFIX + name]
        assert_close(grad, theirs_grad, 1e-5 * theirs_grad.abs().max().item(), name)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_recompute_reuses_the_forward_s_dropout_mask(folder, mode):
    """Under activation checkpointing the backward recomputes each layer, dropout included: the
    adapters' gradients equal those of the same model without checkpointing (same weights, same
    forward masks), which they would not if the recompute drew new masks. The loss is the same
    forward in both (the masks of the forward)."""
    settings = LoraConfig(r=R, alpha=ALPHA, dropout=0.3)
    plain, checkpointed = dtrain_model(folder, settings), dtrain_model(folder, settings, mode)
    adapters = random_adapters(plain)
    with torch.no_grad():
        for name, param in lora.adapter_parameters(checkpointed).items():
            param.copy_(lora.adapter_parameters(plain)[name])
    assert lora.peft_tensors(checkpointed).keys() == adapters.keys()
    grads = []
    for model in (plain, checkpointed):
        loss = logits(model).float().pow(2).mean()
        loss.backward()
        grads.append((loss.item(), {n: p.grad for n, p in lora.adapter_parameters(model).items()}))
    (plain_loss, plain_grads), (loss, checkpointed_grads) = grads
    assert loss == plain_loss
    for name, grad in plain_grads.items():
        assert_close(checkpointed_grads[name], grad, 1e-5 * grad.abs().max().item(), f"{mode}: {name}")


def ks_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical CDFs."""
    a, b = a.flatten().double().sort().values, b.flatten().double().sort().values
    points = torch.cat([a, b])
    cdf_a = torch.searchsorted(a, points, right=True) / len(a)
    cdf_b = torch.searchsorted(b, points, right=True) / len(b)
    return (cdf_a - cdf_b).abs().max().item()


def ks_critical(n: int, m: int, alpha: float = 1e-6) -> float:
    """The distance two samples of one distribution exceed with probability `alpha` (asymptotic)."""
    return math.sqrt(-math.log(alpha / 2) / 2) * math.sqrt((n + m) / (n * m))


@pytest.mark.parametrize("init", ["gaussian", "default"])
def test_init_draws_a_from_peft_s_distribution(folder, init):
    """lora.init=gaussian against PEFT's init_lora_weights="gaussian", lora.init=default against
    PEFT's default (Kaiming-uniform): dtrain draws from its own seeded generators and PEFT from
    torch's global one, so the draws differ and their distributions are compared. All A elements
    of each model pooled (every adapter has the same rank, and Kaiming's bound depends on the input
    width: the pools hold each width alike) are one sample of its distribution: the two-sample
    Kolmogorov-Smirnov distance stays below what samples of one distribution exceed with probability
    1e-6, and is above it for the other init (normal(0, 1/r) and U(±1/sqrt(in)) are apart at these
    sample sizes). B is zero in both."""
    settings = LoraConfig(r=R, alpha=ALPHA, init=init)
    ours = lora.peft_tensors(dtrain_model(folder, settings))
    torch.manual_seed(0)
    peft = peft_model(folder, settings, init_lora_weights="gaussian" if init == "gaussian" else True)
    other = peft_model(folder, settings, init_lora_weights=True if init == "gaussian" else "gaussian")
    samples = []
    for model in (peft, other):
        state = {
            peft_saved_name(name): param.detach()
            for name, param in model.named_parameters()
            if param.requires_grad
        }
        assert state.keys() == ours.keys()
        samples.append(torch.cat([t.flatten() for name, t in sorted(state.items()) if ".lora_A." in name]))
    assert all(torch.count_nonzero(t) == 0 for name, t in ours.items() if ".lora_B." in name)
    mine = torch.cat([t.flatten() for name, t in sorted(ours.items()) if ".lora_A." in name])
    same, different = (ks_distance(mine, sample) for sample in samples)
    critical = ks_critical(len(mine), len(samples[0]))
    assert same < critical < different, (same, critical, different)
    if init == "gaussian":
        assert mine.std().item() == pytest.approx(1 / R, rel=0.05)  # normal(0, 1/r): std 1/r
