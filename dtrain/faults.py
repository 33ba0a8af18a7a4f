"""Fault injection for the tests and bench/fault_report.py: a NaN gradient, a rank killed or handed a
bad batch, slow steps, a crash or a full disk in the middle of a checkpoint save, and a clock the
test controls for checkpoint.every_minutes.

Read once, when a run starts, from DTRAIN_TEST_* variables. A normal run sets none of them, so
`Faults.from_env()` is None and neither the step nor the checkpointer reads the environment or
calls anything for faults. Step numbers are 1-based (the step being taken).
"""

from __future__ import annotations

import errno
import math
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

# Each field's variable. Every value is a step number except DTRAIN_TEST_FAULT_RANK (a rank),
# DTRAIN_TEST_STEP_SLEEP_S (seconds), DTRAIN_TEST_MINUTES_PER_STEP (minutes) and DTRAIN_TEST_HOLD_FILE
# (a path).
VARIABLES = {
    "nan_at_step": "DTRAIN_TEST_NAN_AT_STEP",
    "kill_at_step": "DTRAIN_TEST_KILL_AT_STEP",
    "fail_fetch_at_step": "DTRAIN_TEST_FAIL_FETCH_AT_STEP",
    "rank": "DTRAIN_TEST_FAULT_RANK",
    "step_sleep_s": "DTRAIN_TEST_STEP_SLEEP_S",
    "crash_in_save": "DTRAIN_TEST_CRASH_IN_SAVE",
    "fail_save": "DTRAIN_TEST_FAIL_SAVE",
    "minutes_per_step": "DTRAIN_TEST_MINUTES_PER_STEP",
    "hold_file": "DTRAIN_TEST_HOLD_FILE",
}
PARSE = {"step_sleep_s": float, "minutes_per_step": float, "hold_file": str}  # the others: int


@dataclass(frozen=True)
class Faults:
    nan_at_step: int | None = None  # a NaN in the last parameter's gradient, on every rank
    kill_at_step: int | None = None  # `rank` SIGKILLs itself before fetching this step's batch
    fail_fetch_at_step: int | None = None  # `rank`'s fetch of this step's batch raises
    rank: int = 1  # the rank that kill_at_step and fail_fetch_at_step apply to
    step_sleep_s: float = 0.0  # before every step: slows a run down so a test's signal lands mid-run
    crash_in_save: int | None = None  # SIGKILL once that checkpoint's files are written, before complete
    fail_save: int | None = None  # writing that checkpoint fails with "No space left on device"
    # The clock checkpoint.every_minutes reads (Checkpointer.clock) shows this many minutes more at
    # each step's start, instead of the wall clock's time: a test of the periodic save needs no wait.
    minutes_per_step: float | None = None
    # Before every step: wait while this file exists (a test holds a run mid-way for as long as it needs).
    hold_file: str | None = None
    _now_s: list[float] = field(default_factory=lambda: [0.0], repr=False, compare=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Faults | None:
        """The faults the environment asks for, or None. The kill and the bad batch apply to a job's
        first attempt only, so a job restarted by torchrun (--max-restarts) can finish."""
        values = {}
        for name, variable in VARIABLES.items():
            text = environ.get(variable)
            if text:
                values[name] = PARSE.get(name, int)(text)
        if environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            values.pop("kill_at_step", None)
            values.pop("fail_fetch_at_step", None)
        return cls(**values) if values else None

    def before_fetch(self, step: int) -> None:
        """Called where every rank fetches `step`'s batch (reliability.StepGuard.agreed)."""
        on_this_rank = dist.get_rank() == self.rank
        if self.minutes_per_step is not None:
            self._now_s[0] = 60 * self.minutes_per_step * (step - 1)
        if on_this_rank and step == self.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)
        while self.hold_file and os.path.exists(self.hold_file):
            time.sleep(0.05)
        if on_this_rank and step == self.fail_fetch_at_step:
            raise ValueError("injected bad batch")

    def clock(self) -> float:
        """The controlled clock's seconds (minutes_per_step); the wall clock's where it is not set."""
        return self._now_s[0] if self.minutes_per_step is not None else time.monotonic()

    def poison(self, step: int, model: nn.Module) -> None:
        """After `step`'s backward: the tests' poisoned batch."""
        if step != self.nan_at_step:
            return
        last = list(model.parameters())[-1]
        if last.grad is not None:
            grad = last.grad.to_local() if isinstance(last.grad, DTensor) else last.grad
            grad.view(-1)[0] = math.nan

    def after_save_written(self, step: int, partial: Path) -> None:
        """Called once checkpoint `step`'s files are written, before it is marked complete."""
        if step == self.fail_save:
            raise OSError(errno.ENOSPC, "No space left on device (injected)", str(partial))
        if step == self.crash_in_save:
            os.kill(os.getpid(), signal.SIGKILL)
