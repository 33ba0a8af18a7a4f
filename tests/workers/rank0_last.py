"""`python -m tests.workers.forked N tests.workers.rank0_last ENTRY CWD FOLDER ARGS...`: `python -m
dtrain.ENTRY ARGS` run in the folder CWD on every rank (dtrain.ENTRY's main(), Hydra's command line
included), rank 0 starting last: it waits until FOLDER (the run folder the command names) exists, at
most WAIT_S, as a rank 0 that a loaded machine started late would (torchrun starts the ranks in no
set order). For test_lifecycle: what a failed start leaves must not depend on which rank comes first."""

from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path

import dtrain.dpo  # noqa: F401  (imported before the fork, once)
import dtrain.sft  # noqa: F401

WAIT_S = 3.0


def main() -> None:
    entry, cwd, folder, *args = sys.argv[1:]
    os.chdir(cwd)
    if os.environ["RANK"] == "0":
        deadline = time.monotonic() + WAIT_S
        while not Path(folder).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    sys.argv = [f"dtrain.{entry}", *args]
    importlib.import_module(f"dtrain.{entry}").main()
