"""DPO's reference policy (dpo.reference, dpo.ref_model): each step's pairs get their reference
log-probabilities, `ref_logps` [pairs, 2], before the step's first gradient.

The reference is the starting policy, or with dpo.ref_model the Hugging Face model in that folder
(built frozen and sharded like the policy: dtrain.model.build_frozen_model). Its log-probabilities:

- `precompute`: computed once over every training (and eval) pair before step 1 (no gradients, every
  dp rank a share of the pairs) and kept in the run folder (reference_logps.safetensors): a resumed
  run, on any mesh, reads them (from its own folder, or from the run folder of the checkpoint it
  resumes, which it copies) instead of computing them from a policy that has moved. A table that
  cannot be read is set aside (`unreadable-reference_logps.safetensors`) in one line and, like a
  missing one, computed again from the reference rebuilt (the starting policy's weights, or the
  folder's). No reference model in memory while training.
- `live`: a frozen reference model in the compute dtype, sharded like the policy, run on each step's
  micro-batches; with dpo.sync_ref_model (TR-DPO) it moves towards the policy every
  ref_model_sync_steps steps, and checkpoints keep it.
- `adapters_off` (LoRA): the policy itself with its adapters bypassed, no second model. It is the
  starting policy when the adapters start at zero (B = 0: PEFT's init); from a lora.adapter it is
  the base without it (TRL 1.16 would compare with a frozen copy of that adapter: `precompute` or
  `live` do that, and `auto` takes `precompute` there).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dtrain.config import Config, ConfigError, DPOConfig
from dtrain.data.loader import SFTLoader
from dtrain.data.pairs import Pairs
from dtrain.distributed import Parallel
from dtrain.loss import LossSettings, loss_context
from dtrain.objectives.dpo_loss import sequence_logps, with_tail
from dtrain.parallel.lora import adapters_bypassed
from dtrain.parallel.parallelize import reshard
from dtrain.reliability import agreed_error
from dtrain.step import local_micro_batch

log = logging.getLogger("dtrain")
FILE = "reference_logps.safetensors"
UNREADABLE = "unreadable-"  # the prefix of a table set aside because it cannot be read (as checkpoints)


class Reference:
    """Sets each micro-batch's `ref_logps`: read from the tables (precompute) or a forward without
    gradients of `model` (live: the frozen reference model; adapters_off: the policy, adapters
    bypassed)."""

    def __init__(
        self,
        mode: str,
        parallel: Parallel,
        loss: LossSettings,
        settings: DPOConfig,
        model: torch.nn.Module | None = None,
    ) -> None:
        self.mode, self.parallel, self.loss, self.settings, self.model = mode, parallel, loss, settings, model
        self.table: torch.Tensor | None = None  # precompute: [training pairs, 2]
        self.eval_table: torch.Tensor | None = None  # precompute: [eval pairs, 2]
        self.source: Path | None = None  # precompute at a resume: the table file read

    def set_logps(self, micro_batches: list[dict[str, Any]], evaluating: bool = False) -> None:
        table = self.eval_table if evaluating else self.table
        for micro_batch in micro_batches:
            if self.mode == "precompute":
                assert table is not None
                micro_batch["ref_logps"] = table[micro_batch["pair_index"]]
            else:
                micro_batch["ref_logps"] = self.forward(micro_batch)
        if self.mode == "live":  # its root stays gathered after a forward without backward: free it
            reshard(self.model)

    @torch.no_grad()
    def forward(self, micro_batch: dict[str, Any]) -> torch.Tensor:
        assert self.model is not None
        bypassed = adapters_bypassed(self.model) if self.mode == "adapters_off" else contextlib.nullcontext()
        with loss_context(self.loss.parallel), bypassed:
            cp = self.parallel["cp"]
            return sequence_logps(self.model, micro_batch, self.loss.impl, self.loss.chunk, cp, self.settings)

    @torch.no_grad()
    def sync(self, policy: torch.nn.Module) -> None:
        """TR-DPO: reference ← α · policy + (1 − α) · reference, parameter by parameter (each rank its
        shards: both are sharded alike), as TRL's SyncRefModelCallback mixes them."""
        assert self.model is not None
        alpha = self.settings.ref_model_mixup_alpha
        for ref, own in zip(self.model.parameters(), policy.parameters(), strict=True):
            ref.mul_(1.0 - alpha).add_(own.detach().to(ref.dtype), alpha=alpha)


def describe(mode: str, settings: DPOConfig, adapters: bool) -> str:
    """The start line's words on the reference dtrain.dpo took."""
    what = f"the model in {settings.ref_model}" if settings.ref_model else "the starting policy"
    if adapters and not settings.ref_model:
        what += " (the base with its starting adapters)"
    if mode == "adapters_off":
        said = "the policy with its LoRA adapters bypassed (the base model)"
    elif mode == "live":
        said = f"{what}, frozen, run beside the policy"
    else:
        said = f"{what}: its log-probs computed before step 1 ({FILE})"
    if settings.sync_ref_model:
        said += (
            f", moved towards the policy every {settings.ref_model_sync_steps} steps "
            f"(TR-DPO, alpha {settings.ref_model_mixup_alpha})"
        )
    return f"dpo reference={mode}: {said}"


