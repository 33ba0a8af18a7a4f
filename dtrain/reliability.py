"""Faults during training: preemption signals, non-finite steps, and failures that one rank hits
before a collective. Every decision is agreed on by all ranks, so they stop together instead of
leaving the others waiting on a collective.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dtrain.config import TrainConfig
from dtrain.faults import Faults

log = logging.getLogger("dtrain")
T = TypeVar("T")

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: the job saved its state and wants to be requeued
EXIT_NONFINITE = 3
# SLURM sends SIGUSR1 before its time limit; SIGINT is a Ctrl-C (dtrain.launch forwards all three).
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# A scheduler's signals that arrive while a run starts (a large model loads for minutes) are held
# until the loop begins, which then saves after its first step: the job exits 75 and is requeued
# instead of dying of the signal. A Ctrl-C while starting stops at once (KeyboardInterrupt).
SCHEDULER_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EXIT_INTERRUPTED = 130  # a second Ctrl-C: 128 + SIGINT, as a shell reports it
# torchrun reports any worker's failure as exit code 1: dtrain writes its own code (2, 3, 75 ...) to
# the file this variable names, where the launcher reads it (dtrain.launch, the launch/ scripts).
EXIT_FILE = "DTRAIN_EXIT_FILE"
PR_SET_PDEATHSIG = 1  # prctl(2)
_held_signal: int | None = None  # a scheduler's signal received before the loop's StepGuard


def write_exit_status(code: int) -> None:
    """Write dtrain's exit code where the launcher reads it (DTRAIN_EXIT_FILE, if set)."""
    path = os.environ.get(EXIT_FILE)
    if path:
        with contextlib.suppress(OSError):
            Path(path).write_text(f"{code}\n")


