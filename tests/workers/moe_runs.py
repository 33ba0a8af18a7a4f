"""Launched by tests/test_moe.py by run_worker (4 processes): every expert-parallel scenario on one
process group; then by 2 and 1 processes: the meshes without FSDP (NO_FSDP), one each. Rank 0
saves `<out>/<name>.pt`: each training run's logged history and final full parameters, every rank's
bytes of model state (counted here from the real tensors' storages, for the planner's test), and the
expert gradients of the dispatch check; every rank asserts the sharding."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from dtrain.checks import check_config
from dtrain.distributed import init_distributed
from dtrain.model import canonical_name, load_model_config
from dtrain.trainer import train
from tests.helpers import (
    MAX_LEN,
    check_expert_sharding,
    check_sharding,
    dispatch_rows,
    full,
    full_logits,
    one_backward,
    parity_config,
    save_results,
    sharded_model,
)

# name: (dp_shard, tp, ep); world 4; the default aux loss (moe.aux_scope=micro_step, padding left out)
SCENARIOS = {"ep4": (4, 1, 4), "ep2_tp2": (2, 2, 2), "ep2_dp2": (4, 1, 2)}
# The same where FSDP has one rank, so parallelize wraps nothing (a launch of dp_shard × tp ranks
# each): plain experts on one process, experts and router replicated over tp 2 (their gradients
# partial sums over tp, which parallelize.keep_gradient_placements all-reduces instead of FSDP)
NO_FSDP = {"1x1": (1, 1, 1), "tp2": (1, 2, 1)}
# Rows of every micro-step, over all dp ranks (micro batch GLOBAL_MICRO_BATCH / dp): 2 micro-steps of
# the global batch of 16, the same rows on every mesh (what moe.aux_scope=micro_step's loss is over).
GLOBAL_MICRO_BATCH = 8
# Each scope of the aux loss on the four meshes, SCOPE_STEPS steps (warmup takes 2: step 1 trains at
# lr 0, so step 3 is the first to see an update): name → (dp_shard, tp, ep, cp, moe.aux_scope,
# moe.aux_mask_padding). Context parallel on unpacked rows (HF's aux loss is over rows). global_batch
# counts every slot on two meshes and leaves the padding out on the other two; micro_step (SCENARIOS:
# padding left out) counts every slot on cp 2.
SCOPE_STEPS = 3
SCOPE_RUNS = {
    "ep4_global": (4, 1, 4, 1, "global_batch", False),
    "ep2_tp2_global": (2, 2, 2, 1, "global_batch", False),
    "ep2_dp2_global": (4, 1, 2, 1, "global_batch", True),
    "cp2_ep2_global": (2, 1, 2, 2, "global_batch", True),
    "cp2_ep2_rows": (2, 1, 2, 2, "micro_step", False),
}
# parallel.compile=true on this one, with aot_eager as lora_runs' compiled scenario (Dynamo's capture
# and AOT autograd as on CUDA, not Inductor's C++ build, minutes on a CPU): in fp32 the attention and
# router and the norms are compiled (parallelize.compile_sparse_layer) and the
# experts eager (grouped_mm traces in bf16 only: test_moe's test_compiled_experts_equal_eager_in_bf16)
COMPILED, COMPILE_BACKEND = {"ep2_tp2_global"}, "aot_eager"
EXPORTED = "ep2_tp2"  # exported at the end (fp32)
# checkpointed at step 5 (and with full activation checkpointing: the recomputed forward dispatches
# again, and the router's hooks must not count it), then resumed at another ep:
CHECKPOINTED, SAVED_STEP = "ep2_dp2", 5
RESUMED = {"ep2_dp2_to_ep4": (4, 1, 4), "ep2_dp2_to_ep1": (4, 1, 1)}
# packed rows, context parallel: (dp_shard, cp, ep), the model without the aux loss (the reference
# runs packed rows document by document, so it has no aux loss over the batch's slots)
PACKED = {"cp2_ep2": (2, 2, 2)}
# the other families (helpers.MOE_FAMILIES) at ep = 2 × tp = 2, FAMILY_STEPS steps, the aux loss over
# the global batch's every slot; this one exported at its end (fp32: its stacked experts with their
# biases, its sinks)
FAMILY_STEPS = 4
EXPORTED_FAMILY = "gpt_oss"


class DenseView:
    """The model's parameters other than the experts, for helpers.check_sharding (one mesh)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def named_parameters(self):
        return [(n, p) for n, p in self.model.named_parameters() if ".experts." not in n]


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor: its local shard's storage)."""
    seen = {}
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        seen[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(seen.values())


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[dict[str, int]]:
    """Every rank's bytes of sharded parameters + buffers, gradients and AdamW states (gathered)."""
    mine = {
        "params": storage_bytes([*model.parameters(), *model.buffers()]),
        "grads": storage_bytes(p.grad for p in model.parameters() if p.grad is not None),
        "optimizer": storage_bytes(
            value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)
        ),
    }
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def moe_config(model_dir: Path, dp: int, tp: int, ep: int):
    """parity_config at ep, GLOBAL_MICRO_BATCH rows a micro-step (dp = dp_shard here)."""
    config = parity_config(model_dir, dp, tp)
    config.parallel.ep = ep
    config.train.micro_batch_size = GLOBAL_MICRO_BATCH // dp
    return config


