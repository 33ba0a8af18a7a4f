"""The DPO rows of `python -m dtrain.bench`: TRL's DPOTrainer and dtrain.dpo's step on 1×1, the same
model (the bench's, saved as a Hugging Face folder), the same pairs (the first `--dpo-pairs` of the
shipped embedded pairs, dtrain/assets/dpo_tiny.jsonl: their sequences of 15 to 40 tokens in rows of
`--seq` slots), every pair in one micro-batch a step, each with its reference log-probs computed
once before training (TRL's precompute_ref_log_probs). dtrain runs unpacked (a row a sequence, as
TRL pads them) and packed. Tokens count the non-pad ones, the same work for every row of the table.
TRL runs in a process of its own (its Trainer sets up its own state); needs `trl`."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from dtrain.bench.variants import LR, MAX_NORM, Result, Setup, Step, flops, hf_model, peak_gib, timed
from dtrain.checks import check_config
from dtrain.config import DataConfig, ModelConfig, OptimConfig, PreferenceConfig, TrainConfig
from dtrain.data.formats import load_tokenizer
from dtrain.data.pipeline import build_data
from dtrain.distributed import build_parallel
from dtrain.loss import IGNORE, LossSettings
from dtrain.model import build_model, load_model_config
from dtrain.objectives import Context, build_objective
from dtrain.objectives.reference import Reference
from dtrain.optim import build_optimizer, trainable_parameters
from dtrain.step import local_micro_batch, optimizer_step

PAIRS = Path(__file__).parents[1] / "assets" / "dpo_tiny.jsonl"
TOKENIZER = Path(__file__).parents[1] / "assets" / "tiny_llama"


def save_model(setup: Setup, folder: Path) -> Path:
    """The bench's model and the embedded tokenizer as a Hugging Face folder (TRL loads a path)."""
    hf_model(setup, torch.device("cpu")).save_pretrained(folder)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(folder)
    (folder / "pairs.jsonl").write_text("".join(PAIRS.read_text().splitlines(keepends=True)[: setup.batch]))
    return folder


def dtrain_dpo(setup: Setup, folder: Path, device: torch.device, packed: bool) -> tuple[Step, int, int]:
    """dtrain.dpo's step on 1×1: the trainer's model, data stage, objective and optimizer step, on a
    micro-batch of every pair; (step, non-pad tokens, supervised tokens)."""
    config = PreferenceConfig(
        model=ModelConfig(name_or_path=str(folder), init="pretrained"),
        data=DataConfig(
            path=str(folder / "pairs.jsonl"), format="preference", max_len=setup.seq, packing=packed
        ),
        optim=OptimConfig(lr=LR, max_grad_norm=MAX_NORM, schedule="constant"),
        train=TrainConfig(
            global_batch_size=setup.batch, micro_batch_size=setup.batch, precision=setup.precision
        ),
    )
    model_config = load_model_config(config.model)
    parallel = build_parallel(check_config(config, 1, model_config), device)
    model = build_model(model_config, config, parallel, device)
    optimizer, params = build_optimizer(model, config.optim), trainable_parameters(model)
    pairs = build_data(config.data, config.train, load_tokenizer(str(folder)), 0, 1).train.rows
    mb = local_micro_batch(pairs.collate([pairs[i] for i in range(len(pairs))]), parallel)
    loss = LossSettings.of(config.parallel)
    table = Reference("live", parallel, loss, config.dpo, model).forward(mb)  # the starting model's
    objective = build_objective(Context(config, model, parallel, reference_table=lambda: table))

    def step() -> None:
        objective.begin_step([mb])
        objective.micro_step(mb)
        optimizer_step(optimizer, params, MAX_NORM)

    return step, int(mb["num_tokens"].sum()), int((mb["labels"] != IGNORE).sum())


def dtrain_results(
    setup: Setup, folder: Path, device: torch.device, args: argparse.Namespace
) -> list[Result]:
    """dtrain 1×1 unpacked and packed, built, warmed up, then timed in alternating rounds."""
    built = {
        f"dtrain 1x1 DPO{' packed' if packed else ''}": dtrain_dpo(setup, folder, device, packed)
        for packed in (False, True)
    }
    for step, _, _ in built.values():
        timed(step, args.warmup, device)
    seconds: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, (step, _, _) in built.items():
            seconds[name] = min(seconds.get(name, float("inf")), timed(step, args.steps, device))
    return [
        Result(name, 1, seconds[name], tokens, supervised, flops(setup), peak_gib(device))
        for name, (_, tokens, supervised) in built.items()
    ]


def trl_worker(setup: Setup, args: argparse.Namespace) -> list[Result]:
    """TRL's DPOTrainer on the same folder and pairs: every pair a step, the reference precomputed,
    its own loop (TRL's collator pads each sequence to the batch's longest). Step times from a
    callback; rounds are consecutive windows of `steps` steps after the warm-up, the best counts."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    folder = Path(args.dpo_folder)
    records = [json.loads(line) for line in (folder / "pairs.jsonl").read_text().splitlines()]
    total = args.warmup + args.rounds * args.steps
    durations: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *unused, **kwargs) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *unused, **kwargs) -> None:
            durations.append(time.perf_counter() - self.start)

    with tempfile.TemporaryDirectory() as output:
        settings = DPOConfig(
            output_dir=output,
            per_device_train_batch_size=len(records),
            max_steps=total,
            learning_rate=LR,
            max_grad_norm=MAX_NORM,
            lr_scheduler_type="constant",
            optim="adamw_torch_fused",
            max_length=setup.seq,
            precompute_ref_log_probs=True,
            gradient_checkpointing=False,
            bf16=setup.precision == "bf16",
            use_cpu=not torch.cuda.is_available(),
            report_to=[],
            logging_strategy="no",
            save_strategy="no",
            disable_tqdm=True,
            train_sampling_strategy="sequential",
            seed=0,
        )
        tokenizer = AutoTokenizer.from_pretrained(folder)
        trainer = DPOTrainer(
            model=str(folder),
            args=settings,
            train_dataset=Dataset.from_list(records * total),
            processing_class=tokenizer,
            callbacks=[StepTimer()],
        )
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(records))])
        trainer.train()
    timed_steps = durations[args.warmup :]
    seconds = min(
        sum(timed_steps[i : i + args.steps]) / args.steps for i in range(0, len(timed_steps), args.steps)
    )
    tokens = int(batch["attention_mask"].sum())
    supervised = int(batch["completion_mask"][:, 1:].sum())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return [Result("TRL DPOTrainer", 1, seconds, tokens, supervised, flops(setup), peak_gib(device))]
