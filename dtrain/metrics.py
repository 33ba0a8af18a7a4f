"""What a logged step reports and how it is measured: throughput, MFU, memory. `StepMeter` builds
the record (every rank alike: its figures are reduced over ranks); dtrain.sinks writes it."""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain.config import TrainConfig

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


def flops_per_token(model_config: Any, num_params: int, seq_len: int, trainable: int | None = None) -> float:
    """The FLOPs a trained token costs, torchtitan's convention: 2·M per multiply-accumulate of the
    M = N − N_embedding parameters (the embedding is a lookup) in the forward, 2·M again for the
    backward's activation gradients, 2·M for the weight gradients, plus 12·L·d·S for the attention
    scores and values (forward and backward: no weights). With frozen parameters (LoRA: `trainable`,
    the adapters, fewer than `num_params`, which includes them) only the trainable ones get weight
    gradients: 4·M + 2·trainable + 12·L·d·S. That still counts the activation gradients of the
    first layer's projections of the (frozen) embedding's output, which autograd skips."""
    embedding = model_config.vocab_size * model_config.hidden_size
    layers, hidden = model_config.num_hidden_layers, model_config.hidden_size
    matmuls = num_params - embedding
    weight_grads = matmuls if trainable is None or trainable >= num_params else trainable
    return 4 * matmuls + 2 * weight_grads + 12 * layers * hidden * seq_len


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


def max_over_ranks(figures: dict[str, float | None], device: torch.device) -> dict[str, float | None]:
    """The worst rank's value of each figure, in one all_reduce; None (undefined here) stays None."""
    defined = [key for key, value in figures.items() if value is not None]
    values = torch.tensor([float(figures[key]) for key in defined], device=device, dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return {**figures, **dict(zip(defined, values.tolist(), strict=True))}


class StepMeter:
    """Time, data wait and input tokens since the last logged step, and the record of a logged step.
    Eval time is not training time; the data wait is the host's wait for batches."""

    def __init__(
        self,
        train: TrainConfig,
        flops: float,
        peak: float | None,
        device: torch.device,
        step: int,
    ) -> None:
        self.max_steps, self.log_every = train.max_steps, train.log_every
        self.flops_per_token, self.peak, self.device = flops, peak, device
        self.world = dist.get_world_size()
        self._restart(step)

    def _restart(self, step: int) -> None:
        self.start, self.last_logged, self.data_wait = time.perf_counter(), step, 0.0

    @contextlib.contextmanager
    def waiting_for_data(self) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.data_wait += time.perf_counter() - start

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.start += time.perf_counter() - start

    def record(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        lr: float,
        tokens: int,
        counts: tuple[float, float, float],
        skipped: int,
    ) -> dict[str, Any]:
        """The metrics.jsonl line of `step` (`tokens`: its supervised tokens; `counts`: the supervised
        tokens, non-pad slots and slots of every step since the last logged one, which the throughput
        and the padding fraction are measured over). A collective: every rank calls it (memory
        figures are the worst rank's)."""
        elapsed = time.perf_counter() - self.start
        steps = step - self.last_logged
        supervised, filled, slots = counts
        waited = {"data_wait_s": self.data_wait / steps}
        worst = max_over_ranks({**memory_figures(self.device), **waited}, self.device)
        peak = self.peak
        record = {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens": tokens,
            "padding_fraction": 1.0 - filled / slots,
            "tokens_per_s": supervised / elapsed,
            "input_tokens_per_s": slots / elapsed,
            "input_tokens_per_s_per_device": slots / elapsed / self.world,
            "step_time_s": elapsed / steps,
            **worst,
            "mfu": self.flops_per_token * slots / elapsed / (peak * self.world) if peak else None,
            "skipped_steps": skipped,
        }
        self._restart(step)
        return record

    def due(self, step: int) -> bool:
        """Whether `step` is logged: every train.log_every steps, and the last one."""
        return step % self.log_every == 0 or step == self.max_steps