def training_run(model_dir: Path, out: Path, name: str, device: torch.device) -> dict:
    dp, tp, ep = {**SCENARIOS, **RESUMED, **NO_FSDP}[name]
    config = moe_config(model_dir, dp, tp, ep)
    resume = None
    if name == EXPORTED:
        config.checkpoint.export_hf, config.checkpoint.export_dtype = True, "fp32"
    if name == CHECKPOINTED:
        config.checkpoint.every = SAVED_STEP
        config.parallel.activation_checkpointing = "full"
    if name in RESUMED:
        resume = out / CHECKPOINTED / "checkpoints" / f"step-{SAVED_STEP:08d}"
    model_config = load_model_config(config.model)
    shape = check_config(config, dist.get_world_size(), model_config)
    result = train(config, shape, model_config, device, out / name, resolved={}, resume_from=resume)
    saved = {"history": result.history}
    if name == EXPORTED:
        saved["trained_logits"], saved["hf"] = full_logits(result.model), str(out / name / "hf")
    one_backward(result.model)
    saved["state_bytes"] = state_bytes(result.model, result.optimizer)
    check_sharding(DenseView(result.model), result.optimizer, dp, tp)
    if ep > 1:
        check_expert_sharding(result.model, result.optimizer, ep, dp // ep, tp)
    if name in NO_FSDP:  # the experts: plain tensors, or replicated over tp, their gradients alike
        for expert in (p for n, p in result.model.named_parameters() if ".experts." in n):
            placed = [getattr(t, "placements", None) for t in (expert, expert.grad)]
            assert placed[0] == placed[1] == ((Replicate(),) if tp > 1 else None), placed
    saved["params"] = {canonical_name(n): full(p) for n, p in result.model.named_parameters()}
    return saved


def trained(config, out: Path, name: str, device: torch.device) -> tuple[dict, torch.nn.Module]:
    """Train `config` into out/name: the logged history and final full parameters, and the model."""
    model_config = load_model_config(config.model)
    shape = check_config(config, dist.get_world_size(), model_config)
    result = train(config, shape, model_config, device, out / name, resolved={})
    params = {canonical_name(n): full(p) for n, p in result.model.named_parameters()}
    return {"history": result.history, "params": params}, result.model


def packed_run(model_dir: Path, out: Path, name: str, device: torch.device) -> dict:
    dp, cp, ep = PACKED[name]
    config = moe_config(model_dir, dp, 1, ep)
    config.parallel.cp, config.data.packing = cp, True
    return trained(config, out, name, device)[0]


def scope_run(model_dir: Path, out: Path, name: str, device: torch.device) -> dict:
    dp, tp, ep, cp, scope, mask_padding = SCOPE_RUNS[name]
    config = moe_config(model_dir, dp, tp, ep)
    config.parallel.cp, config.train.max_steps = cp, SCOPE_STEPS
    config.moe.aux_scope, config.moe.aux_mask_padding = scope, mask_padding
    config.parallel.compile = name in COMPILED
    torch._dynamo.utils.counters.clear()
    saved = trained(config, out, name, device)[0]
    return saved | {"graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}


def family_run(model_dir: Path, out: Path, name: str, device: torch.device) -> dict:
    config = moe_config(model_dir, 2, 2, 2)
    config.train.max_steps = FAMILY_STEPS
    config.moe.aux_scope, config.moe.aux_mask_padding = "global_batch", False
    if name == EXPORTED_FAMILY:
        config.checkpoint.export_hf, config.checkpoint.export_dtype = True, "fp32"
    saved, model = trained(config, out, name, device)
    if name == EXPORTED_FAMILY:
        saved["trained_logits"], saved["hf"] = full_logits(model), str(out / name / "hf")
    return saved


def dispatch_gradients(model_dir: Path, device: torch.device) -> dict:
    """ep = 4, the loaded model: rank r runs row r of helpers.dispatch_rows() (summed next-token loss,
    no aux loss), as is and with rank 0's row changed; the full expert gradients of both."""
    model = sharded_model(moe_config(model_dir, 4, 1, 4), device)
    rank, positions = dist.get_rank(), torch.arange(MAX_LEN)[None]
    grads = []
    for rows in dispatch_rows():
        row = rows[rank : rank + 1]
        logits = model(
            input_ids=row, position_ids=positions, use_cache=False, output_router_logits=False
        ).logits
        F.cross_entropy(logits[0, :-1], row[0, 1:], reduction="sum").backward()
        grads.append(
            {canonical_name(n): full(p.grad) for n, p in model.named_parameters() if ".experts." in n}
        )
        model.zero_grad(set_to_none=True)
    return {"grads": grads}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--model-without-aux", type=Path, required=True)
    parser.add_argument("--families", type=Path, required=True, help="a folder per MOE_FAMILIES type")
    parser.add_argument("--only", default="", help="comma-separated run names (default: every run)")
    args = parser.parse_args()
    device = init_distributed(timeout_s=300)
    torch.compile = functools.partial(torch.compile, backend=COMPILE_BACKEND)  # see COMPILE_BACKEND
    wanted = set(filter(None, args.only.split(",")))

    def chosen(names):
        return [name for name in names if not wanted or name in wanted]

    if dist.get_world_size() < 4:  # the mesh without FSDP of this world size
        names = [name for name, (dp, tp, _) in NO_FSDP.items() if dp * tp == dist.get_world_size()]
        save_results(
            {name: training_run(args.model, args.out, name, device) for name in chosen(names)}, args.out
        )
        return

    results = {
        name: training_run(args.model, args.out, name, device) for name in chosen({**SCENARIOS, **RESUMED})
    }
    results |= {name: packed_run(args.model_without_aux, args.out, name, device) for name in chosen(PACKED)}
    results |= {name: scope_run(args.model, args.out, name, device) for name in chosen(SCOPE_RUNS)}
    for family in chosen(sorted(path.name for path in args.families.iterdir())):
        results[family] = family_run(args.families / family, args.out, family, device)
    if chosen(["dispatch"]):
        results["dispatch"] = dispatch_gradients(args.model, device)
    save_results(results, args.out)


if __name__ == "__main__":
    main()
