"""Where step figures go (JSONL always, console, W&B) and how throughput, MFU and memory are measured.
Only rank 0 writes; the figures it writes are already reduced over ranks by the trainer."""

from __future__ import annotations

import json
import logging
import resource
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from dtrain.config import Config, WandbConfig

log = logging.getLogger("dtrain")

# Dense bf16 peak FLOP/s per device, by a substring of torch.cuda.get_device_name().
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "B200": 2250e12,
}


class Sink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class JsonlSink:
    """metrics.jsonl: one object per logged step, flushed as written (the contract and test oracle)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class ConsoleSink:
    def __init__(self, max_steps: int) -> None:
        self.width = len(str(max_steps))
        self.max_steps = max_steps

    def write(self, record: dict[str, Any]) -> None:
        if "eval_loss" in record:
            log.info(
                f"step {record['step']:>{self.width}}/{self.max_steps} | eval_loss {record['eval_loss']:.4f}"
            )
            return
        mfu = f" | mfu {record['mfu']:.1%}" if record.get("mfu") is not None else ""
        log.info(
            f"step {record['step']:>{self.width}}/{self.max_steps} | loss {record['loss']:.4f} | "
            f"grad_norm {record['grad_norm']:.3f} | lr {record['lr']:.2e} | "
            f"tokens/s {record['tokens_per_s']:,.0f} | step {record['step_time_s'] * 1000:.0f} ms | "
            f"mem {record['mem_peak_gib']:.2f} GiB{mfu}"
        )

    def close(self) -> None:
        pass


class WandbSink:
    def __init__(self, settings: WandbConfig, config: dict[str, Any], run_dir: Path) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            mode=settings.mode,
            project=settings.project,
            entity=settings.entity,
            name=settings.name,
            group=settings.group,
            tags=list(settings.tags),
            config=config,
            dir=str(run_dir),
        )

    def write(self, record: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in record.items() if k != "step" and v is not None}, step=record["step"])

    def close(self) -> None:
        self.run.finish()


def open_sinks(config: Config, resolved: dict[str, Any], run_dir: Path) -> list[Sink]:
    sinks: list[Sink] = [JsonlSink(run_dir / "metrics.jsonl"), ConsoleSink(config.train.max_steps)]
    if config.logging.wandb.mode != "disabled":
        sinks.append(WandbSink(config.logging.wandb, resolved, run_dir))
    return sinks


def flops_per_token(model_config: Any, num_params: int, seq_len: int) -> float:
    """torchtitan's convention: 6·(N − N_embedding) + 12·L·d·S (attention scores and values)."""
    embedding = model_config.vocab_size * model_config.hidden_size
    layers, hidden = model_config.num_hidden_layers, model_config.hidden_size
    return 6 * (num_params - embedding) + 12 * layers * hidden * seq_len


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def peak_memory_gib(device: torch.device) -> float:
    """CUDA: peak allocated; CPU: the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def count_parameters(model: nn.Module) -> int:
    """Global (unsharded) count; tied weights once."""
    return sum(p.numel() for p in model.parameters())
