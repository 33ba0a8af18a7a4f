"""One training step under torch's `FSDPMemTracker`, or its `MemTracker` for a model without FSDP
(one process, or tensor parallel alone: parallelize applies no fully_shard there): the same
measurement for a fake run (the planner) and a real one (the tests, the GPU check), so the two can be
compared number for number.

The step is the trainer's own (the objective's `begin_step`, its `micro_step` per micro-batch, then
`optimizer_step`). The caller runs one warm-up step first, outside the tracker: DTensor's first run
of each op (sharding propagation, its caches) would otherwise show as a false spike, and the first
step has no optimizer state yet.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from copy import deepcopy
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPModState, _FSDPRefType
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from dtrain.fused_divergence import FusedDivergence
from dtrain.fused_loss import FusedLinearCrossEntropy
from dtrain.model import canonical_name
from dtrain.objectives import Objective
from dtrain.parallel.parallelize import decoder_layers, reshard
from dtrain.step import optimizer_step

_R, _S = _FSDPRefType, _FSDPModState  # FSDPMemTracker's categories and module states
_M = _MemRefType  # MemTracker's categories
FUSED_LOSSES = (FusedLinearCrossEntropy, FusedDivergence)  # the losses whose temporaries are probed
TOTAL = "Total"

# How the report groups the tracker's categories at the peak (every category in exactly one group).
PEAK_GROUPS = {
    "params": (_R.SHARDED_PARAM, _R.BUFFER),
    "grads": (_R.SHARDED_GRAD,),
    "optimizer": (_R.OPT,),
    "unsharded_params": (_R.UNSHARDED_PARAM, _R.ALL_GATHER),
    "activations": (_R.ACT, _R.INP),
    "temporaries": (_R.TEMP, _R.UNSHARDED_GRAD, _R.REDUCE_SCATTER),
}
# The same groups of MemTracker's categories (no FSDP: nothing gathered; the inputs are "Other").
PLAIN_GROUPS = {
    "params": (_M.PARAM, _M.BUFFER),
    "grads": (_M.GRAD,),
    "optimizer": (_M.OPT,),
    "unsharded_params": (),
    "activations": (_M.ACT, _M.OTH),
    "temporaries": (_M.TEMP,),
}
# (before forward, after forward, peak forward, peak backward) in each tracker's module states
FSDP_STATES = (_S.BEF_PRE_FW, _S.AFT_POST_FW, _S.PEAK_FW, _S.PEAK_BW)
PLAIN_STATES = (_ModState.PRE_FW, _ModState.POST_FW, _ModState.PEAK_FW, _ModState.PEAK_BW)


@dataclass
class ModulePeak:
    """One FSDP module's figures over the tracked step (max over its micro-batches)."""

    name: str
    peak_forward: int = 0  # the most memory in use while its forward ran
    peak_backward: int = 0
    activations: int = 0  # activation bytes its forward left behind (saved for backward)


@dataclass
class StepMemory:
    """Per-rank bytes of one steady-state optimizer step."""

    params: int  # sharded parameters and buffers, as held between steps
    grads: int  # sharded gradients at the end of the last backward
    optimizer: int  # AdamW state after the step (exp_avg, exp_avg_sq, step)
    reference: int  # dtrain.dpo's live reference: its frozen sharded weights (0: none)
    peak: int
    at_peak: dict[str, int]  # PEAK_GROUPS at the moment of the peak; sums to `peak`
    peak_phase: str  # where the peak happened: optimizer step, loss, or a module's forward / backward
    logits: int  # lm_head's output (this rank's shard), part of the activations; 0 when fused
    micro_batches: int
    modules: list[ModulePeak] = field(default_factory=list)
    # loss_impl=fused: the temporaries of the loss's forward (its peak minus what it keeps: the
    # saved gradients), max over micro-batches; None for the other losses (not a module of their own)
    loss_temporaries: int | None = None
    # dtrain.grpo: its generator's memory held through the step (the hf engine's copy of the policy,
    # vLLM's share without sleep mode) and what a rank holds while it samples (counted, not tracked:
    # dtrain.estimate.planner.generator_memory); 0 for the other objectives
    generator: int = 0
    generation_peak: int = 0
    train_peak: int = 0  # dtrain.grpo: the tracked step's peak with the generator held through it


