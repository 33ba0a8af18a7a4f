"""`python -m dtrain.bench`: the same model, data and batch trained by a plain PyTorch +
transformers loop (the no-overhead baseline), by the Hugging Face Trainer (where `accelerate` is
installed), by dtrain's step on a 1×1 mesh, and by dtrain on the meshes the machine allows
(torchrun workers); prints one table: tokens/s (all and supervised), tokens/s per device, MFU
(CUDA with a known peak), step time, peak memory (CUDA) and each variant's ratio to the plain loop.
On CPU the figures are CPU figures (gloo) and the table says so. Then (--moe) a second table, a
small Qwen3-MoE with HF's router aux loss: the plain loop, dtrain 1×1 with each moe.aux_scope, and
dtrain with ep = 2 on 2 processes, each against that plain loop. Then (--dpo) dtrain.dpo's step on
1×1, unpacked and packed, beside TRL's DPOTrainer (dtrain/bench/dpo.py; needs trl). Then (--distill)
dtrain.distill's offline step beside TRL's GKDTrainer on a tiny student and teacher, and the
divergence's memory against TRL's dense and chunked ones on Llama-3-sized heads (dtrain/bench/distill.py).

The variants are in dtrain/bench/variants.py, the Hugging Face Trainer's in hf_trainer.py (a
process of its own); this module runs them and prints the table."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from dtrain.bench import distill, dpo
from dtrain.bench.variants import (
    BITSANDBYTES,
    NO_BITSANDBYTES,
    TINY_MOE_MODEL,
    Result,
    Setup,
    in_process_variants,
    lora_pairs,
    lora_variants,
    measure,
    mesh_worker,
    moe_variants,
)
from dtrain.distributed import init_distributed
from dtrain.metrics import peak_flops


def run_worker(kind: str, args: argparse.Namespace, nproc: int) -> list[dict] | str:
    """Run `python -m dtrain.bench --worker KIND` (under torchrun for a mesh); its results, or why
    there are none."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        forwarded = [f"--{key.replace('_', '-')}={value}" for key, value in vars(args).items()]
        forwarded = [
            a
            for a in forwarded
            if not a.startswith(
                ("--worker", "--out", "--meshes", "--hf", "--lora", "--moe", "--dpo=", "--distill=")
            )
        ]
        module = ["-m", "dtrain.bench", "--worker", kind, "--out", str(out), *forwarded]
        if kind in ("trainer", "dpo_trl", "distill_trl"):
            command = [sys.executable, *module]
        else:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            command += [f"--nproc_per_node={nproc}", *module]
        threads = max(1, (os.cpu_count() or 1) // nproc)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.worker_timeout)
        if out.exists():
            return json.loads(out.read_text())
        return f"failed (exit {result.returncode}): {(result.stderr or result.stdout).strip()[-300:]}"


def default_meshes(device: torch.device) -> list[str]:
    """CPU: two gloo processes, dp and tp; CUDA: every GPU, all dp and half tp (when more than one)."""
    count = torch.cuda.device_count() if device.type == "cuda" else 2
    if count < 2:
        return []
    return [f"{count}x1", f"{count // 2}x2" if device.type == "cuda" else "1x2"]


def print_table(results: list[Result | str], device: torch.device, header: str) -> list[dict]:
    peak = peak_flops(device)
    kind = "CPU figures (gloo)" if device.type == "cpu" else f"{torch.cuda.get_device_name(device)}"
    print(f"{kind}; {header}")
    columns = f"{'variant':<36}{'dev':>4}{'tokens/s':>10}{'sup tok/s':>10}{'tok/s/dev':>10}"
    print(columns + f"{'MFU':>7}{'step ms':>9}{'peak GiB':>9}{'ratio':>7}")
    first = next((r for r in results if isinstance(r, Result)), None)
    rows = []
    for result in results:
        if isinstance(result, str):
            print(result)
            continue
        row = result.row(first, peak)
        rows.append(row)
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "-"
        memory = f"{row['peak_gib']:.2f}" if row["peak_gib"] is not None else "-"
        print(
            f"{row['variant']:<36}{row['devices']:>4}{row['tokens_per_s']:>10.0f}"
            f"{row['supervised_tokens_per_s']:>10.0f}{row['tokens_per_s_per_device']:>10.0f}"
            f"{mfu:>7}{row['step_ms']:>9.1f}{memory:>9}{row['ratio']:>7.2f}"
        )
    return rows


def print_pairs(rows: list[dict], pairs: list[tuple[str, str]]) -> None:
    """Each pair's tokens/s ratio, where both rows ran."""
    rates = {row["variant"]: row["tokens_per_s"] for row in rows}
    for ours, baseline in pairs:
        if ours in rates and baseline in rates:
            print(f"{ours} / {baseline}: {rates[ours] / rates[baseline]:.2f}x")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--batch", type=int, default=4, help="rows per micro-batch (per dp rank)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=10, help="variants alternate; the best round counts")
    parser.add_argument(
        "--loss-chunk", type=int, default=64, help="chunked and fused variants (1x1, tp > 1 meshes); 0: none"
    )
    parser.add_argument("--meshes", default="default", help="comma-separated DPxTP meshes; '' for none")
    parser.add_argument(
        "--compile", type=int, default=1, help="1: on tp > 1 meshes, a compiled row beside the eager one"
    )
    parser.add_argument("--hf-trainer", type=int, default=1, help="1: add the HF Trainer variant")
    parser.add_argument("--lora-r", type=int, default=16, help="> 0: add PEFT's and dtrain 1x1's LoRA rows")
    parser.add_argument("--moe", type=int, default=1, help="1: the mixture-of-experts table (Qwen3-MoE)")
    parser.add_argument(
        "--dpo", type=int, default=1, help="1: add the DPO table (TRL's DPOTrainer, dtrain.dpo)"
    )
    parser.add_argument(
        "--dpo-pairs", type=int, default=16, help="DPO: pairs a step (the first of the shipped)"
    )
    parser.add_argument("--dpo-seq", type=int, default=32, help="DPO: data.max_len (TRL's max_length)")
    parser.add_argument("--dpo-folder", help=argparse.SUPPRESS)  # internal: the DPO rows' model and pairs
    parser.add_argument(
        "--distill",
        type=int,
        default=1,
        help="1: add the distillation tables (TRL's GKDTrainer, dtrain.distill)",
    )
    parser.add_argument("--distill-records", type=int, default=16, help="distillation: records a step")
    parser.add_argument("--distill-seq", type=int, default=32, help="distillation: data.max_len")
    parser.add_argument("--distill-folder", help=argparse.SUPPRESS)  # internal: its models and records
    parser.add_argument("--worker-timeout", type=int, default=600)
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: a mesh (DPxTP) or 'trainer'
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup = Setup(batch=args.batch, seq=args.seq)
    if args.worker:
        if args.worker == "trainer":
            from dtrain.bench.hf_trainer import trainer_worker

            results = trainer_worker(setup, args)
        elif args.worker == "dpo_trl":
            results = dpo.trl_worker(Setup(batch=args.dpo_pairs, seq=args.dpo_seq), args)
        elif args.worker == "distill_trl":
            results = distill.trl_worker(args)
        else:
            results = mesh_worker(args.worker, setup, args)
        if not dist.is_initialized() or dist.get_rank() == 0:
            args.out.write_text(json.dumps([asdict(r) for r in results]))
        if dist.is_initialized():
            dist.destroy_process_group()
        return
    device = init_distributed(timeout_s=300)  # one process: an in-memory store, no port to take
    results: list[Result | str] = list(
        measure(in_process_variants(setup, device, args.loss_chunk), setup, device, args)
    )
    if args.lora_r and importlib.util.find_spec("peft") is None:
        results.append("LoRA: not run (the PEFT baseline needs peft, which is not installed)")
    elif args.lora_r:
        if not BITSANDBYTES:
            results.append(NO_BITSANDBYTES)
        results += measure(
            lora_variants(setup, device, args.lora_r),
            Setup(**{**asdict(setup), "lora_r": args.lora_r}),
            device,
            args,
        )
    if args.hf_trainer and importlib.util.find_spec("accelerate") is None:
        results.append("HF Trainer: not run (it needs accelerate, which is not installed)")
    elif args.hf_trainer:
        found = run_worker("trainer", args, 1)
        results += [Result(**r) for r in found] if isinstance(found, list) else [f"HF Trainer: {found}"]
    meshes = default_meshes(device) if args.meshes == "default" else [m for m in args.meshes.split(",") if m]
    for mesh in meshes:
        dp, tp = (int(n) for n in mesh.split("x"))
        found = run_worker(mesh, args, dp * tp)
        results += [Result(**r) for r in found] if isinstance(found, list) else [f"dtrain {mesh}: {found}"]
    header = f"batch {args.batch} x seq {args.seq} per dp rank, {setup.precision}; "
    rounds = f"best of {args.rounds} rounds of {args.steps} steps"
    rows = print_table(results, device, header + rounds)
    if args.lora_r:
        print_pairs(rows, lora_pairs(args.lora_r))
    if args.moe:
        moe = Setup(**{**asdict(setup), "model": dict(TINY_MOE_MODEL)})
        moe_results: list[Result | str] = list(measure(moe_variants(moe, device), moe, device, args))
        found = run_worker("moe-ep2", args, 2)
        moe_results += [Result(**r) for r in found] if isinstance(found, list) else [f"MoE ep2: {found}"]
        print()
        print_table(moe_results, device, "Qwen3-MoE, 8 experts, top-2, HF's aux loss; " + header + rounds)
    if args.dpo:
        print()
        print_table(
            dpo_results(args, device),
            device,
            f"DPO, {args.dpo_pairs} pairs a step, max_len {args.dpo_seq}, "
            f"{setup.precision}; non-pad tokens; {rounds}",
        )
    if args.distill and importlib.util.find_spec("trl") is None:
        print("\ndistillation: not run (the TRL baselines need trl, which is not installed)")
    elif args.distill:
        print()
        print_table(
            distill_results(args, device),
            device,
            f"distillation (offline, beta {distill.BETA}), {args.distill_records} records a step, max_len "
            f"{args.distill_seq}, fp32; non-pad tokens, scored ones; {rounds}",
        )
        print()
        print("the divergence's temporaries (forward + backward, fake tensors), GiB: Llama-3-70B teacher and")
        print("Llama-3-8B student heads (vocabulary 128256), 2 x 2048 scored tokens")
        for name, gib in distill.divergence_memory():
            print(f"  {name:<60}{gib:8.2f}")


