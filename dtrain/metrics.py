"""What a logged step reports and how it is measured: throughput, MFU, memory. The record is built
here from figures already reduced over ranks; dtrain.sinks writes it."""

from __future__ import annotations

import resource
from typing import Any

import torch
from torch import nn

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
    return host_peak_rss_gib()


def host_peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def memory_figures(device: torch.device) -> dict[str, float | None]:
    """This rank's memory: peak allocated (the contract's mem_peak_gib), and on CUDA the peak
    reserved by the caching allocator and its retries (a retry means it freed its cache to fit,
    the warning sign before an OOM); the host process's peak RSS everywhere."""
    cuda = device.type == "cuda"
    return {
        "mem_peak_gib": peak_memory_gib(device),
        "mem_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if cuda else None,
        "alloc_retries": torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if cuda else None,
        "mem_rss_gib": host_peak_rss_gib(),
    }


def count_parameters(model: nn.Module) -> int:
    """Global (unsharded) count; tied weights once."""
    return sum(p.numel() for p in model.parameters())
