"""Python's cyclic garbage collector, paused where it only costs: while a program imports torch,
transformers and datasets (about a million objects that live as long as the process, walked again
and again while they are made: a sixth of a rank's start-up), and while a run trains (each rank
would pause at its own moment, and the others wait for it at the next collective: the trainer
collects at known points instead, dtrain/trainer.py)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Automatic collection off inside; the state before given back after, a failure included (a
    sweep's next job, a caller's process). Usable as a decorator."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def importing() -> Iterator[None]:
    """For a program's imports: paused while they run, then what they made frozen out of the
    collector's reach (gc.freeze: modules, classes and functions live as long as the process), so
    that no later collection walks them again, the first included."""
    with paused():
        yield
    gc.freeze()
