"""`python -m dtrain.launch [torchrun's options] -m dtrain.sft [overrides]`: torchrun (the same options,
PET_* variables included), as the launch scripts run it (launch/local.sh, launch/slurm.sbatch,
launch/k8s/pytorchjob.yaml), with what a scheduler needs of the process it signals:

- SIGTERM, SIGUSR1 and SIGINT reach the workers: each is passed on to every worker as it came, and
  the launcher waits for them to save and exit, however long the save takes, then stops (no
  restart). torchrun alone passes on SIGTERM and SIGINT only, dies of SIGUSR1, and kills the workers
  30 s after the signal. A second Ctrl-C is passed on too: the workers stop at once, without saving.
  As a container's PID 1 it receives SIGTERM because it handles it (a `bash -c` there would not).
- The workers die with it (dtrain.reliability.die_with_launcher), however it dies.
- It exits with dtrain's own code (0 done, 2 dtrain's errors, 3 non-finite, 75 preempted, 130 a
  second Ctrl-C; DTRAIN_PREEMPTED_EXIT_CODE replaces 75 where a scheduler wants another code),
  read from DTRAIN_EXIT_FILE (a temporary file unless set), where torchrun says 1 for any failure.
- torchrun's own messages and its failure report go to `torchrun.log` in the launch's log folder
  (`--log-dir`/<id>/, beside the ranks' logs), not to the terminal: the user sees dtrain's lines, and
  one line naming that file where no line of dtrain's explains a failure.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import FrameType

FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# torchrun's agent keeps its own handling of these (it stops the workers with the same signal).
AGENT_SIGNALS = "SIGHUP,SIGQUIT"


class Stopped(BaseException):
    """A forwarded signal: the workers have exited; the launch ends (raised where the agent is)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Forwarder:
    """The launcher's handler of FORWARDED signals (see the module's docstring)."""

    def __init__(self) -> None:
        self.first: int | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        workers = children(os.getpid())
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        if self.first is not None:  # a second signal, while the first one's handler waits below
            return
        self.first = signum
        while any(running(pid) for pid in workers):  # torchrun's loop waits here: it restarts nobody
            time.sleep(0.1)
        raise Stopped(signum)


def children(pid: int) -> list[int]:
    """The processes `pid` started (every thread's), from /proc."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(child) for child in (task / "children").read_text().split()]
    return found


def running(pid: int) -> bool:
    """Whether `pid` has not exited (a zombie, exited and not yet reaped by torchrun, has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


class TorchrunLog(logging.Handler):
    """torchrun's log records (every record of torch.distributed, every warning) and its failure
    report, held here and written to torchrun.log in the launch's log folder at its end."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.lines: list[str] = []
        logging.captureWarnings(True)
        for name in ("torch.distributed", "py.warnings"):
            logger = logging.getLogger(name)
            for handler in list(logger.handlers):
                logger.removeHandler(handler)
            logger.addHandler(self)
            logger.propagate = False

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def save(self, folder: Path | None) -> Path | None:
        """Into FOLDER/torchrun.log (None: no folder, nothing written)."""
        if folder is None or not self.lines:
            return None
        path = folder / "torchrun.log"
        path.write_text("\n".join(self.lines) + "\n")
        return path


def exit_code(default: int) -> int:
    """dtrain's exit code from DTRAIN_EXIT_FILE, else `default`; 75 as DTRAIN_PREEMPTED_EXIT_CODE says."""
    from dtrain.reliability import EXIT_FILE, EXIT_PREEMPTED

    try:
        code = int(Path(os.environ[EXIT_FILE]).read_text().strip())
    except (KeyError, OSError, ValueError):
        code = default
    if code == EXIT_PREEMPTED:
        code = int(os.environ.get("DTRAIN_PREEMPTED_EXIT_CODE", EXIT_PREEMPTED))
    return code


def launch(argv: list[str]) -> int:
    """torchrun's run with the agent's signals narrowed (FORWARDED are this module's): the exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    report = TorchrunLog()
    args = parse_args(argv)
    args.signals_to_handle = AGENT_SIGNALS
    if args.standalone:  # torchrun's own --standalone, with the id known here: it names the log folder
        args.standalone = False
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    code, failure = 0, None
    try:
        run(args)
    except ChildFailedError as failed:
        report.lines.append(failed.format_msg())
        code, failure = 1, failed.get_first_failure()
    except Stopped:
        raise
    except Exception:  # torchrun's own failure (a rendezvous, a port): its traceback is in the report
        logging.getLogger("torch.distributed.run").exception("torchrun failed")
        code = 1
    finally:
        saved = report.save(log_folder(args.log_dir, args.rdzv_id))
    code = (exit_code(code) or code) if code else 0  # a worker's failure: dtrain's code, not rank 0's 0
    if code == 1:  # no line of dtrain's explains it: say where torchrun's report is
        why = "torchrun failed before starting the workers"
        if failure is not None:
            rank, process = failure
            output = Path(process.error_file).parent / "stderr.log"
            why = f"rank {rank} exited with code {process.exitcode}"
            why += f" (its output: {output})" if output.is_file() else ""
        where = f"torchrun's report: {saved}" if saved else "\n".join(report.lines[-20:])
        print(f"dtrain.launch: {why}; {where}", file=sys.stderr, flush=True)
    return code


def log_folder(log_dir: str | None, run_id: str) -> Path | None:
    """The launch's own folder under torchrun's --log-dir (`<run id>_<random>`, the newest)."""
    if not log_dir:
        return None
    folders = sorted(Path(log_dir).glob(f"{run_id}_*"), key=lambda path: path.stat().st_mtime)
    return folders[-1] if folders else None


def main(argv: list[str] | None = None) -> None:
    forward = Forwarder()
    for signum in FORWARDED:  # before torch's import: a signal meanwhile is not lost either
        signal.signal(signum, forward)
    os.environ["DTRAIN_LAUNCHER_PID"] = str(os.getpid())  # the workers check it (die_with_launcher)
    exit_file = None
    try:
        from dtrain.reliability import EXIT_FILE

        if EXIT_FILE not in os.environ:
            handle, exit_file = tempfile.mkstemp(prefix="dtrain-exit.")
            os.close(handle)
            os.environ[EXIT_FILE] = exit_file
        code = launch(sys.argv[1:] if argv is None else argv)
    except Stopped as stopped:
        code = exit_code(128 + stopped.signum)
    finally:
        if exit_file:
            Path(exit_file).unlink(missing_ok=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