def dpo_results(args: argparse.Namespace, device: torch.device) -> list[Result | str]:
    """TRL's DPOTrainer (its process; the ratio's base) and dtrain.dpo 1×1 unpacked and packed."""
    if importlib.util.find_spec("trl") is None:
        return ["DPO: not run (the TRL baseline needs trl, which is not installed)"]
    setup = Setup(batch=args.dpo_pairs, seq=args.dpo_seq)
    with tempfile.TemporaryDirectory() as folder:
        args.dpo_folder = str(dpo.save_model(setup, Path(folder)))
        found = run_worker("dpo_trl", args, 1)
        results: list[Result | str] = (
            [Result(**r) for r in found] if isinstance(found, list) else [f"TRL DPOTrainer: {found}"]
        )
        return results + dpo.dtrain_results(setup, Path(folder), device, args)


def distill_results(args: argparse.Namespace, device: torch.device) -> list[Result | str]:
    """TRL's GKDTrainer (its process; the ratio's base) and dtrain.distill 1×1 unpacked and packed."""
    with tempfile.TemporaryDirectory() as folder:
        args.distill_folder = str(distill.save_models(args.distill_records, Path(folder)))
        found = run_worker("distill_trl", args, 1)
        results: list[Result | str] = (
            [Result(**r) for r in found] if isinstance(found, list) else [f"TRL GKDTrainer: {found}"]
        )
        return results + distill.dtrain_results(
            args.distill_records, args.distill_seq, Path(folder), device, args
        )


if __name__ == "__main__":
    main()
