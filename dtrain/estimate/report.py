"""The planner's answer as one JSON object (bytes) or as a table (GiB)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from dtrain.estimate.deepspeed import Layout, layouts
from dtrain.estimate.planner import Plan, Suggestion
from dtrain.parallel.experts import PLAN_IMBALANCE

GIB = 2**30
AT_PEAK_LABELS = {
    "params": "sharded parameters + buffers",
    "grads": "sharded gradients",
    "optimizer": "optimizer state",
    "unsharded_params": "unsharded (all-gathered) parameters",
    "activations": "activations (+ inputs)",
    "temporaries": "temporaries (backward, reduce-scatter)",
    "reference": "frozen model (reference or teacher)",
    "generator": "dtrain.grpo's generator (counted)",
}


def _tracker(shape: Any) -> str:
    """FSDP shards over dp_replicate × dp_shard × cp; with one such rank it is not applied
    (distributed.Parallel.sharded) and torch's MemTracker follows the step."""
    return "FSDPMemTracker" if shape.dp * shape.cp > 1 else "MemTracker (no FSDP at one dp rank)"


def _model_state(plan: Plan) -> int:
    return plan.step.params + plan.step.grads + plan.step.optimizer + plan.step.reference


@dataclass(frozen=True)
class DtrainRow:
    """dtrain's planned model state, in the DeepSpeed table's columns."""

    name: str
    tp: int
    dp: int  # the states are sharded over dp × cp
    model_state: int
    embedding_and_head: int
    logits: int  # this rank's lm_head output shard (0 with a chunked or fused loss)


def dtrain_row(plan: Plan) -> DtrainRow:
    layers = plan.layers
    head = layers["embedding"]["local"] + (0 if plan.tied else layers["lm_head"]["local"])
    state = _model_state(plan)
    return DtrainRow(
        "dtrain (planned)",
        plan.shape.tp,
        plan.shape.world // plan.shape.tp,
        state,
        round(state * head / plan.step.params),  # params, grads and AdamW states share one layout
        plan.step.logits,
    )


def comparisons(plan: Plan) -> list[Layout]:
    """DeepSpeed's layouts of the same model and batch (analytic: deepspeed.py)."""
    rows = plan.micro_batch_size * (2 if plan.objective.startswith("dpo") else 1)  # dtrain.dpo: pairs
    return layouts(plan.census, plan.shape.world, plan.shape.tp, rows, plan.max_len, plan.precision)


def layout_json(layout: Layout) -> dict[str, Any]:
    return {
        "name": layout.name,
        "tp": layout.tp,
        "dp": layout.dp,
        "local_params": layout.local_params,
        "before_first_step": layout.before_first_step,
        "model_state": layout.model_state,
        "embedding_and_head": layout.embedding_and_head,
        "logits_and_loss": layout.logits_and_loss,
        "buffers": [asdict(b) for b in layout.buffers],
        "logits": [asdict(b) for b in layout.logits],
        "analytic": True,
    }


def verdict(peak: int, gpu_memory_gib: float) -> dict[str, Any]:
    budget = round(gpu_memory_gib * GIB)
    return {
        "gpu_memory_bytes": budget,
        "fits": peak <= budget,
        "headroom_bytes": budget - peak,
        "headroom_fraction": (budget - peak) / budget,
    }


