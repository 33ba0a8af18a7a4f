"""`python -m dtrain.bench.grpo`: dtrain.grpo against TRL 1.16's GRPOTrainer (`use_vllm=False`: transformers'
generate on the policy, as dtrain's `hf` engine), on one process, the same model (the tiny Llama's
architecture, seeded, saved as a Hugging Face folder), the same prompts (the first of the shipped
dtrain/assets/grpo_tiny.jsonl), the same G, completion length, batch and reward (`match`); dtrain
unpacked (a row a sequence) and packed. Each step's time split into the rollout (sampling, with the
weights' sync and the rewards) and the training (log-probs, loss, backward, optimizer), and the
tokens per second of each: generated tokens over the rollout time, trained (prompt + completion)
tokens over the training time. The best of `--rounds` windows of `--steps` steps after `--warmup`.
TRL runs in a process of its own; needs `trl`. Completions are sampled, so the two sides' lengths
differ: the tokens/s columns, not the step times, compare the work."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

ASSETS = Path(__file__).parents[1] / "assets"
PROMPTS, TOKENIZER = ASSETS / "grpo_tiny.jsonl", ASSETS / "tiny_llama"


def save_inputs(folder: Path, args: argparse.Namespace) -> Path:
    """The seeded model, the tokenizer and the prompts in `folder`."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TOKENIZER)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(folder)
    prompts = args.batch // args.generations * (args.warmup + args.rounds * args.steps)
    lines = PROMPTS.read_text().splitlines(keepends=True)[:prompts]
    (folder / "prompts.jsonl").write_text("".join(lines))
    return folder


def best(values: list[float], window: int, skip: int) -> float:
    timed = values[skip:]
    return min(sum(timed[i : i + window]) / window for i in range(0, len(timed) - window + 1, window))


def dtrain_row(folder: Path, args: argparse.Namespace, packed: bool) -> dict:
    """dtrain.grpo's run (the trainer itself) on 1×1; its logged time split, per step."""
    from dtrain.checks import check_config
    from dtrain.config import (
        CheckpointConfig,
        DataConfig,
        GRPOConfig,
        GRPORunConfig,
        ModelConfig,
        MoeConfig,
        OptimConfig,
        TrainConfig,
    )
    from dtrain.model import load_model_config
    from dtrain.trainer import train

    steps = args.warmup + args.rounds * args.steps
    config = GRPORunConfig(
        model=ModelConfig(name_or_path=str(folder), init="pretrained"),
        data=DataConfig(
            path=str(folder / "prompts.jsonl"), format="prompt", max_len=args.seq, packing=packed
        ),
        optim=OptimConfig(lr=1e-4, schedule="constant"),
        train=TrainConfig(
            max_steps=steps, global_batch_size=args.batch, micro_batch_size=args.batch, precision="fp32"
        ),
        checkpoint=CheckpointConfig(resume="never", save_final=False, every_minutes=0),
        moe=MoeConfig(aux_scope="global_batch"),
        grpo=GRPOConfig(
            num_generations=args.generations, max_completion_length=args.completion, reward_funcs=["match"]
        ),
    )
    model_config = load_model_config(config.model)
    shape = check_config(config, 1, model_config)
    with tempfile.TemporaryDirectory() as run_dir:
        history = train(config, shape, model_config, torch.device("cpu"), Path(run_dir), {}).history
    rollout = [r["time/sync_s"] + r["time/rollout_s"] + r["time/reward_s"] for r in history]
    trained = [r["step_time_s"] - roll for r, roll in zip(history, rollout, strict=True)]
    generated = [r["completions/mean_length"] * args.batch for r in history]
    inputs = [r["input_tokens_per_s"] * r["step_time_s"] * (1 - r["padding_fraction"]) for r in history]
    return row(f"dtrain.grpo 1x1{' packed' if packed else ''}", rollout, trained, generated, inputs, args)


def row(
    name: str, rollout: list, trained: list, generated: list, inputs: list, args: argparse.Namespace
) -> dict:
    window, skip = args.steps, args.warmup
    roll, learn = best(rollout, window, skip), best(trained, window, skip)
    made, fed = best(generated, window, skip), best(inputs, window, skip)
    return {
        "name": name,
        "step_s": roll + learn,
        "rollout_s": roll,
        "train_s": learn,
        "generated_tokens_per_s": made / roll,
        "train_tokens_per_s": fed / learn,
    }


