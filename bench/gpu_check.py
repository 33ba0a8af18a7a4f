"""`python bench/gpu_check.py`: the device check for one lent GPU (an H200). dtrain on a 1×1 mesh vs
the plain PyTorch + transformers loop, on a Llama-3.2-1B-shaped model (random init from its
config.json shipped in dtrain/assets/architectures: nothing is downloaded), bf16, eager and
compiled, with one document per row and with packed rows; dtrain also with parallel.loss_impl=fused;
then LoRA r=16 (PEFT on the plain loop against dtrain 1×1) and QLoRA (dtrain's NF4 base against
PEFT over bitsandbytes' NF4, and against PEFT on the same base dequantized once), eager and
unpacked. tp 2 compiled against tp 2 eager needs two GPUs: `python -m dtrain.bench` runs it on
every GPU of the machine (its 1x2-style meshes).
Prints each group's rows as it finishes, then one table: tokens/s (all, supervised), MFU, step time,
peak memory (what each variant adds), ratio to the first row; then the host syncs of one dtrain step
(CUDA's sync debug mode). Meant to finish in under 8 minutes including compilation and warm-up.

`--dry-run` runs the same code on the CPU with the bench's tiny model, one step each (bf16 too), so
the script's logic is checked where no GPU is lent. Packed rows take the flex path on CUDA only. The
dry run compiles with the `aot_eager` backend: Dynamo's capture and AOT autograd run as on CUDA, but
not Inductor's C++ code generation, which takes minutes on a CPU and is not what the dry run checks."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import importlib.util
import json
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dtrain.bench.__main__ import print_pairs, print_table  # noqa: E402
from dtrain.bench.variants import (  # noqa: E402
    BITSANDBYTES,
    NO_BITSANDBYTES,
    TINY_MODEL,
    Result,
    Setup,
    dtrain_step,
    lora_pairs,
    lora_variants,
    make_batch,
    measure,
    plain_loop,
)
from dtrain.config import ParallelConfig  # noqa: E402
from dtrain.distributed import init_distributed  # noqa: E402
from dtrain.model import ARCHITECTURES  # noqa: E402

LLAMA_1B = ARCHITECTURES / "meta-llama" / "Llama-3.2-1B" / "config.json"


def llama_1b() -> dict:
    return json.loads(LLAMA_1B.read_text())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model, one step each")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3, help="steps; the compiled variants compile here")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true", help="eager variants only")
    parser.add_argument("--lora-r", type=int, default=16, help="LoRA and QLoRA rows of this rank; 0: none")
    parser.add_argument("--json", type=Path, help="also write the final table's rows (and syncs) here")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.batch, args.seq, args.warmup, args.steps, args.rounds = 2, 64, 1, 1, 1
    return args


def syncs_per_step(model: dict, args: argparse.Namespace, device: torch.device) -> float:
    """CUDA's sync debug mode counts the step's host waits (test_perf.py counts them on the CPU by
    call site; the bench's step has no skip check, so none is expected here)."""
    setup = Setup(model, args.batch, args.seq, "bf16")
    step = dtrain_step(setup, make_batch(setup, device), device, 1, 1)
    step()  # the first step allocates the optimizer state
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(3):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for warning in caught[:3]:
        print(f"  sync: {warning.message}")
    return len(caught) / 3


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device; use --dry-run to check the script on the CPU")
    start = time.perf_counter()
    device = init_distributed(timeout_s=600) if not args.dry_run else torch.device("cpu")
    if args.dry_run:
        import torch.distributed as dist

        if not dist.is_initialized():  # dtrain's mesh needs a (one-process) group even on the CPU
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        torch.compile = functools.partial(torch.compile, backend="aot_eager")  # see the docstring
    model = dict(TINY_MODEL) if args.dry_run else llama_1b()
    results: list[Result | str] = []
    for compiled in (False,) if args.no_compile else (False, True):
        for packed in (False, True):
            setup = Setup(model, args.batch, args.seq, "bf16", packed=packed, compile=compiled)
            mb = make_batch(setup, device)
            # parallel.loss_impl=fused at the config's default chunk
            fused = dataclasses.replace(setup, loss_impl="fused", loss_chunk=ParallelConfig().loss_chunk)
            label = f"{'compiled' if compiled else 'eager'}, {'packed' if packed else 'unpacked'}"
            builds = {
                f"plain loop, {label}": lambda s=setup, b=mb: plain_loop(s, b, device),
                f"dtrain 1x1, {label}": lambda s=setup, b=mb: dtrain_step(s, b, device, 1, 1),
                f"dtrain 1x1 fused, {label}": lambda s=fused, b=mb: dtrain_step(s, b, device, 1, 1),
            }
            group = measure(builds, setup, device, args)  # the models die with `builds`' steps
            results += group
            print_table(group, device, f"{label}: done at {time.perf_counter() - start:.0f} s")
            del builds, mb
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.lora_r and importlib.util.find_spec("peft") is None:
        results.append("LoRA and QLoRA: not run (the PEFT baseline needs peft, which is not installed)")
    elif args.lora_r:  # PEFT on the plain loop against dtrain 1x1: LoRA, and QLoRA on an NF4 base
        setup = Setup(model, args.batch, args.seq, "bf16", lora_r=args.lora_r)
        group = measure(lora_variants(setup, device, args.lora_r), setup, device, args)
        results += group if BITSANDBYTES else [*group, NO_BITSANDBYTES]
        done = f"done at {time.perf_counter() - start:.0f} s"
        rows = print_table(group, device, f"LoRA and QLoRA, eager, unpacked: {done}")
        print_pairs(rows, lora_pairs(args.lora_r))
        gc.collect()
    syncs = syncs_per_step(model, args, device) if device.type == "cuda" else None
    if syncs is not None:
        print(f"host syncs per dtrain 1x1 step (eager, unpacked): {syncs}")
    header = f"Llama-3.2-1B shape, batch {args.batch} x seq {args.seq}, bf16" if not args.dry_run else ""
    print()
    header = (header or "dry run, tiny model") + f"; {time.perf_counter() - start:.0f} s"
    rows = print_table(results, device, header)
    if args.json:
        failed = [r for r in results if isinstance(r, str)]
        args.json.write_text(
            json.dumps(dict(header=header, rows=rows, failed=failed, host_syncs=syncs), indent=1)
        )


if __name__ == "__main__":
    main()
