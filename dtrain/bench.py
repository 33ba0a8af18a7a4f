"""`python -m dtrain.bench`: the same model, data and batch trained by a plain PyTorch +
transformers loop (the no-overhead baseline) and by dtrain's step on a 1×1 mesh, in one run; prints
tokens/s, step time, peak memory (CUDA only) and each variant's ratio to the plain loop. On CPU the
figures are CPU figures (gloo) and the table says so.

dtrain's variant runs exactly the trainer's per-step functions (micro_step, optimizer_step) on the
model parallelize() builds, so hooks, DTensor and loss-parallel overhead are all in the figure."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from dtrain.config import (
    Config,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    check_config,
)
from dtrain.data import IGNORE
from dtrain.distributed import build_parallel, init_distributed
from dtrain.model import build_meta_model, load_model_config, materialize
from dtrain.optim import build_optimizer
from dtrain.parallel.parallelize import parallelize
from dtrain.trainer import micro_step, optimizer_step

MODEL = dict(
    model_type="llama",
    vocab_size=8192,
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=512,
)
LR, MAX_NORM = 1e-3, 1.0
TOKENIZER = Path(__file__).parent / "assets" / "tokenizer"  # only checked: the data is random ids


def batch(batch_size: int, seq: int, device: torch.device) -> dict[str, torch.Tensor]:
    """One fixed random batch (every variant trains on it)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, MODEL["vocab_size"], (batch_size, seq + 1), generator=generator)
    positions = torch.arange(seq).expand(batch_size, -1)
    return {
        "input_ids": ids[:, :-1].to(device),
        "labels": ids[:, 1:].to(device),
        "position_ids": positions.to(device),
    }


def plain_loop(mb: dict[str, torch.Tensor], device: torch.device) -> Callable[[], None]:
    """The baseline: a Hugging Face model, AdamW, summed token loss / tokens, clip, step."""
    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in MODEL.items() if k != "model_type"})
    model = LlamaForCausalLM(config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    tokens = (mb["labels"] != IGNORE).sum().float()

    def step() -> None:
        logits = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), mb["labels"].flatten(), reduction="sum")
        (loss / tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def dtrain_1x1(mb: dict[str, torch.Tensor], device: torch.device, loss_chunk: int) -> Callable[[], None]:
    """dtrain's model (parallelize on a 1×1 mesh, FSDP2 + loss parallel) and its step functions."""
    config = Config(
        model=ModelConfig(config=dict(MODEL), init="random", tokenizer=str(TOKENIZER)),
        data=DataConfig(max_len=mb["input_ids"].shape[1]),
        parallel=ParallelConfig(tp=1, dp_shard=1, loss_chunk=loss_chunk),
        optim=OptimConfig(lr=LR, max_grad_norm=MAX_NORM, schedule="constant"),
        train=TrainConfig(global_batch_size=len(mb["input_ids"]), micro_batch_size=len(mb["input_ids"])),
    )
    config.train.precision = "fp32" if device.type == "cpu" else "bf16"
    model_config = load_model_config(config.model)
    shape = check_config(config, 1, model_config, files=False)
    model = build_meta_model(model_config, packed=False)
    parallelize(model, build_parallel(shape, device), config.parallel, config.train.precision)
    materialize(model, device, config.model, seed=0)
    optimizer = build_optimizer(model, config.optim)
    params = list(model.parameters())
    tokens = (mb["labels"] != IGNORE).sum().float()

    def step() -> None:
        micro_step(model, mb, tokens, True, loss_chunk)
        optimizer_step(optimizer, params, MAX_NORM)

    return step


def timed(step: Callable[[], None], steps: int, device: torch.device) -> float:
    """Seconds per step over `steps` steps."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def peak_gib(device: torch.device) -> float:
    """Peak allocated memory since the last reset, GiB (nan on CPU)."""
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=3, help="variants alternate; the best round counts")
    parser.add_argument("--loss-chunk", type=int, default=64, help="for the dtrain 1x1 chunked variant")
    args = parser.parse_args(argv)
    device = init_distributed(timeout_s=300)  # one process: an in-memory store, no port to take
    mb = batch(args.batch, args.seq, device)
    variants = {
        "plain torch + transformers loop": lambda: plain_loop(mb, device),
        "dtrain 1x1": lambda: dtrain_1x1(mb, device, 0),
        f"dtrain 1x1 loss_chunk={args.loss_chunk}": lambda: dtrain_1x1(mb, device, args.loss_chunk),
    }
    tokens = args.batch * args.seq
    kind = "CPU figures (gloo)" if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(f"{kind}; batch {args.batch} x seq {args.seq}; best of {args.rounds} rounds of {args.steps} steps")
    steps, peaks, seconds = {}, {}, {}
    for name, build in variants.items():  # build and warm up each; its peak memory is its own
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        steps[name] = build()
        timed(steps[name], args.warmup, device)
        peaks[name] = peak_gib(device)
    for _ in range(args.rounds):  # alternate, so that load from elsewhere falls on every variant
        for name, step in steps.items():
            seconds[name] = min(seconds.get(name, float("inf")), timed(step, args.steps, device))
    print(f"{'variant':<36}{'tokens/s':>10}{'step ms':>10}{'peak GiB':>10}{'ratio':>8}")
    first = tokens / next(iter(seconds.values()))
    for name, value in seconds.items():
        rate = tokens / value
        print(f"{name:<36}{rate:>10.0f}{value * 1000:>10.1f}{peaks[name]:>10.2f}{rate / first:>8.2f}")


if __name__ == "__main__":
    main()
