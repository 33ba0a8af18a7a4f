"""The distillation rows of `python -m dtrain.bench` (--distill): dtrain.distill against TRL 1.16 on the
same tiny pair of models and the same records.

- Step time: TRL's GKDTrainer at lmbda=0 (offline: the dense divergence on both models' full logits)
  and dtrain.distill's offline step on 1×1 (unpacked and packed), the bench's tiny Llama as the student
  and a wider, deeper one as the teacher (saved as Hugging Face folders), the first `--distill-records`
  of the shipped prompts with their right answers (dtrain/assets/dpo_tiny.jsonl's prompt and chosen, as
  GKD's messages), every record in one micro-batch a step. TRL runs in a process of its own; needs trl.
- The divergence's memory: its temporaries (peak minus what its inputs and returned gradients hold),
  forward and backward, on fake tensors (no values, no time: any size), for the heads of a Llama-3-70B
  teacher and a Llama-3-8B student (vocabulary 128256, widths 8192 and 4096) on 2 × 2048 scored tokens:
  GKD's dense divergence on full fp32 logits, DistillationTrainer's chunked kernel (4096 tokens × 32768
  vocabulary tiles, after gathering each head whole), and dtrain's fused divergence per tp rank (its
  vocabulary shard, parallel.loss_chunk positions a chunk) at tp 1 and 8 (tp 8: one rank's shard of
  the heads and the 8 ranks' hidden states of a chunk, gathered under sequence parallel, as on the
  mesh; the collectives move nothing here).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from dtrain.bench.variants import LR, MAX_NORM, TINY_MODEL, Result, Setup, flops, peak_gib, timed
from dtrain.checks import check_config
from dtrain.config import DataConfig, DistillationConfig, DistillConfig, ModelConfig, OptimConfig, TrainConfig
from dtrain.data.formats import load_tokenizer
from dtrain.data.pipeline import build_data
from dtrain.distributed import build_parallel
from dtrain.fused_divergence import Divergence, fused_divergence
from dtrain.loss import IGNORE
from dtrain.model import build_frozen_model, build_model, load_model_config
from dtrain.objectives import Context, build_objective
from dtrain.optim import build_optimizer, trainable_parameters
from dtrain.step import local_micro_batch, optimizer_step

RECORDS = Path(__file__).parents[1] / "assets" / "dpo_tiny.jsonl"
TOKENIZER = Path(__file__).parents[1] / "assets" / "tiny_llama"
TEACHER = dict(TINY_MODEL, hidden_size=256, intermediate_size=704, num_hidden_layers=4, initializer_range=0.2)
BETA, TEMPERATURE = 0.5, 1.0
GIB = 2**30


def save_models(records: int, folder: Path) -> Path:
    """The student (the bench's tiny Llama), a wider and deeper teacher, and the records as GKD's
    messages, in `folder`."""
    for name, shape, seed in (("student", TINY_MODEL, 0), ("teacher", TEACHER, 1)):
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(AutoConfig.for_model(**shape)).save_pretrained(folder / name)
        AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(folder / name)
    lines = RECORDS.read_text().splitlines()[:records]
    rows = [json.loads(line) for line in lines]
    conversations = [{"messages": row["prompt"] + row["chosen"]} for row in rows]
    (folder / "records.jsonl").write_text("".join(json.dumps(row) + "\n" for row in conversations))
    return folder


def dtrain_distill(records: int, seq: int, folder: Path, device: torch.device, packed: bool):
    """dtrain.distill's offline step on 1×1: the trainer's models, data stage, objective and optimizer
    step, on a micro-batch of every record; (step, non-pad tokens, scored tokens)."""
    config = DistillationConfig(
        model=ModelConfig(name_or_path=str(folder / "student"), init="pretrained"),
        data=DataConfig(
            path=str(folder / "records.jsonl"), format="prompt_completion", max_len=seq, packing=packed
        ),
        optim=OptimConfig(lr=LR, max_grad_norm=MAX_NORM, schedule="constant"),
        train=TrainConfig(global_batch_size=records, micro_batch_size=records, precision="fp32"),
        distill=DistillConfig(teacher=str(folder / "teacher"), beta=BETA, temperature=TEMPERATURE),
    )
    model_config = load_model_config(config.model)
    parallel = build_parallel(check_config(config, 1, model_config), device)
    model = build_model(model_config, config, parallel, device)
    optimizer, params = build_optimizer(model, config.optim), trainable_parameters(model)
    data = build_data(config.data, config.train, load_tokenizer(str(folder / "student")), 0, 1)
    rows = data.train.rows
    mb = local_micro_batch(rows.collate([rows[i] for i in range(len(rows))]), parallel)

    def frozen(folder: str | None) -> torch.nn.Module:
        return build_frozen_model(config, parallel, device, folder, model_config)

    objective = build_objective(Context(config, model, parallel, frozen, data=data))

    def step() -> None:
        objective.begin_step([mb])
        objective.micro_step(mb)
        optimizer_step(optimizer, params, MAX_NORM)

    return step, int(mb["num_tokens"].sum()), int((mb["labels"] != IGNORE).sum())


def dtrain_results(records: int, seq: int, folder: Path, device: torch.device, args) -> list[Result]:
    """dtrain 1×1 unpacked and packed, built, warmed up, then timed in alternating rounds."""
    built = {
        f"dtrain.distill 1x1{' packed' if packed else ''}": dtrain_distill(
            records, seq, folder, device, packed
        )
        for packed in (False, True)
    }
    for step, _, _ in built.values():
        timed(step, args.warmup, device)
    seconds: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, (step, _, _) in built.items():
            seconds[name] = min(seconds.get(name, float("inf")), timed(step, args.steps, device))
    setup = Setup(batch=records, seq=seq)
    return [
        Result(name, 1, seconds[name], tokens, scored, flops(setup), peak_gib(device))
        for name, (_, tokens, scored) in built.items()
    ]


def trl_worker(args: argparse.Namespace) -> list[Result]:
    """TRL's GKDTrainer (lmbda 0) on the same folder and records: every record a step, its own loop
    (its collator pads each row to the batch's longest). Step times from a callback; rounds are
    consecutive windows of `steps` steps after the warm-up, the best counts."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    folder = Path(args.distill_folder)
    records = [json.loads(line) for line in (folder / "records.jsonl").read_text().splitlines()]
    total = args.warmup + args.rounds * args.steps
    durations: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *unused, **kwargs) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *unused, **kwargs) -> None:
            durations.append(time.perf_counter() - self.start)

    with tempfile.TemporaryDirectory() as output:
        settings = GKDConfig(
            output_dir=output,
            per_device_train_batch_size=len(records),
            max_steps=total,
            learning_rate=LR,
            max_grad_norm=MAX_NORM,
            lr_scheduler_type="constant",
            optim="adamw_torch_fused",
            max_length=args.distill_seq,
            lmbda=0.0,
            beta=BETA,
            gradient_checkpointing=False,
            bf16=False,
            use_cpu=not torch.cuda.is_available(),
            report_to=[],
            logging_strategy="no",
            save_strategy="no",
            disable_tqdm=True,
            train_sampling_strategy="sequential",
            seed=0,
        )
        load = {"dtype": torch.float32}
        trainer = GKDTrainer(
            model=AutoModelForCausalLM.from_pretrained(folder / "student", **load),
            teacher_model=AutoModelForCausalLM.from_pretrained(folder / "teacher", **load),
            args=settings,
            train_dataset=Dataset.from_list(records * total),
            processing_class=AutoTokenizer.from_pretrained(folder / "student"),
            callbacks=[StepTimer()],
        )
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(records))])
        trainer.train()
    timed_steps = durations[args.warmup :]
    seconds = min(
        sum(timed_steps[i : i + args.steps]) / args.steps for i in range(0, len(timed_steps), args.steps)
    )
    tokens = int(batch["attention_mask"].sum())
    scored = int((batch["labels"][:, 1:] != IGNORE).sum())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    setup = Setup(batch=len(records), seq=args.distill_seq)
    return [Result("TRL GKDTrainer (lmbda 0)", 1, seconds, tokens, scored, flops(setup), peak_gib(device))]