def die_with_launcher() -> None:
    """A worker started by torchrun (or dtrain.launch) is SIGKILLed by the kernel when its launcher
    dies, however it dies (a SIGKILL, an OOM kill, a node's scheduler cleaning up): an orphaned worker
    would go on training, and saving checkpoints, beside the rerun. Linux only (prctl)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    launcher = os.environ.get("DTRAIN_LAUNCHER_PID")  # set by dtrain.launch
    if launcher and os.getppid() != int(launcher):  # it died before the request above was in place
        os._exit(128 + signal.SIGKILL)


@contextlib.contextmanager
def scheduler_signals_held() -> Iterator[None]:
    """While a run starts (until its loop's StepGuard), hold SIGTERM and SIGUSR1 (SCHEDULER_SIGNALS);
    the process's own handlers are back afterwards."""

    def hold(signum: int, frame: FrameType | None) -> None:
        global _held_signal
        if _held_signal is None:
            log.warning(f"received {signal.Signals(signum).name} while starting: saving after the first step")
        _held_signal = signum

    previous = {signum: signal.signal(signum, hold) for signum in SCHEDULER_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def agreed_error(error: str | None) -> str | None:
    """Every rank's outcome of the same operation (None: it succeeded there): the lowest failing rank's
    error on every rank, or None where it succeeded everywhere. One collective, so no rank is left
    waiting in the next one while another raises."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((f"rank {rank}: {text}" for rank, text in enumerate(errors) if text), None)


class Preempted(Exception):
    """A preemption signal arrived; the state of `step` is saved."""

    def __init__(self, step: int) -> None:
        super().__init__(f"preempted: checkpoint saved after step {step}; rerun the same command to resume")
        self.step = step


class NonFiniteError(RuntimeError):
    pass


class RankFailure(RuntimeError):
    """One rank failed before a collective; every rank raises it with that rank's message."""


class StepGuard:
    """What the ranks agree on before each step's first collective: that every rank got its batch,
    and whether any rank received a preemption signal. One all_reduce of host flags per step, on a
    gloo group of its own: on an NCCL group, reading the result would make the host wait for the
    device to finish the previous step, and the next step could not be queued behind it."""

    def __init__(
        self,
        settings: TrainConfig,
        faults: Faults | None = None,
        save_due: Callable[[], bool] | None = None,
    ) -> None:
        self.settings = settings
        self.faults = faults
        self.group = dist.new_group(backend="gloo")
        self.consecutive_skips = 0
        self.skipped = 0
        self.preempted = False  # agreed by all ranks: save the state and stop before the next step
        # Rank 0's clock decides the wall-clock checkpoints (every rank's would differ); agreed here.
        self.save_due = save_due if dist.get_rank() == 0 else None
        self.save_now = False  # agreed by all ranks: save after this step
        global _held_signal
        self._signalled, _held_signal = _held_signal, None  # a signal held while the run started
        self._previous = {signum: signal.signal(signum, self._on_signal) for signum in PREEMPTION_SIGNALS}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._signalled is None:
            log.warning(
                f"received {signal.Signals(signum).name}: finishing the step, then saving"
                + (" (Ctrl-C again to stop at once, without saving)" if signum == signal.SIGINT else "")
            )
            self._signalled = signum
            return
        if signum == signal.SIGINT:  # a second Ctrl-C: the user wants out now; no traceback per rank
            if int(os.environ.get("LOCAL_RANK", "0")) == 0:
                print("dtrain: interrupted again: stopping without saving", file=sys.stderr, flush=True)
                write_exit_status(EXIT_INTERRUPTED)
            os._exit(EXIT_INTERRUPTED)

    def close(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def agreed(self, step: int, fetch: Callable[[], T]) -> T:
        """Run `fetch` (the step's data) on every rank. If it raised on any rank, every rank
        raises RankFailure with the lowest failing rank's message, instead of the others waiting
        for it in the step's first collective. A signal seen here sets `preempted` on every rank:
        the step whose batch was just taken runs, then the state is saved."""
        result, error = None, None
        try:
            if self.faults:
                self.faults.before_fetch(step + 1)
            result = fetch()
        except Exception as caught:  # anything: the point is that no rank is left waiting
            error = f"rank {dist.get_rank()}: {type(caught).__name__}: {caught}"
        save_due = self.save_due is not None and self.save_due()
        flags = torch.tensor([error is not None, self._signalled is not None, save_due], dtype=torch.int32)
        dist.all_reduce(flags, group=self.group)
        failed, self.preempted, self.save_now = (bool(flag) for flag in flags.tolist())
        if failed:
            messages = [None] * dist.get_world_size()
            dist.all_gather_object(messages, error, group=self.group)
            raise RankFailure(f"step {step + 1}: {next(m for m in messages if m)}")
        return result

    def should_skip(self, step: int, grad_norm: torch.Tensor, model: nn.Module) -> bool:
        """True when this step's gradients are not finite and the step must not be applied.
        grad_norm is the global norm, identical on every rank, so all ranks decide alike. Reading
        it is the step's one wait for the device: the decision must come before AdamW touches its
        moments. Fused AdamW's found_inf could skip on the device, but the skip count,
        train.max_skips, nonfinite=abort and the culprit's name all need the answer at this step."""
        if math.isfinite(grad_norm.item()):
            self.consecutive_skips = 0
            return False
        culprit = first_nonfinite_gradient(model)
        if self.settings.nonfinite == "abort":
            raise NonFiniteError(
                f"step {step}: non-finite gradient norm ({grad_norm.item()}); first non-finite gradient "
                f"on rank {dist.get_rank()}: {culprit}. Nothing was saved for this step"
            )
        self.skipped += 1
        self.consecutive_skips += 1
        if self.consecutive_skips > self.settings.max_skips:
            raise NonFiniteError(
                f"step {step}: {self.consecutive_skips} non-finite steps in a row "
                f"(train.max_skips={self.settings.max_skips}); last culprit: {culprit}"
            )
        log.warning(f"step {step}: non-finite gradients ({culprit}): step skipped ({self.skipped} so far)")
        return True


def first_nonfinite_gradient(model: nn.Module) -> str:
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        if not torch.isfinite(local).all():
            return name
    return "none on this rank (the loss itself)"


class StallWatch:
    """Warns once when a run has stopped learning: a zero gradient norm, or a loss pinned at
    ln(vocab) (uniform logits: what a far too high learning rate leaves), for `patience` logged steps
    in a row. A from-scratch model starts near ln(vocab) too, but its loss moves."""

    def __init__(self, vocab_size: int, patience: int = 3) -> None:
        self.uniform = math.log(vocab_size)
        self.patience = patience
        self.stuck = 0
        self.previous: float | None = None
        self.warned = False

    def check(self, step: int, loss: float, grad_norm: float) -> None:
        pinned = abs(loss - self.uniform) < 0.01 * self.uniform and self.previous is not None
        pinned = pinned and abs(loss - self.previous) < 1e-4
        self.previous = loss
        self.stuck = self.stuck + 1 if grad_norm == 0.0 or pinned else 0
        if self.stuck >= self.patience and not self.warned:
            self.warned = True
            log.warning(
                f"step {step}: the run has stopped learning: loss {loss:.4f} "
                f"(ln(vocab) = {self.uniform:.4f}), grad_norm {grad_norm:.3g} for {self.stuck} logged "
                "steps; is optim.lr too high?"
            )