def trl_row(folder: Path, args: argparse.Namespace) -> dict:
    """TRL's GRPOTrainer (use_vllm=False, fp32 on the CPU): the rollout timed around its
    `_generate_and_score_completions`, the step by a callback."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from dtrain.rewards import match

    records = [json.loads(line) for line in (folder / "prompts.jsonl").read_text().splitlines()]
    steps, rollout, stepped, generated, inputs = args.warmup + args.rounds * args.steps, [], [], [], []

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, batch):
            start = time.perf_counter()
            out = super()._generate_and_score_completions(batch)
            rollout.append(time.perf_counter() - start)
            generated.append(int(out["completion_mask"].sum()))
            inputs.append(int(out["prompt_mask"].sum() + out["completion_mask"].sum()))
            return out

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *unused, **kwargs) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *unused, **kwargs) -> None:
            stepped.append(time.perf_counter() - self.start)

    with tempfile.TemporaryDirectory() as output:
        settings = GRPOConfig(
            output_dir=output,
            per_device_train_batch_size=args.batch,
            num_generations=args.generations,
            max_completion_length=args.completion,
            max_steps=steps,
            learning_rate=1e-4,
            lr_scheduler_type="constant",
            optim="adamw_torch_fused",
            use_vllm=False,
            use_cpu=True,
            bf16=False,
            gradient_checkpointing=False,
            shuffle_dataset=False,
            report_to=[],
            logging_strategy="no",
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
        )
        trainer = Timed(
            model=str(folder),
            reward_funcs=match,
            args=settings,
            train_dataset=Dataset.from_list(records),
            processing_class=AutoTokenizer.from_pretrained(folder),
            callbacks=[StepTimer()],
        )
        trainer.train()
    trained = [step - roll for step, roll in zip(stepped, rollout, strict=True)]
    return row("TRL GRPOTrainer (use_vllm=False)", rollout, trained, generated, inputs, args)


def table(rows: list[dict]) -> str:
    head = f"{'':<36}{'step s':>8}{'rollout s':>11}{'train s':>9}{'generated tok/s':>17}{'trained tok/s':>15}"
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['name']:<36}{r['step_s']:8.3f}{r['rollout_s']:11.3f}{r['train_s']:9.3f}"
            f"{r['generated_tokens_per_s']:17,.0f}{r['train_tokens_per_s']:15,.0f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m dtrain.bench.grpo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32, help="completions a step")
    parser.add_argument("--generations", type=int, default=8, help="G")
    parser.add_argument("--completion", type=int, default=16, help="max_completion_length")
    parser.add_argument("--seq", type=int, default=48, help="data.max_len (a prompt and its completion)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--trl", help=argparse.SUPPRESS)  # internal: run TRL's row in this process
    args = parser.parse_args()
    if args.trl:
        print(json.dumps(trl_row(Path(args.trl), args)))
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29581")
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    from dtrain.distributed import init_distributed

    with tempfile.TemporaryDirectory() as folder:
        inputs = save_inputs(Path(folder), args)
        forwarded = [f"--{k}={v}" for k, v in vars(args).items() if k != "trl"]
        trl = subprocess.run(
            [sys.executable, "-m", "dtrain.bench.grpo", *forwarded, f"--trl={inputs}"],
            capture_output=True,
            text=True,
        )
        rows = [json.loads(trl.stdout.splitlines()[-1])] if trl.returncode == 0 else []
        init_distributed(600)
        rows += [dtrain_row(inputs, args, packed) for packed in (False, True)]
    print(
        f"dtrain.grpo vs TRL GRPOTrainer, CPU, {torch.get_num_threads()} threads, one process: {args.batch} "
        f"completions a step ({args.batch // args.generations} prompts × G {args.generations}), up to "
        f"{args.completion} tokens each, fp32"
    )
    print(table(rows))
    if trl.returncode != 0:
        print(
            f"(no TRL row: {trl.stderr.strip().splitlines()[-1] if trl.stderr.strip() else trl.returncode})"
        )


if __name__ == "__main__":
    main()