def precomputed(
    config: Config,
    reference: Reference,
    policy: torch.nn.Module,
    frozen: Callable[[str | None], torch.nn.Module],
    loader: SFTLoader,
    evals: list[dict[str, Any]] | None,
    run_dir: Path,
    step: int,
    resume_from: Path | None,
) -> None:
    """Set the reference's tables (on this rank's device): at step 0 computed from the reference
    (the policy as it is, or dpo.ref_model's model) and written by rank 0; later read from the run
    folder or the resumed checkpoint's run folder (copied into this one), or computed again from the
    reference rebuilt (`frozen`) where none can be read."""
    parallel = reference.parallel
    identity = fingerprint(config, loader.rows, evals)
    if step > 0:
        found = read_table(identity, run_dir, resume_from, step)
        if found is not None:
            (reference.table, reference.eval_table), reference.source = found
            reference.table = reference.table.to(parallel.device)
            if reference.eval_table is not None:
                reference.eval_table = reference.eval_table.to(parallel.device)
            if reference.source != run_dir / FILE:  # this folder's own later resumes find it here
                write_table(run_dir, reference.table, reference.eval_table, identity)
            return
    settings = config.dpo
    rebuilt = settings.ref_model is not None or step > 0
    model = frozen(settings.ref_model) if rebuilt else policy
    reference.table = compute_table(model, loader, reference)
    reference.eval_table = compute_eval_table(model, evals, reference) if evals is not None else None
    if rebuilt:
        del model  # its shards go: no reference model in memory while training
    write_table(run_dir, reference.table, reference.eval_table, identity)
    pairs = len(loader.rows)
    log.info(f"dpo.reference=precompute: the reference log-probs of {pairs} pairs in {run_dir / FILE}")


def write_table(run_dir: Path, table: torch.Tensor, evals: torch.Tensor | None, identity: str) -> None:
    """Rank 0 writes the tables, whole or not at all (a partial file is never read)."""
    if dist.get_rank() != 0:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    partial = run_dir / f".{FILE}.partial"
    tensors = {"logps": table.cpu().contiguous()}
    if evals is not None:
        tensors["eval_logps"] = evals.cpu().contiguous()
    save_file(tensors, str(partial), metadata={"fingerprint": identity})
    os.replace(partial, run_dir / FILE)


def fingerprint(config: Config, pairs: Pairs, evals: list[dict[str, Any]] | None) -> str:
    """What the tables depend on: the reference (model, LoRA, seed, precision, dpo.ref_model), how a
    sequence is summed (dpo.ld_alpha) and the pairs (their token ids, in order; the eval pairs' count)."""
    identity = {
        "model": repr(config.model),
        "lora": repr(config.lora),
        "seed": config.train.seed,
        "precision": config.train.precision,
        "ref_model": config.dpo.ref_model,
        "ld_alpha": config.dpo.ld_alpha,
        "pairs": len(pairs),
        "max_len": pairs.max_len,
        "eval": evals is not None,  # its pairs are data.*'s, which a run folder's identity holds
    }
    digest = hashlib.sha1(json.dumps(identity, sort_keys=True).encode())
    for batch in pairs.examples.with_format("numpy").iter(batch_size=4096):
        for name in ("prompt_ids", "chosen_ids", "rejected_ids"):
            for ids in batch[name]:
                digest.update(ids.tobytes())
    return digest.hexdigest()


Tables = tuple[torch.Tensor, torch.Tensor | None]


def read_table(
    identity: str, run_dir: Path, resume_from: Path | None, step: int
) -> tuple[Tables, Path] | None:
    """The tables of this run (its fingerprint) and the file read: the run folder's, else the run
    folder the resumed checkpoint belongs to. A file that cannot be read is set aside in one line; one
    of another run is an error; None: none to read."""
    candidates = [run_dir / FILE]
    if resume_from is not None:  # checkpoint.resume=PATH: the run folder that checkpoint belongs to
        candidates.append(resume_from.parent.parent / FILE)
    unreadable = False
    for path in candidates:
        if not path.is_file():
            continue
        tables, saved, error = None, None, None
        try:
            with safe_open(str(path), "pt") as reader:
                saved = (reader.metadata() or {}).get("fingerprint")
            loaded = load_file(str(path))
            tables = (loaded["logps"], loaded.get("eval_logps"))
        except Exception as caught:  # truncated or garbled: SafetensorError, OSError, a missing tensor
            error = f"{type(caught).__name__}: {caught}"
        error = agreed_error(error)
        if error is not None:
            set_aside(path, error, step)
            unreadable = True
            continue
        if saved != identity:
            raise ConfigError(
                f"{path}: the reference log-probs of another model or other data; checkpoint.resume=never "
                "starts over"
            )
        log.info(f"dpo.reference=precompute: read the reference log-probs from {path}")
        assert tables is not None
        return tables, path
    if not unreadable:
        log.warning(
            f"dpo.reference=precompute: {candidates[0]} is missing: the reference log-probs are computed "
            f"again at step {step} from the reference rebuilt (not from the policy, which has moved)"
        )
    return None