class _ModuleStats(WeakIdKeyDictionary):
    """The tracker's per-module stats, kept for what the tracker asks on every op: values() that
    does not dereference every key (torch's weak reference calls hasattr on each module, a miss
    through nn.Module and checkpoint_wrapper __getattr__: a quarter of a Llama-3-8B plan), and the
    stats by module name (`by_name`, for _update_active_peaks). Modules outlive the step, so
    holding the values strongly changes nothing."""

    def __init__(self) -> None:
        super().__init__()
        self._values: dict[int, object] = {}
        self.by_name: dict[str, list] = {}

    def __setitem__(self, key: object, value: object) -> None:
        if key in self:
            del self[key]
        super().__setitem__(key, value)
        self._values[id(key)] = value
        self.by_name.setdefault(value.mod_fqn, []).append(value)

    def __delitem__(self, key: object) -> None:
        value = self._values.pop(id(key))
        self.by_name[value.mod_fqn].remove(value)
        super().__delitem__(key)

    def clear(self) -> None:
        super().clear()
        self._values.clear()
        self.by_name.clear()

    def values(self):  # noqa: ANN201 (the same as the parent's, a view of the values)
        return self._values.values()


def _update_active_peaks(tracker: MemTracker, peak_state: object) -> None:
    """torch's MemTracker._update_peak_stats (both trackers call it after every op), walking the
    modules running now (the tracker's `parents`, a few) instead of every module it has seen and
    asking each whether it runs: without FSDP the tracker follows every module (an 8B LoRA plan's
    1,300: a fifth of the plan's time). The same updates, in the same cases."""
    current = tracker._curr_mem_snap
    for name in tracker._mod_tracker.parents:
        for stats in tracker.memory_tracking.by_name.get(name, ()):
            if peak_state in stats.snapshots:
                for device, snapshot in current.items():
                    if stats.local_peak.get(device, 0) < snapshot[TOTAL]:
                        stats.local_peak[device] = snapshot[TOTAL]
                        stats.snapshots[peak_state][-1][device] = deepcopy(snapshot)
    for device, snapshot in current.items():
        if tracker._peak_mem.get(device, 0) < snapshot[TOTAL]:
            tracker._peak_mem[device] = snapshot[TOTAL]
            tracker._peak_mem_snap[device] = deepcopy(snapshot)


def _total(snapshot: dict, key: str) -> int:
    """Sum over the devices of a tracker snapshot (it keeps one figure per device)."""
    return sum(per_device.get(key, 0) for per_device in snapshot.values())


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.untyped_storage().nbytes()


def _harvest(tracker: MemTracker, modules: dict[str, ModulePeak], tracked: set[int]) -> None:
    """Fold the tracker's per-module snapshots of one micro-batch into `modules` (max over them): the
    modules of `tracked` (ids: FSDP's, or without FSDP those it would wrap, the root and the decoder
    layers; MemTracker follows every module)."""
    fsdp = isinstance(tracker, FSDPMemTracker)
    before, after, peak_forward, peak_backward = FSDP_STATES if fsdp else PLAIN_STATES
    activation = _R.ACT if fsdp else _M.ACT
    for module, stats in tracker.memory_tracking.items():
        if id(module) not in tracked:
            continue
        name = canonical_name(stats.mod_fqn).removeprefix("FSDP")  # fully_shard renames the root class
        entry = modules.setdefault(name, ModulePeak(name))
        snaps = stats.snapshots
        for state, attr in ((peak_forward, "peak_forward"), (peak_backward, "peak_backward")):
            for snap in snaps.get(state, []):
                setattr(entry, attr, max(getattr(entry, attr), _total(snap, TOTAL)))
        if snaps.get(before) and snaps.get(after):
            kept = _total(snaps[after][0], activation) - _total(snaps[before][0], activation)
            entry.activations = max(entry.activations, kept)


def tracker_for(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: tuple) -> MemTracker:
    """FSDPMemTracker for a model FSDP shards; MemTracker without FSDP, told of the parameters,
    buffers, optimizer state and inputs held before it starts (FSDPMemTracker finds FSDP's own)."""
    if isinstance(model, FSDPModule):
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs(inputs)
    else:
        tracker = MemTracker()
        tracker.track_external(model, optimizer, *(t for mb in inputs for t in mb.values()))
        # MemTracker hooks every parameter's gradient at its module's first forward (private:
        # _param_to_grad_hook_handles). A frozen one (LoRA's base) refuses a hook: marked hooked.
        for param in model.parameters():
            if not param.requires_grad:
                tracker._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)
        # The others from the start: lm_head's is outside the model's forward under the chunked and
        # fused losses (loss.head_detached), where it would get none.
        tracker._track_module_params_and_buffers(model, install_grad_hooks=True)
    tracker.memory_tracking = _ModuleStats()
    tracker._update_peak_stats = functools.partial(_update_active_peaks, tracker)
    return tracker


class _NoHook:
    """The handle of a gradient hook never registered (a frozen parameter's): nothing to remove."""

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


def _tracked_modules(model: nn.Module) -> set[int]:
    if isinstance(model, FSDPModule):
        return {id(module) for module in model.modules() if isinstance(module, FSDPModule)}
    return {id(model), *(id(layer) for layer in decoder_layers(model))}


