"""One run per folder: rank 0 of a run holds `RUN_DIR/run.lock` while it trains, so a second command
naming the same folder (the same command typed twice, a job submitted twice) is refused before it
writes anything, instead of writing the same checkpoints and metrics as the first.

The lock names its holder (host, pid, launch) and is taken over when that holder is gone, so a
crash never leaves a folder locked:

- the same launch (torchrun's run id, which a restart under `--max-restarts`, a SLURM job requeued
  under its id or a Kubernetes pod restarted under its rendezvous id keeps) takes it over at once;
- on the holder's machine (the same host name, boot and pid namespace): the holder is gone when its
  pid is gone or is another process (its start time differs);
- from another machine (a shared filesystem), where its pid means nothing: gone when its heartbeat
  (the file's modification time, which the holder refreshes every HEARTBEAT_S) is older than STALE_S.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

from dtrain.config import ConfigError

log = logging.getLogger("dtrain")

LOCK = "run.lock"
HEARTBEAT_S = 30.0
STALE_S = 120.0  # four heartbeats missed: a clock skew or a slow filesystem is not a death


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    started: str  # the process's start time (ticks since boot): a reused pid is another process
    boot: str  # the kernel's boot id: a pid from before a reboot is gone
    pid_namespace: str  # a container sharing the host name sees other pids
    launch: str | None  # torchrun's run id (or SLURM's job id): the same launch, restarted
    since: float  # when it took the lock (seconds since the epoch)

    @classmethod
    def this_process(cls) -> Holder:
        launch = os.environ.get("TORCHELASTIC_RUN_ID")
        if launch in (None, "", "none"):  # "none": torchrun with an endpoint and no --rdzv-id
            launch = os.environ.get("SLURM_JOB_ID")
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            started=_start_time(os.getpid()),
            boot=_read("/proc/sys/kernel/random/boot_id"),
            pid_namespace=_link("/proc/self/ns/pid"),
            launch=launch,
            since=time.time(),
        )

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"pid {self.pid} on {self.host} (since {since})"


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _start_time(pid: int) -> str:
    """/proc/PID/stat's field 22 (after the command name, which may hold spaces); "" if unknown."""
    stat = _read(f"/proc/{pid}/stat")
    return stat.rsplit(")", 1)[-1].split()[19] if stat else ""


def gone(held: Holder, path: Path, me: Holder) -> str | None:
    """Why the holder of the lock at `path` is gone, or None if it may still be running."""
    if held.launch and held.launch == me.launch:
        return f"the same launch ({held.launch}), restarted"
    if (held.host, held.boot, held.pid_namespace) == (me.host, me.boot, me.pid_namespace):
        try:
            os.kill(held.pid, 0)
        except ProcessLookupError:
            return "its process is gone"
        except PermissionError:  # another user's live process
            pass
        if held.started and _start_time(held.pid) not in ("", held.started):
            return f"pid {held.pid} is another process now"
        return None
    silent = time.time() - path.stat().st_mtime
    if silent > STALE_S:
        return f"no heartbeat for {silent:.0f} s"
    return None


class LockHeld(Exception):
    pass


class RunLock:
    """The lock of one run folder, held by this process (see the module's docstring)."""

    def __init__(self, path: Path, holder: Holder) -> None:
        self.path, self.holder = path, holder
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="dtrain-run-lock", daemon=True)
        self._heartbeat.start()

    @classmethod
    def take(cls, run_dir: Path) -> RunLock:
        path, me = run_dir / LOCK, Holder.this_process()
        for _ in range(3):  # a stale lock set aside, or one that vanished while read: try again
            try:
                with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "w") as file:
                    json.dump(asdict(me), file)
                    file.flush()
                    os.fsync(file.fileno())
                return cls(path, me)
            except FileExistsError:
                pass
            text, held, reason = _judge(run_dir, me)
            if _set_aside(path, text) and held is not None:
                log.warning(f"{run_dir}: taking over the lock of {held.describe()}: {reason}")
        raise LockHeld(f"{run_dir}: {path.name} keeps changing: another run is starting there")

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if self._mine():
                with contextlib.suppress(OSError):
                    os.utime(self.path)

    def _mine(self) -> bool:
        return _holder(self.path)[1] == self.holder

    def release(self) -> None:
        self._stop.set()
        self._heartbeat.join()
        if self._mine():
            self.path.unlink(missing_ok=True)


def check_free(run_dir: Path) -> None:
    """Raise LockHeld if a run that is not gone holds the folder (reads only: any rank, any time)."""
    _judge(run_dir, Holder.this_process())


def _judge(run_dir: Path, me: Holder) -> tuple[str | None, Holder | None, str | None]:
    """The lock file's text, its holder and why that holder is gone; LockHeld if it is not."""
    path = run_dir / LOCK
    text, held = _holder(path)
    try:
        if held is None:
            if text is not None and time.time() - path.stat().st_mtime <= STALE_S:
                raise LockHeld(f"{run_dir}: {path.name} is being written by another run")
            return text, None, None  # no lock, or garbage left long ago
        reason = gone(held, path, me)
    except FileNotFoundError:  # released while read
        return None, None, None
    if reason is None:
        raise LockHeld(
            f"{run_dir} is in use by another run: {held.describe()}; wait for it to end or stop it "
            f"(its lock, {path}, goes with it), or name another folder with hydra.run.dir="
        )
    return text, held, reason


def _holder(path: Path) -> tuple[str | None, Holder | None]:
    """The lock file's text (None: no such file) and its holder (None: not a holder's record)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, None
    try:
        return text, Holder(**json.loads(text))
    except (ValueError, TypeError):
        return text, None


def _set_aside(path: Path, text: str | None) -> bool:
    """Move a stale lock out of the way, unless another run replaced it meanwhile (then it is put
    back: a live lock is never broken). True when the path is free now."""
    if text is None:
        return True
    aside = path.with_name(f"{path.name}.stale-{socket.gethostname()}-{os.getpid()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return True
    try:
        if aside.read_text() != text:  # not the lock judged stale: restore it, unless a new one is there
            with contextlib.suppress(FileExistsError):
                os.link(aside, path)
            return False
        return True
    finally:
        aside.unlink(missing_ok=True)


@contextlib.contextmanager
def holding(run_dir: Path) -> Iterator[None]:
    """The run folder's lock, taken by rank 0 for as long as the block runs; every rank learns the
    outcome, so a refusal raises ConfigError on every rank alike."""
    lock, refusal = None, None
    if dist.get_rank() == 0:
        try:
            lock = RunLock.take(run_dir)
        except LockHeld as held:
            refusal = str(held)
        except OSError as error:  # an answer, still: the other ranks wait for one
            refusal = f"{run_dir}: cannot take the run folder's lock ({error})"
    outcome = [refusal]
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0]:
        raise ConfigError(outcome[0])
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
