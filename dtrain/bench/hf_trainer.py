"""The Hugging Face Trainer variant of `python -m dtrain.bench` (run in a process of its own: the
Trainer sets up its own device and distributed state). Needs `accelerate`."""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from dtrain.bench.variants import LR, MAX_NORM, Result, Setup, flops, hf_model, make_batch, peak_gib
from dtrain.distributed import keep_freed_host_memory
from dtrain.loss import IGNORE


def trainer_worker(setup: Setup, args: argparse.Namespace) -> list[Result]:
    """The Hugging Face Trainer on the same model and rows (its own loop, loss and AdamW; it shifts
    the labels once more, which changes the loss value, not the work). Step times come from a
    callback; rounds are consecutive windows of `steps` steps after the warm-up, the best counts."""
    from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        keep_freed_host_memory()  # as init_distributed does for the other variants
    mb = make_batch(setup, torch.device("cpu"))
    model_inputs = ("input_ids", "labels", "position_ids")  # not dtrain's num_tokens
    rows = [{key: mb[key][i] for key in model_inputs} for i in range(setup.batch)]
    total = args.warmup + args.rounds * args.steps
    durations: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *unused, **kwargs) -> None:
            if device.type == "cuda":
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, *unused, **kwargs) -> None:
            if device.type == "cuda":
                torch.cuda.synchronize()
            durations.append(time.perf_counter() - self.start)

    with tempfile.TemporaryDirectory() as folder:
        settings = TrainingArguments(
            output_dir=folder,
            per_device_train_batch_size=setup.batch,
            max_steps=total,
            learning_rate=LR,
            weight_decay=0.0,
            max_grad_norm=MAX_NORM,
            lr_scheduler_type="constant",
            optim="adamw_torch_fused",  # the AdamW the other variants run
            report_to=[],
            logging_strategy="no",
            save_strategy="no",
            disable_tqdm=True,
            remove_unused_columns=False,
            dataloader_drop_last=True,
            bf16=setup.precision == "bf16",
            use_cpu=device.type == "cpu",
            torch_compile=setup.compile,
            seed=0,
        )
        model = hf_model(setup, device)
        trainer = Trainer(
            model=model,
            args=settings,
            train_dataset=rows * total,
            data_collator=default_data_collator,
            callbacks=[StepTimer()],
        )
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
    timed_steps = durations[args.warmup :]
    seconds = min(
        sum(timed_steps[i : i + args.steps]) / args.steps for i in range(0, len(timed_steps), args.steps)
    )
    tokens, supervised = mb["input_ids"].numel(), int((mb["labels"] != IGNORE).sum())
    return [Result("HF Trainer", 1, seconds, tokens, supervised, flops(setup), peak_gib(device))]