def _peak_phase(peak: int, peak_before_optimizer: int, modules: list[ModulePeak]) -> str:
    if peak > peak_before_optimizer:
        return "optimizer step"
    # Deepest module whose own forward or backward saw the peak; none: it was in the loss, which runs
    # after the root's forward and before its backward hooks.
    for module in sorted(modules, key=lambda m: -m.name.count(".")):
        for direction, value in (("backward", module.peak_backward), ("forward", module.peak_forward)):
            if value == peak:
                return f"{direction} of {module.name}"
    return "loss (cross-entropy forward or backward, outside the model's modules)"


def track_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[dict[str, torch.Tensor]],
    objective: Objective,
    max_grad_norm: float,
    run: int | None = None,
) -> StepMemory:
    """Run one optimizer step (the objective's micro-steps on the first `run` of `micro_batches`,
    default all; then clip and AdamW) under the tracker. All of `micro_batches`
    count as inputs: the trainer holds them all. A frozen reference model (dpo.reference=live) is
    not the tracker's: its sharded weights are counted here, alive for the whole step."""
    params = list(model.parameters())
    tracker = tracker_for(model, optimizer, tuple(micro_batches))
    groups = PEAK_GROUPS if isinstance(tracker, FSDPMemTracker) else PLAIN_GROUPS
    # Flex attention is a higher-order operator: the tracker lets it through its __torch_dispatch__
    # (torch's switch for a dispatch mode) and counts its outputs as any op's.
    tracker.supports_higher_order_operators = True
    tracked = _tracked_modules(model)
    logits: list[int] = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: logits.append(_local_bytes(out)))
    modules: dict[str, ModulePeak] = {}
    probe = _LossProbe(tracker)
    # The objective's start of the step (a reference's or the router's forwards, without gradients:
    # their transients stay below the step's own peak) runs before the tracker, which follows one
    # forward per module and micro-batch; then the step starts with its parameters sharded.
    objective.begin_step(micro_batches[:run])
    reshard(model)
    try:
        with tracker, _func_nesting_unreported():
            for index, micro_batch in enumerate(micro_batches[:run]):
                if index:  # the tracker follows one forward per module: start its module stats afresh
                    tracker.reset_mod_stats()
                objective.micro_step(micro_batch)
                _harvest(tracker, modules, tracked)
            peak_before_optimizer = _total(tracker.get_tracker_snapshot("peak"), TOTAL)
            grads = sum(_total(tracker.get_tracker_snapshot("current"), key) for key in groups["grads"])
            optimizer_step(optimizer, params, max_grad_norm)
            current = tracker.get_tracker_snapshot("current")
    finally:
        hook.remove()
        probe.remove()
    peak_snapshot = tracker.get_tracker_snapshot("peak")
    peak = _total(peak_snapshot, TOTAL)
    phase = _peak_phase(peak, peak_before_optimizer, list(modules.values()))
    at_peak = {group: sum(_total(peak_snapshot, key) for key in keys) for group, keys in groups.items()}
    assert sum(at_peak.values()) == peak, (at_peak, peak)  # no category of the tracker left out
    reference = sum(_local_bytes(tensor) for frozen in objective.frozen for tensor in frozen.parameters())
    at_peak["reference"] = reference
    return StepMemory(
        params=sum(_total(current, key) for key in groups["params"]),
        grads=grads,
        optimizer=sum(_total(current, key) for key in groups["optimizer"]),
        reference=reference,
        peak=peak + reference,
        at_peak=at_peak,
        peak_phase=phase,
        logits=max(logits, default=0),  # the fused loss never calls lm_head
        micro_batches=len(micro_batches[:run]),
        modules=sorted(modules.values(), key=lambda m: -max(m.peak_forward, m.peak_backward)),
        loss_temporaries=max(probe.transients, default=None),
    )


@contextlib.contextmanager
def _func_nesting_unreported() -> Iterator[None]:
    """Without torch's "The module hierarchy tracking maybe be messed up" (once per decoder layer and
    micro-batch: 64 lines in a Llama-3-8B DPO plan). transformers 5 makes `apply_rotary_pos_emb` a
    module of class `Func` (hub kernels) that calls the running model's private copy, a second `Func`.
    The tracker (ModTracker) names a module outside the model by its class, so it sees "Func" entered
    inside "Func" and warns, each time: warnings' once-per-place record is reset whenever the filters
    change, which torch does meanwhile. What the nesting confuses is the stats of the name "Func" alone;
    the plan reads the step's totals and the model's own modules, named by their place in the model.
    torch also replaces warnings.formatwarning there, for good: put back."""
    format_warning = warnings.formatwarning
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The module hierarchy tracking maybe be messed up", UserWarning)
        try:
            yield
        finally:
            warnings.formatwarning = format_warning


