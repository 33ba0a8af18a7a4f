"""Run many one-process `python -m dtrain.sft ARGS` commands in one interpreter, for the tests of
bad input: each command is `dtrain.sft.main()` with its argv, exactly what `python -m dtrain.sft`
runs, and what a fresh interpreter would add is only the start-up (imports: most of a failing
command's time). Each command's exit code (SystemExit) and everything it wrote to the file
descriptors 1 and 2 (Hydra's logging, dtrain's error line, a traceback) are recorded.

    python -m tests.workers.cli_many COMMANDS.json RESULTS.json

COMMANDS.json: {name: [arg, ...]}; RESULTS.json: {name: {"returncode": int, "output": str}}. A
command that does not end the process (a run that trains) returns 0. The environment is the
process's own, shared by every command."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

from hydra.core.global_hydra import GlobalHydra

import dtrain.sft


def run_one(args: list[str]) -> tuple[int, str]:
    """dtrain.sft.main() with argv `args`, its output taken from the file descriptors themselves
    (Hydra's log handlers hold sys.stdout/sys.stderr objects, which write to them)."""
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    with tempfile.TemporaryFile(mode="w+") as captured:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd in (1, 2):
            os.dup2(captured.fileno(), fd)
        sys.argv = ["dtrain.sft", *args]
        code = 0
        try:
            dtrain.sft.main()
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException:  # what the interpreter would print, and its exit code
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
            GlobalHydra.instance().clear()  # the next command initialises Hydra afresh
        captured.seek(0)
        return code, captured.read()


def main() -> None:
    commands_file, results_file = (Path(arg) for arg in sys.argv[1:3])  # run_one replaces sys.argv
    results = {}
    for name, args in json.loads(commands_file.read_text()).items():
        code, output = run_one(args)
        results[name] = {"returncode": code, "output": output}
    results_file.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