def set_aside(path: Path, reason: str, step: int) -> None:
    """Rank 0 renames an unreadable table out of the way (never deletes it), said in one line."""
    aside = path.with_name(f"{UNREADABLE}{path.name}")
    if dist.get_rank() == 0:
        number = 1
        while aside.exists():
            number += 1
            aside = path.with_name(f"{UNREADABLE}{path.stem}-{number}{path.suffix}")
        os.rename(path, aside)
    dist.barrier()
    log.warning(
        f"{path} cannot be read ({reason}): set aside as {aside.name}; the reference log-probs are computed "
        f"again at step {step} from the reference rebuilt"
    )


@torch.no_grad()
def compute_table(model: torch.nn.Module, loader: SFTLoader, reference: Reference) -> torch.Tensor:
    """Every training pair's log-probabilities under `model` as it is now, [pairs, 2] on every rank,
    each computed in the micro-batch the first epoch trains it in (the loader's stream from its start),
    so that at step 1 policy and reference compute the same sums the same way: the loss is exactly
    ln 2 and no pair is accurate yet. Each dp rank computes its pairs, then they are all-gathered."""
    parallel = reference.parallel
    stream = loader.restarted()
    steps = -(-len(stream) // stream.global_batch_size)  # every pair at least once
    indices, logps = [], []
    with _evaluating(model, reference) as forward:
        for _ in range(steps):
            for micro_batch in stream.next_step():
                indices.append(micro_batch["pair_index"])
                logps.append(forward(micro_batch))
    order, values = (gathered(torch.cat(parts), parallel) for parts in (indices, logps))
    # In the stream's order (step, rank, place), each pair's first time: the tail's second epoch
    # repeats the first pairs of its first.
    per_step = stream.global_batch_size // parallel.dp_size
    order = order.view(parallel.dp_size, steps, per_step).transpose(0, 1).flatten()
    values = values.view(parallel.dp_size, steps, per_step, 2).transpose(0, 1).flatten(0, 2)
    table = torch.full((len(stream), 2), float("nan"), device=parallel.device)
    first = {}
    for place, pair in enumerate(order.tolist()):
        first.setdefault(pair, place)
    table[list(first)] = values[list(first.values())]
    return table


@torch.no_grad()
def compute_eval_table(
    model: torch.nn.Module, micro_batches: list[dict[str, Any]], reference: Reference
) -> torch.Tensor:
    """Every eval pair's log-probabilities under `model`, [eval pairs, 2] on every rank, each in the
    eval micro-batch that holds it (this rank's share, gathered over dp)."""
    parallel = reference.parallel
    with _evaluating(model, reference) as forward:
        mine = [(mb["pair_index"], forward(mb).cpu()) for mb in micro_batches]
    shares: list[Any] = [None] * parallel.dp_size
    dist.all_gather_object(shares, mine, group=parallel["dp"].get_group())
    count = 1 + max((int(index.max()) for share in shares for index, _ in share if len(index)), default=-1)
    table = torch.full((count, 2), float("nan"))
    for share in shares:
        for index, values in share:
            table[index] = values
    return table.to(parallel.device)


@contextlib.contextmanager
def _evaluating(model: torch.nn.Module, reference: Reference):  # noqa: ANN202
    """A forward of a host micro-batch under `model` in eval mode (no dropout in the reference), its
    gathered parameters freed after (the trainer lists the optimizer's sharded parameters next)."""
    training = model.training
    model.eval()
    live = Reference("live", reference.parallel, reference.loss, reference.settings, model)

    def forward(micro_batch: dict[str, Any]) -> torch.Tensor:
        prepared = with_tail(micro_batch, reference.settings)
        return live.forward(local_micro_batch(prepared, reference.parallel))

    try:
        yield forward
    finally:
        model.train(training)
        reshard(model)


def gathered(part: torch.Tensor, parallel: Parallel) -> torch.Tensor:
    """Every dp rank's `part` (all of one shape), stacked in dp rank order."""
    part = part.to(parallel.device).contiguous()
    every = torch.empty((parallel.dp_size, *part.shape), dtype=part.dtype, device=part.device)
    dist.all_gather_single(every.flatten(0, 1), part, group=parallel["dp"].get_group())
    return every