class _LossProbe:
    """The temporaries of each fused-loss forward: the tracker's peak within it minus the memory in
    use after it (what stays is the saved gradients). FSDPMemTracker follows FSDP modules only, so
    module hooks on FUSED_LOSSES (the fused cross-entropy; dtrain.distill's divergence) restart the
    tracker's peak (private: _peak_mem, _peak_mem_snap) at the loss's start and put back the step's
    peak when that was higher."""

    def __init__(self, tracker: MemTracker) -> None:
        self.tracker, self.transients = tracker, []
        self.handles = [
            register_module_forward_pre_hook(self._before),
            register_module_forward_hook(self._after),
        ]

    def _current(self) -> dict:
        return {dev: snap[TOTAL] for dev, snap in self.tracker._curr_mem_snap.items()}

    def _before(self, module: nn.Module, args: object) -> None:
        if isinstance(module, FUSED_LOSSES):
            self.saved = dict(self.tracker._peak_mem), dict(self.tracker._peak_mem_snap)
            self.tracker._peak_mem = self._current()

    def _after(self, module: nn.Module, args: object, output: object) -> None:
        if not isinstance(module, FUSED_LOSSES):
            return
        tracker, (peak, snap) = self.tracker, self.saved
        self.transients.append(sum(tracker._peak_mem.values()) - sum(self._current().values()))
        for dev, value in peak.items():
            if value >= tracker._peak_mem.get(dev, 0):
                tracker._peak_mem[dev], tracker._peak_mem_snap[dev] = value, snap[dev]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def step_inputs(
    micro_batch_size: int, max_len: int, count: int, device: torch.device, pairs: bool = False
) -> list[dict[str, torch.Tensor]]:
    """Micro-batches with the loader's shapes and dtypes; the values do not change the memory.
    `pairs` (dtrain.dpo): micro_batch_size pairs, two rows each (unpacked: the most rows a
    micro-batch of pairs takes), with dtrain/data/pairs.py's per-sequence and per-pair tensors."""
    rows = 2 * micro_batch_size if pairs else micro_batch_size
    ids = torch.zeros((rows, max_len), dtype=torch.long, device=device)
    positions = torch.arange(max_len, device=device).expand(rows, -1).contiguous()
    filled = torch.full((rows,), max_len, dtype=torch.long, device=device)
    batch = {"input_ids": ids, "labels": ids, "position_ids": positions, "num_tokens": filled}
    if pairs:
        batch["sequence_index"] = torch.arange(rows, device=device)[:, None].expand(-1, max_len).contiguous()
        batch["completion_tokens"] = filled.clone()
        batch["pair_index"] = torch.arange(micro_batch_size, device=device)
    return [{key: value.clone() for key, value in batch.items()} for _ in range(count)]


def rollout_inputs(
    micro_batch_size: int, max_len: int, completion: int, count: int, device: torch.device, tokens: tuple
) -> list[dict[str, torch.Tensor]]:
    """dtrain.grpo's micro-batches (dtrain/data/prompts.py) with the most a micro-batch of
    `micro_batch_size` completions takes: one sequence a row, max_len - completion prompt tokens
    then `completion` completion tokens; `tokens`: the flat per-token tensors the loss reads
    (old_logps, ref_logps)."""
    rows, prompt = micro_batch_size, max_len - completion
    ids = torch.zeros((rows, max_len), dtype=torch.long, device=device)
    positions = torch.arange(max_len, device=device).expand(rows, -1).contiguous()
    index = torch.where(positions >= prompt - 1, torch.arange(rows, device=device)[:, None], -1)
    index[:, -1] = -1  # the last position predicts nothing
    batch = {
        "input_ids": ids,
        "labels": torch.where(index >= 0, 0, -100),
        "position_ids": positions,
        "num_tokens": torch.full((rows,), max_len, dtype=torch.long, device=device),
        "sequence_index": index,
        "prompt_tokens": torch.full((rows,), prompt, dtype=torch.long, device=device),
        "completion_tokens": torch.full((rows,), completion, dtype=torch.long, device=device),
        "advantages": torch.zeros(rows, device=device),
        "token_offset": torch.arange(rows, device=device) * completion,
    }
    batch |= {key: torch.zeros(rows * completion, device=device) for key in tokens}
    return [{key: value.clone() for key, value in batch.items()} for _ in range(count)]


def tracked_micro_batches(accumulation: int) -> int:
    """Two micro-batches stand for any longer accumulation: from the second on, each holds the same
    (the sharded gradients of the earlier ones, plus its own activations), so memory repeats."""
    return min(accumulation, 2)
