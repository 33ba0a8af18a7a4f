"""Run many one-process `python -m MODULE ARGS` commands in one interpreter: each command is MODULE's
main() with its argv, exactly what `python -m MODULE` runs, and what a fresh interpreter would add
is only the start-up (imports: most of a failing command's time, and 4 s of every command's). Each
command's exit code (SystemExit) and what it wrote to the file descriptors 1 and 2 (Hydra's logging,
dtrain's error line, a traceback, a plan's table or JSON) are recorded.

    python -m tests.workers.cli_many MODULE COMMANDS.json RESULTS.json

MODULE: dtrain.sft, or dtrain.estimate.app (what `python -m dtrain.estimate` runs). COMMANDS.json:
{name: {"args": [arg, ...], "env": {variable: value}}}; RESULTS.json: {name: {"returncode": int,
"stdout": str, "stderr": str, "output": stdout + stderr}}. A command that does not end the process
(a run that trains, a plan) returns 0. Each command runs in the process's environment updated with
its "env" (e.g. WORLD_SIZE, as torchrun sets it for each rank), put back after it."""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

from hydra.core.global_hydra import GlobalHydra


def run_one(main: Callable[[], None], program: str, args: list[str]) -> tuple[int, str, str]:
    """main() with argv `args`, its output taken from the file descriptors themselves (Hydra's log
    handlers hold sys.stdout/sys.stderr objects, which write to them)."""
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    with tempfile.TemporaryFile(mode="w+") as stdout, tempfile.TemporaryFile(mode="w+") as stderr:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(stdout.fileno(), 1)
        os.dup2(stderr.fileno(), 2)
        sys.argv = [program, *args]
        code = 0
        try:
            main()
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
        stdout.seek(0)
        stderr.seek(0)
        return code, stdout.read(), stderr.read()


def main() -> None:
    # run_one replaces sys.argv
    module, commands_file, results_file = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    program_main = importlib.import_module(module).main
    results = {}
    for name, command in json.loads(commands_file.read_text()).items():
        environment = dict(os.environ)
        os.environ.update(command["env"])
        try:
            code, stdout, stderr = run_one(program_main, module, command["args"])
        finally:
            os.environ.clear()
            os.environ.update(environment)
        results[name] = {"returncode": code, "stdout": stdout, "stderr": stderr, "output": stdout + stderr}
    results_file.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
