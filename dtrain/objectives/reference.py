"""DPO's reference policy (dpo.reference): each step's pairs get their reference log-probabilities,
`ref_logps` [pairs, 2], before the step's first gradient.

- `precompute`: the starting policy's, computed once over every training pair before step 1 (no
  gradients, every dp rank a share of the pairs) and kept in the run folder
  (reference_logps.safetensors): a resumed run, on any mesh, reads them instead of recomputing them
  from a policy that has moved. No reference model in memory while training.
- `live`: a frozen copy of the starting policy (dtrain.model.build_model(frozen=True): the same
  weights, LoRA adapters included, in the compute dtype), sharded like the policy, run on each step's
  micro-batches.
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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dtrain.config import Config, ConfigError
from dtrain.data.loader import SFTLoader
from dtrain.data.pairs import Pairs
from dtrain.distributed import Parallel
from dtrain.loss import LossSettings, loss_context
from dtrain.objectives.dpo_loss import sequence_logps
from dtrain.parallel.lora import adapters_bypassed
from dtrain.parallel.parallelize import reshard
from dtrain.step import local_micro_batch

log = logging.getLogger("dtrain")
FILE = "reference_logps.safetensors"


class Reference:
    """Sets each micro-batch's `ref_logps`: read from the table (precompute) or a forward without
    gradients of `model` (live: the frozen copy; adapters_off: the policy, adapters bypassed)."""

    def __init__(
        self, mode: str, parallel: Parallel, loss: LossSettings, model: torch.nn.Module | None = None
    ) -> None:
        self.mode, self.parallel, self.loss, self.model = mode, parallel, loss, model
        self.table: torch.Tensor | None = None  # precompute: [pairs of the dataset, 2]

    def set_logps(self, micro_batches: list[dict[str, Any]]) -> None:
        for micro_batch in micro_batches:
            if self.table is not None:
                micro_batch["ref_logps"] = self.table[micro_batch["pair_index"]]
            else:
                micro_batch["ref_logps"] = self.forward(micro_batch)
        if self.mode == "live":  # its root stays gathered after a forward without backward: free it
            reshard(self.model)

    @torch.no_grad()
    def forward(self, micro_batch: dict[str, Any]) -> torch.Tensor:
        assert self.model is not None
        bypassed = adapters_bypassed(self.model) if self.mode == "adapters_off" else contextlib.nullcontext()
        with loss_context(self.loss.parallel), bypassed:
            return sequence_logps(
                self.model, micro_batch, self.loss.impl, self.loss.chunk, self.parallel["cp"]
            )


def precomputed(
    config: Config,
    model: torch.nn.Module,
    loader: SFTLoader,
    parallel: Parallel,
    run_dir: Path,
    step: int,
    resume_from: Path | None,
) -> torch.Tensor:
    """The reference table [pairs, 2] on this rank's device: computed from `model` at step 0 (and
    written by rank 0), else read from the run folder (or the resumed checkpoint's run folder)."""
    pairs = loader.rows
    identity = fingerprint(config, pairs)
    if step > 0:
        return read_table(identity, run_dir, resume_from, step).to(parallel.device)
    table = compute_table(model, loader, parallel, LossSettings.of(config.parallel))
    if dist.get_rank() == 0:  # whole or not at all: a partial file is never read
        run_dir.mkdir(parents=True, exist_ok=True)
        partial = run_dir / f".{FILE}.partial"
        save_file({"logps": table.cpu().contiguous()}, str(partial), metadata={"fingerprint": identity})
        os.replace(partial, run_dir / FILE)
    log.info(f"dpo.reference=precompute: the reference log-probs of {len(pairs)} pairs in {run_dir / FILE}")
    return table


def fingerprint(config: Config, pairs: Pairs) -> str:
    """What the table depends on: the starting policy (model, LoRA, seed, precision) and the pairs
    (their token ids, in order)."""
    identity = {
        "model": repr(config.model),
        "lora": repr(config.lora),
        "seed": config.train.seed,
        "precision": config.train.precision,
        "pairs": len(pairs),
        "max_len": pairs.max_len,
    }
    digest = hashlib.sha1(json.dumps(identity, sort_keys=True).encode())
    for batch in pairs.examples.with_format("numpy").iter(batch_size=4096):
        for name in ("prompt_ids", "chosen_ids", "rejected_ids"):
            for ids in batch[name]:
                digest.update(ids.tobytes())
    return digest.hexdigest()


def read_table(identity: str, run_dir: Path, resume_from: Path | None, step: int) -> torch.Tensor:
    candidates = [run_dir / FILE]
    if resume_from is not None:  # checkpoint.resume=PATH: the run folder that checkpoint belongs to
        candidates.append(resume_from.parent.parent / FILE)
    for path in candidates:
        if path.is_file():
            with safe_open(str(path), "pt") as reader:
                saved = (reader.metadata() or {}).get("fingerprint")
            if saved != identity:
                raise ConfigError(
                    f"{path}: the reference log-probs of another model or other data, which cannot be "
                    f"computed again at step {step} (the policy has moved); checkpoint.resume=never "
                    "starts over"
                )
            log.info(f"dpo.reference=precompute: read the reference log-probs from {path}")
            return load_file(str(path))["logps"]
    raise ConfigError(
        f"{candidates[0]}: missing; a run resumed at step {step} needs the reference log-probs computed at "
        "its start (the policy has moved since): checkpoint.resume=never starts over"
    )


@torch.no_grad()
def compute_table(
    model: torch.nn.Module, loader: SFTLoader, parallel: Parallel, loss: LossSettings
) -> torch.Tensor:
    """Every pair's log-probabilities under `model` as it is now, [pairs, 2] on every rank, each
    computed in the micro-batch the first epoch trains it in (the loader's stream from its start), so
    that at step 1 policy and reference compute the same sums the same way: the loss is exactly ln 2
    and no pair is accurate yet. Each dp rank computes its pairs, then they are all-gathered."""
    stream = loader.restarted()
    steps = -(-len(stream) // stream.global_batch_size)  # every pair at least once
    training = model.training
    model.eval()  # no dropout in the reference
    reference = Reference("live", parallel, loss, model)
    indices, logps = [], []
    for _ in range(steps):
        for micro_batch in stream.next_step():
            indices.append(micro_batch["pair_index"])
            logps.append(reference.forward(local_micro_batch(micro_batch, parallel)))
    model.train(training)
    reshard(model)  # the trainer lists the optimizer's (sharded) parameters after this
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


def gathered(part: torch.Tensor, parallel: Parallel) -> torch.Tensor:
    """Every dp rank's `part` (all of one shape), stacked in dp rank order."""
    part = part.to(parallel.device)
    every = torch.empty((parallel.dp_size, *part.shape), dtype=part.dtype, device=part.device)
    dist.all_gather_into_tensor(every.flatten(0, 1), part, group=parallel["dp"].get_group())
    return every