def to_json(plan: Plan, gpu_memory_gib: float, suggestions: list[Suggestion], top: int) -> dict[str, Any]:
    step = asdict(plan.step)
    modules = step.pop("modules")[:top]
    return {
        "experiment": {
            "model_type": plan.model_type,
            "num_params": plan.num_params,
            "world_size": plan.shape.world,
            "mesh": plan.shape.degrees(),
            "ep": plan.shape.ep,  # splits dp_shard × cp for the experts (docs/moe.md)
            "micro_batch_size": plan.micro_batch_size,
            "max_len": plan.max_len,
            "precision": plan.precision,
            "activation_checkpointing": plan.activation_checkpointing,
            "attention": plan.attention,
            "accumulation": plan.accumulation,
            "loss_impl": plan.loss_impl,
            "objective": plan.objective,
        },
        "per_rank": step,
        "layers": plan.layers,
        "top_modules": modules,
        "verdict": verdict(plan.step.peak, gpu_memory_gib),
        "dtrain": {**asdict(dtrain_row(plan)), "analytic": False},
        "deepspeed": [layout_json(layout) for layout in comparisons(plan)],
        "suggestions": [
            {"change": s.change, "peak": s.plan.step.peak, "fits": s.fits, "per_rank": asdict(s.plan.step)}
            for s in suggestions
        ],
        "seconds": plan.seconds,
    }


def _unit(plan: Plan) -> tuple[str, int]:
    """GiB for real models, MiB for small ones (whose figures would all read 0.00 GiB)."""
    return ("GiB", GIB) if plan.step.peak >= GIB else ("MiB", 2**20)


def to_table(plan: Plan, gpu_memory_gib: float, suggestions: list[Suggestion], top: int) -> str:
    step, shape = plan.step, plan.shape
    unit, divisor = _unit(plan)

    def num(value: float) -> str:
        return f"{value / divisor:9.2f}"

    def row(label: str, value: float) -> str:
        return f"  {label:<52}{num(value)}"

    v = verdict(step.peak, gpu_memory_gib)
    pairs = plan.objective.startswith("dpo")  # dtrain.dpo: the micro batch counts pairs, two rows each
    micro_batch = f"{plan.micro_batch_size} pairs" if pairs else str(plan.micro_batch_size)
    axes = " × ".join(
        f"{axis} {degree}"
        for axis, degree in shape.degrees().items()
        if degree > 1 or axis in ("dp_shard", "tp")
    )
    axes += f" (ep {shape.ep}, dispatch planned at {PLAN_IMBALANCE:g} × balanced)" if shape.ep > 1 else ""
    lines = [
        f"dtrain plan: {plan.model_type}, {plan.num_params / 1e9:.3g} B parameters | world "
        f"{shape.world} = {axes} | {plan.objective} | micro batch {micro_batch} × max_len {plan.max_len} | "
        f"{plan.precision} | activation checkpointing "
        f"{plan.activation_checkpointing} | attention {plan.attention} | loss {plan.loss_impl} | "
        f"{plan.accumulation} micro-batches "
        f"per step (tracked {step.micro_batches}) | planned in {plan.seconds:.0f} s",
        "",
        f"per rank, {unit} (planned: the trainer's step on fake tensors, tracked by {_tracker(shape)}, "
        "after a warm-up step)",
        row("model state between steps", _model_state(plan)),
        row("  sharded parameters + buffers", step.params),
        row("  sharded gradients", step.grads),
        row("  AdamW state", step.optimizer),
        *([row("  " + AT_PEAK_LABELS["reference"], step.reference)] if step.reference else []),
        *([row("generator held through the step (counted)", step.generator)] if step.generator else []),
        *([row("while training, the generator held", step.train_peak)] if step.generation_peak else []),
        *([row("while sampling (counted)", step.generation_peak)] if step.generation_peak else []),
        f"  at the peak, in the {step.peak_phase}:",
        *(
            row("  " + AT_PEAK_LABELS[k], value)
            for k, value in step.at_peak.items()
            if value or k not in ("reference", "generator")
        ),
        row("peak", step.peak),
        *(
            [row("logits of one micro-batch (lm_head output shard)", step.logits)]
            if step.loss_temporaries is None
            else [row("fused loss: temporaries (one chunk's logits at a time)", step.loss_temporaries)]
        ),
        "",
        f"verdict: {'FITS' if v['fits'] else 'DOES NOT FIT'} in {gpu_memory_gib:g} GiB, headroom "
        f"{v['headroom_bytes'] / GIB:.2f} GiB ({v['headroom_fraction']:.0%})",
        "  (not counted: CUDA context, NCCL buffers, allocator fragmentation)",
        "",
        f"{', '.join([*plan.layers][:-1])} and {[*plan.layers][-1]} weights, {unit}: "
        + ", ".join(_layer_text(name, b, num) for name, b in plan.layers.items())
        + (" (tied: one tensor)" if plan.tied else ""),
        "",
        f"top {top} modules, {unit} in use while each ran, and the activations its forward kept",
        f"  {'module':<44}{'forward':>9}{'backward':>9}{'kept':>9}",
        *(
            f"  {m.name[-44:]:<44}{num(m.peak_forward)}{num(m.peak_backward)}{num(m.activations)}"
            for m in step.modules[:top]
        ),
        "",
        *deepspeed_table(plan, num),
    ]
    if suggestions:
        lines += ["", "what would fit (each planned in full, one change at a time):"]
        lines += [
            f"  {s.change:<40} peak {num(s.plan.step.peak).strip()} {unit}  "
            + ("fits" if s.fits else "still does not fit")
            for s in suggestions
        ]
    return "\n".join(lines)