# ---------------------------------------------------------------------------------------------------
# The divergence's memory


def temporaries(run: Callable[[], None], inputs: tuple[torch.Tensor, ...]) -> int:
    """Bytes `run` (a forward and backward on fake tensors) holds at its peak beyond `inputs` and what
    it leaves allocated (the gradients it returns)."""
    tracker = MemTracker()
    tracker.track_external(*inputs)
    with tracker:
        run()
    totals = [
        sum(int(value) for snapshot in tracker.get_tracker_snapshot(kind).values()
            for key, value in snapshot.items() if str(key) == "Total")
        for kind in ("peak", "current")
    ]  # fmt: skip
    return totals[0] - totals[1]


def divergence_memory(tokens: int = 2 * 2048, chunk: int = 256) -> list[tuple[str, float]]:
    """(what, GiB of temporaries) for the module docstring's heads and tokens."""
    vocab, width, teacher_width = 128256, 4096, 8192
    rows = []
    with FakeTensorMode():

        def tensors(vocab_rows: int, token_rows: int) -> tuple[torch.Tensor, ...]:
            hidden = torch.randn(1, token_rows, width).requires_grad_()
            head = torch.randn(vocab_rows, width).requires_grad_()
            return (
                hidden,
                head,
                torch.randn(1, token_rows, teacher_width),
                torch.randn(vocab_rows, teacher_width),
            )

        hidden, head, teacher_hidden, teacher_head = inputs = tensors(vocab, tokens)

        def dense() -> None:
            with warnings.catch_warnings():  # TRL's note that experimental APIs may change
                warnings.simplefilter("ignore")
                from trl.experimental.gkd import GKDTrainer

            logits = hidden @ head.T
            teacher_logits = teacher_hidden @ teacher_head.T
            # every token scored: no labels (their boolean mask needs values fake tensors lack)
            loss = GKDTrainer.generalized_jsd_loss(
                logits, teacher_logits, beta=BETA, num_items_in_batch=tokens
            )
            loss.backward()

        def chunked() -> None:
            from trl.trainer.distillation_trainer import _chunked_divergence_loss

            mask = torch.ones(1, tokens, dtype=torch.long)
            loss, _, _ = _chunked_divergence_loss(hidden, teacher_hidden, head, teacher_head, mask, BETA)
            loss.backward()

        rows.append(("TRL GKDTrainer: dense, full logits", temporaries(dense, inputs)))
        rows.append(("TRL DistillationTrainer: chunked, gathered heads", temporaries(chunked, inputs)))
        for tp in (1, 8):
            # One rank's work: its vocabulary shard of both heads against a chunk's rows of every tp
            # rank (the sequence-parallel gather): on one process, every position, chunk × tp a chunk.
            local = tensors(vocab // tp, tokens)
            labels = torch.zeros(1, tokens, dtype=torch.long)

            def fused(local=local, labels=labels, tp=tp) -> None:
                loss, _ = fused_divergence(*local, labels, Divergence(BETA), chunk * tp, vocab // tp)
                loss.backward()

            name = f"dtrain fused divergence, tp {tp}: per rank, loss_chunk {chunk}"
            rows.append((name, temporaries(fused, (*local, labels))))
    return [(name, value / GIB) for name, value in rows]
