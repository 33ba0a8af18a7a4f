"""Launched by tests/test_estimate.py by run_worker (gloo, real tensors): the planner's scenarios
for real. For each, the trainer's mesh, model and optimizer, a warm-up (one micro-batch and an
optimizer step, as the planner does: AdamW's states exist from then on), then one full step (every
micro-batch of it, on real data; with context parallel each rank's tokens of every row, as the
trainer takes them) under an independent storage counter and, inside it, the same FSDPMemTracker
the planner uses (both dispatch modes see the same operators; neither changes what the other counts).

Rank 0 writes `<out>/<name>.json`:
- `counted`: the most bytes of live tensor storages at once in that step (StorageCounter below:
  its own count, nothing of the planner's tracker). torch.profiler's allocator count was tried
  first and is not usable here: gloo's worker threads free collective buffers with profiling off
  on their thread, so c10's running total never takes them off (it read 106 MB where 48 MB were live);
- `real`: the bytes of the real sharded tensors counted from their storages (the gradients as the
  optimizer step receives them);
- `tracked`: the tracker's figures (the planner's own measurement, on real tensors).
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch._guards import active_fake_mode
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from dtrain.checks import check_config
from dtrain.data.formats import load_tokenizer
from dtrain.data.pipeline import build_data
from dtrain.data.prompts import Rollout, rollout_batch
from dtrain.distributed import build_parallel, init_distributed
from dtrain.estimate.app import compose
from dtrain.estimate.measure import track_step
from dtrain.estimate.planner import grpo_tokens
from dtrain.model import build_frozen_model, build_model, load_model_config, tokenizer_source
from dtrain.objectives import Context, build_objective, objective_of
from dtrain.optim import build_optimizer
from dtrain.step import local_micro_batch, optimizer_step
from tests.estimate_scenarios import SCENARIOS


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor counts its local shard, an NF4
    base weight the plain tensors it holds: __tensor_flatten__)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        for plain in flat_tensors(local) if is_traceable_wrapper_subclass(local) else [local]:
            storage = plain.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def flat_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a tensor subclass wraps."""
    return [getattr(tensor, attr) for attr in tensor.__tensor_flatten__()[0]]


