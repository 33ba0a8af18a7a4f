"""Where logged records go: metrics.jsonl always (the contract and the test oracle), the console
(a line per logged step, a progress bar on a terminal) and W&B. Only rank 0 writes; the records
are already reduced over ranks (dtrain.metrics builds them)."""

from __future__ import annotations

import json
import logging
import netrc
import os
import secrets
import sys
from pathlib import Path
from typing import Any, Protocol, TextIO
from urllib.parse import urlparse

from hydra.types import RunMode

from dtrain.config import Config, WandbConfig

log = logging.getLogger("dtrain")


class Sink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class JsonlSink:
    """metrics.jsonl: one object per logged step, flushed as written (the contract and test oracle).
    A run that starts at `start_step` (its checkpoint's) keeps the records up to that step and drops
    the rest (logged after the checkpoint by the attempt that stopped, or by a run started over):
    each step once, one series."""

    def __init__(self, path: Path, start_step: int = 0) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = kept_records(path, start_step)
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text("".join(kept), encoding="utf-8")
        os.replace(partial, path)
        self.file = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def kept_records(path: Path, start_step: int) -> list[str]:
    """The lines of `path` whose step is at most start_step (a torn last line is dropped)."""
    if not path.is_file() or start_step == 0:
        return []
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            continue
        if step <= start_step and line.endswith("\n"):
            kept.append(line)
    return kept


def format_record(record: dict[str, Any], max_steps: int) -> str:
    step = f"step {record['step']:>{len(str(max_steps))}}/{max_steps}"
    if "eval_loss" in record:
        return f"{step} | eval_loss {record['eval_loss']:.4f}"
    mfu = f" | mfu {record['mfu']:.1%}" if record.get("mfu") is not None else ""
    rewards = ""  # dtrain.dpo's (TRL's names in metrics.jsonl and W&B)
    if "rewards/accuracies" in record:
        rewards = (
            f" | rewards/accuracies {record['rewards/accuracies']:.3f} | rewards/margins "
            f"{record['rewards/margins']:.4f}"
        )
    if record.get("reward") is not None:  # dtrain.grpo's mean reward (of the generations since the last line)
        rewards = f" | reward {record['reward']:.4f}"
    return (
        f"{step} | loss {record['loss']:.4f}{rewards} | grad_norm {record['grad_norm']:.3f} | "
        f"lr {record['lr']:.2e} | tokens/s {record['input_tokens_per_s']:,.0f} "
        f"({record['input_tokens_per_s_per_device']:,.0f}/device, "
        f"{record['tokens_per_s']:,.0f} supervised) | step {record['step_time_s'] * 1000:.0f} ms "
        f"(data {record['data_wait_s'] * 1000:.0f} ms) | mem {record['mem_peak_gib']:.2f} GiB{mfu}"
    )


class ConsoleSink:
    """A log line per logged step; on a terminal, a progress bar with ETA (tqdm) below the lines."""

    def __init__(self, max_steps: int, start_step: int = 0, stream: TextIO | None = None) -> None:
        self.max_steps = max_steps
        stream = stream or sys.stderr
        self.bar = self.redirect = None
        if stream.isatty():
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = tqdm(total=max_steps, initial=start_step, unit="step", file=stream, dynamic_ncols=True)
            # Every log line while the bar lives (warnings, saves, not just the steps') scrolls above it.
            self.redirect = logging_redirect_tqdm()
            self.redirect.__enter__()

    def write(self, record: dict[str, Any]) -> None:
        log.info(format_record(record, self.max_steps))
        if self.bar is None:
            return
        self.bar.update(record["step"] - self.bar.n)
        if "loss" in record:
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.redirect.__exit__(None, None, None)
            self.bar.close()


def wandb_credentials() -> bool:
    """Whether wandb could log in without a prompt: an API key in the environment or ~/.netrc."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host or "") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def hydra_context() -> dict[str, Any]:
    """The overrides and the chosen experiment of this Hydra job (empty outside Hydra)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}
    hydra = HydraConfig.get()
    context = {"overrides": list(hydra.overrides.task), "experiment": hydra.runtime.choices.get("experiment")}
    if hydra.mode == RunMode.MULTIRUN:
        context |= {"sweep": Path(hydra.sweep.dir).name, "job": hydra.job.num}
    return context


WANDB_ID = "wandb_id"  # the run folder's W&B run id: a resumed run logs to the same W&B run


def wandb_run_id(run_dir: Path, start_step: int) -> str:
    """The W&B run id kept in the run folder; a new one for a run that starts at step 0."""
    path = run_dir / WANDB_ID
    if start_step > 0 and path.is_file():
        return path.read_text().strip()
    run_id = secrets.token_hex(4)  # W&B's own ids are 8 characters of [0-9a-z] too
    path.write_text(run_id + "\n")
    return run_id


class WandbSink:
    """One W&B run (rank 0): the resolved config as a plain dict plus the Hydra overrides and
    experiment under `hydra`. Without credentials an online run logs offline, said in one line."""

    def __init__(
        self, settings: WandbConfig, config: dict[str, Any], run_dir: Path, start_step: int = 0
    ) -> None:
        import wandb

        mode = settings.mode
        if mode == "online" and not wandb_credentials():
            log.warning(
                f"W&B: no credentials (WANDB_API_KEY or ~/.netrc), so this run logs offline to "
                f"{run_dir / 'wandb'}; upload it later with `wandb sync`"
            )
            mode = "offline"
        context = hydra_context()
        init = dict(
            project=settings.project,
            entity=settings.entity,
            name=settings.name,
            group=settings.group or context.get("sweep"),  # a sweep's jobs side by side
            tags=list(settings.tags),
            config={**config, "hydra": context},
            dir=str(run_dir),
            id=wandb_run_id(run_dir, start_step),
            resume="allow",
        )
        try:
            self.run = wandb.init(mode=mode, **init)
        except wandb.Error as error:  # e.g. the server is unreachable: keep the run, log offline
            if mode != "online":
                raise
            log.warning(f"W&B: online init failed ({str(error).splitlines()[0]}); logging offline instead")
            self.run = wandb.init(mode="offline", **init)

    def write(self, record: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in record.items() if k != "step" and v is not None}, step=record["step"])

    def close(self) -> None:
        self.run.finish()


def open_sinks(config: Config, resolved: dict[str, Any], run_dir: Path, start_step: int = 0) -> list[Sink]:
    console = ConsoleSink(config.train.max_steps, start_step)
    sinks: list[Sink] = [JsonlSink(run_dir / "metrics.jsonl", start_step), console]
    if config.logging.wandb.mode != "disabled":
        sinks.append(WandbSink(config.logging.wandb, resolved, run_dir, start_step))
    return sinks