def _layer_text(name: str, b: dict[str, int], num: Callable[[float], str]) -> str:
    """One weight's bytes per rank and in all; the experts' also what a layer computes with on this
    rank (all its experts at ep = 1, gathered by FSDP; an ep-th of them at ep > 1)."""
    text = f"{name} {num(b['local']).strip()} per rank of {num(b['total']).strip()}"
    if "computed_per_layer" in b:
        computed = num(b["computed_per_layer"]).strip()
        text += f" (per layer, a rank computes with {computed}: its experts, gathered, in the compute dtype)"
    return text


def deepspeed_table(plan: Plan, num: Callable[[float], str]) -> list[str]:
    """dtrain's planned model state beside DeepSpeed's layouts, then each layout's buffers."""
    ours = dtrain_row(plan)
    unit = "GiB" if plan.step.peak >= GIB else "MiB"
    lines = [
        f"the same model and batch under DeepSpeed 0.19, {unit} per rank (analytic: the buffers its "
        "optimizer wrappers allocate, named below; AutoTP's layout)",
        f"  {'layout':<24}{'tp':>3}{'dp':>3}{'before step 1':>14}{'after step 1':>13}{'emb+head':>9}"
        f"{'logits+loss':>12}",
        f"  {ours.name:<24}{ours.tp:>3}{ours.dp:>3}{'':>14}{num(ours.model_state):>13}"
        f"{num(ours.embedding_and_head):>9}{num(ours.logits):>12}",
    ]
    deepspeed = comparisons(plan)
    lines += [
        f"  {c.name:<24}{c.tp:>3}{c.dp:>3}{num(c.before_first_step):>14}{num(c.model_state):>13}"
        f"{num(c.embedding_and_head):>9}{num(c.logits_and_loss):>12}"
        for c in deepspeed
    ]
    lines += [
        "  before step 1: what deepspeed.initialize allocates; after step 1: at the end of a backward,",
        "  with Adam's states (created by the first step) and the gradients; dtrain's column is its",
        "  model state between steps (planned above). logits+loss: DeepSpeed's full-vocabulary logits",
        "  and the loss's fp32 copy and log-softmax; dtrain's: its lm_head output shard.",
        "",
        "DeepSpeed's buffers, bytes per rank (file: attribute; when it is allocated)",
    ]
    for c in deepspeed:
        lines.append(f"  {c.name} (tp {c.tp}, dp {c.dp}, {c.local_params / 1e9:.3g} B parameters per rank):")
        lines += [f"    {num(b.bytes)} {unit}  {b.what}: {b.source} ({b.when})" for b in c.buffers + c.logits]
    return lines