class StorageCounter(TorchDispatchMode):
    """The most bytes of live tensor storages at once, counted per operator (an independent count:
    no FSDP or module bookkeeping, nothing of the planner's tracker). Every plain tensor an operator
    returns registers its storage (views and in-place results share one); a storage counts until
    its last reference is gone, on whatever thread (StorageWeakRef.expired). Starts from `alive`:
    the tensors that exist before the step (parameters, buffers, optimizer state, the step's inputs).

    A DTensor operator is handed back (NotImplemented) so that DTensor runs it and this mode sees the
    plain operators it runs on the local shards: loss_parallel's cross-entropy makes its temporaries
    (the shifted logits, their exp, the gradient's zeros, exp and sum: 3 logit shards) inside one
    DTensor operator, and a mode that ran DTensor operators whole saw only their outputs. DTensor
    also runs operators on fake tensors, in a fake mode of its own, to work out output shapes: those
    allocate nothing and are not counted."""

    def __init__(self, alive: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.total = 0  # an upper bound of the live bytes until the next recount
        for tensor in alive:
            self._add_plain(tensor)
        self.peak = self._recount()

    def _add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()
        known = self.storages.get(key)
        if known is None or known[0].expired():
            self.storages[key] = (StorageWeakRef(storage), nbytes)
            self.total += nbytes
        elif nbytes > known[1]:  # FSDP grows an unsharded parameter's storage in place (resize_)
            self.storages[key] = (known[0], nbytes)
            self.total += nbytes - known[1]

    def _add_plain(self, tensor: torch.Tensor) -> None:
        """The plain tensors a subclass wraps (__tensor_flatten__): a DTensor's local shard among
        `alive`; funcol's AsyncCollectiveTensor, which runs its own operators with this mode off."""
        if not is_traceable_wrapper_subclass(tensor):  # a plain tensor, or a Parameter of one (1x1)
            self._add(tensor)
            return
        for attr in tensor.__tensor_flatten__()[0]:
            inner = getattr(tensor, attr)
            if isinstance(inner, torch.Tensor):
                self._add_plain(inner)

    def _recount(self) -> int:
        """Drop the storages freed since, and re-read every size (FSDP shrinks storages to 0 bytes)."""
        live = {}
        for key, (ref, _) in self.storages.items():
            storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            if storage is not None:
                live[key] = (ref, storage.nbytes())
            del storage  # a strong reference: dropped at once
        self.storages = live
        self.total = sum(nbytes for _, nbytes in live.values())
        return self.total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's)
        if any(issubclass(kind, DTensor) for kind in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if active_fake_mode() is not None:  # DTensor's shape pass (the real run has no fake mode)
            return out
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._add_plain(tensor)
        if self.total > self.peak:  # a recount only when the peak may have risen
            self.peak = max(self.peak, self._recount())
        return out


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]


def tensors_of(micro_batches: list[dict]) -> list[torch.Tensor]:
    return [value for mb in micro_batches for value in tree_flatten(mb)[0] if torch.is_tensor(value)]


class RolloutSteps:
    """dtrain.grpo's steps as the trainer holds them (dtrain/data/prompts.py's micro-batches): each
    completion a prompt of data.max_len − grpo.max_completion_length tokens then a completion of
    max_completion_length, with the per-token log-probs the loss reads; the values do not matter."""

    def __init__(self, config, dp_size: int) -> None:  # noqa: ANN001 (a PlanConfig)
        train, settings, data = config.train, config.grpo, config.data
        length = settings.max_completion_length
        tokens = {key: [0.0] * length for key in grpo_tokens(config)}
        rollout = Rollout([3] * (data.max_len - length), [5] * length, 0.5, True, tokens or None)
        self.micro_batches = train.global_batch_size // (train.micro_batch_size * dp_size)
        self.batch = rollout_batch([rollout] * train.micro_batch_size, data.max_len, 2, data.packing)

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        return [{key: value.clone() for key, value in self.batch.items()} for _ in range(self.micro_batches)]


def run(overrides: list[str], device: torch.device) -> dict:
    config = compose(overrides)
    model_config = load_model_config(config.model)
    parallel = build_parallel(check_config(config, dist.get_world_size(), model_config), device)
    model = build_model(model_config, config, parallel, device)  # the CPU's kernel: sdpa
    model.train()
    optimizer = build_optimizer(model, config.optim)
    params = list(model.parameters())

    tokenizer = load_tokenizer(tokenizer_source(config.model))
    train = config.train
    online = objective_of(config).name == "grpo"
    if online:  # dtrain.grpo: its micro-batches of completions, each as long as a row holds
        batches = RolloutSteps(config, parallel.dp_size)
    else:
        batches = build_data(config.data, train, tokenizer, parallel.dp_rank, parallel.dp_size).train
    frozen = functools.partial(build_frozen_model, config, parallel, device, policy=model_config)
    # the planner's loss; dtrain.dpo's precompute: a table of the dataset's pairs (values do not matter)
    table = lambda: torch.zeros(0 if online else len(batches), 2)  # noqa: E731
    objective = build_objective(Context(config, model, parallel, frozen, reference_table=table))

    def step_batches() -> list[dict[str, torch.Tensor]]:
        return [local_micro_batch(mb, parallel) for mb in batches.next_step()]  # in order

    max_norm = config.optim.max_grad_norm
    # Warm-up, as the planner does: DTensor's first run of each operator, and AdamW's states.
    warm_up = step_batches()
    objective.begin_step(warm_up[:1])
    objective.micro_step(warm_up[0])
    optimizer_step(optimizer, params, max_norm)

    grads: list[int] = []  # the gradients' storages as the optimizer step receives them (LoRA: adapters')
    trained = [p for p in params if p.requires_grad]
    hook = optimizer.register_step_pre_hook(lambda *_: grads.append(storage_bytes(p.grad for p in trained)))
    micro_batches = step_batches()
    frozen_tensors = [
        tensor for model in objective.frozen for tensor in [*model.parameters(), *model.buffers()]
    ]
    alive = [*model.parameters(), *model.buffers(), *optimizer_tensors(optimizer), *tensors_of(micro_batches)]
    with StorageCounter([*alive, *frozen_tensors]) as counter:
        tracked = track_step(model, optimizer, micro_batches, objective, max_norm)
    hook.remove()
    real = {
        "params": storage_bytes([*model.parameters(), *model.buffers()]),
        "grads": grads[0],
        "optimizer": storage_bytes(optimizer_tensors(optimizer)),
        "reference": storage_bytes(p for other in objective.frozen for p in other.parameters()),
    }
    if online and config.rollout.engine == "hf":  # the generator's copy, as dtrain.rollout.hf builds it
        from dtrain.rollout.hf import build_generator

        dtype = torch.bfloat16 if config.train.precision == "bf16" else torch.float32
        real["generator"] = storage_bytes(
            p.data for p in build_generator(model_config, dtype, device).parameters()
        )
    step = asdict(tracked)
    step.pop("modules")
    return {"real": real, "tracked": step, "counted": counter.peak, "accumulation": len(micro_batches)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("names", nargs="*", help="scenarios to run (default: all)")
    args = parser.parse_args()
    device = init_distributed(timeout_s=300)
    for name in args.names or SCENARIOS:
        result = run(SCENARIOS[name], device)
        if dist.get_rank() == 0:
            (args.out / f"{name}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
