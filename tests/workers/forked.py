"""`python -m tests.workers.forked NPROC MODULE ARGS...`: run `MODULE.main()` (a worker of this folder)
on NPROC processes of one gloo process group, as `torchrun --standalone --nproc_per_node=NPROC -m
MODULE ARGS` would, with the imports paid once: this process imports the worker (torch,
transformers, dtrain: about 3.5 s of CPU each), then forks the ranks.

The tests' workers start this way, and so do the runs of `dtrain.sft` whose launcher is not what a
test checks (helpers.sft: dtrain.sft's main(), Hydra's command line included). torchrun launches
every command of the docs (test_readme), the launch scripts (test_lifecycle, test_metrics,
test_launch) and what only torchrun does: its report of each worker's exit code, per-rank log
files, restarts (test_reliability, test_front_door, test_data).
Each rank gets the environment torchrun gives (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT); as torchrun does, a rank that fails stops the others, and the exit code is
the first failure's. A rank dies with this process (PR_SET_PDEATHSIG): a test's timeout that kills it
leaves no rank behind waiting on a collective.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import os
import signal
import socket
import sys
import threading
import time
import traceback

PR_SET_PDEATHSIG = 1
GRACE_S = 10.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_rank(module, args: list[str], rank: int, world: int, port: int) -> int:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    sys.argv = [module.__file__, *args]
    try:
        module.main()
        return 0
    except SystemExit as exit:
        return exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1


def stop(children: dict[int, int]) -> None:
    """SIGTERM the ranks still running, SIGKILL those alive after GRACE_S."""
    for pid in children:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while children and time.monotonic() < deadline:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if pid:
            children.pop(pid, None)
        else:
            time.sleep(0.05)
    for pid in children:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    children.clear()


def main() -> None:
    world, name, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    module = importlib.import_module(name)
    if threading.active_count() != 1:  # a thread would not survive the fork in the ranks
        raise SystemExit(f"forked: {name} started threads at import; launch it with torchrun")
    port = free_port()
    sys.stdout.flush(), sys.stderr.flush()
    # What the imports made, out of the cyclic collector's reach: each rank's collections then walk
    # only what it makes itself (a twentieth of a launch's CPU), and no longer write the collector's
    # bookkeeping into the pages it shares with this process.
    gc.freeze()
    children: dict[int, int] = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = run_rank(module, args, rank, world, port)
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(code)
        children[pid] = rank
    signal.signal(signal.SIGTERM, lambda *_: stop(children) or os._exit(143))
    first_failure = 0
    while children:
        pid, status = os.wait()
        rank, code = children.pop(pid), os.waitstatus_to_exitcode(status)
        if code != 0 and not first_failure:
            print(f"forked: rank {rank} (pid {pid}) exited with code {code}; stopping the others", flush=True)
            first_failure = code if code > 0 else 128 - code
            stop(children)
    sys.exit(first_failure)


if __name__ == "__main__":
    main()
