"""TRL 1.16's DPOTrainer as dtrain.dpo's reference (no dtrain code): its per-step loss, grad norm
and metrics on a model folder and preference records, fp32 on the CPU, one micro-batch holding the
whole global batch, the records in file order; and its own tokenization of the records.

The runs are cached on disk (REFERENCE_CACHE, or the test session's folder) under a hash of
everything that shapes them, so the suite computes each once."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

ADAM_EPS = 1e-6  # AdamW's eps of the runs (tests/workers/dpo_runs.py says why); in the cache keys
METRICS = (
    "loss",
    "grad_norm",
    "rewards/accuracies",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
# TRL's eval metrics (its evaluation of eval_dataset, logged with the `eval_` prefix)
EVAL_METRICS = ("eval_loss", *(f"eval_{key}" for key in METRICS[2:]))


def trl_args(steps: int, batch: int, lr: float, max_len: int, **dpo: Any):
    """DPOConfig of the runs dtrain must reproduce: AdamW (0.9, 0.95, eps 1e-6), no weight decay, clip 1.0,
    cosine after `warmup_steps`, the records in order (`train_sampling_strategy=sequential`), no
    gradient checkpointing (exact either way, slower), fp32 on the CPU."""
    from trl import DPOConfig

    settings = dict(warmup_steps=0, lr_scheduler_type="cosine") | dpo
    return DPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-dpo-"),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        max_steps=steps,
        learning_rate=lr,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=ADAM_EPS,
        max_grad_norm=1.0,
        max_length=max_len,
        optim="adamw_torch_fused",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=0,
        train_sampling_strategy="sequential",
        disable_tqdm=True,
        **settings,
    )


def trainer(
    model_dir: Path,
    records: list[dict],
    args,
    peft: dict | None = None,
    adapter: Path | None = None,
    ref_model: Path | None = None,
    eval_records: list[dict] | None = None,
):
    """A DPOTrainer on `model_dir` (fp32) and `records`; `peft`: a peft LoraConfig's keyword arguments
    (the trainer wraps the model itself, its reference: the adapters disabled); `adapter`: a PEFT
    adapter folder the model starts from (PeftModel.from_pretrained; TRL's reference: a frozen copy
    of it); `ref_model`: a model folder TRL takes as its `ref_model`; `eval_records`: its eval_dataset."""
    from datasets import Dataset
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOTrainer

    model = str(model_dir)
    if adapter is not None:
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, adapter, is_trainable=True)
    return DPOTrainer(
        model=model,
        ref_model=AutoModelForCausalLM.from_pretrained(ref_model, dtype=torch.float32) if ref_model else None,
        args=args,
        train_dataset=Dataset.from_list(records),
        eval_dataset=Dataset.from_list(eval_records) if eval_records else None,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        peft_config=LoraConfig(task_type="CAUSAL_LM", **peft) if peft else None,
    )


def trl_run(
    model_dir: Path,
    records: list[dict],
    steps: int,
    batch: int,
    lr: float,
    max_len: int,
    peft: dict | None = None,
    adapters: dict[str, torch.Tensor] | None = None,
    adapter: Path | None = None,
    ref_model: Path | None = None,
    eval_records: list[dict] | None = None,
    eval_steps: int = 0,
    **dpo: Any,
) -> dict[str, list]:
    """METRICS of each step of a DPOTrainer run, and under "eval" each evaluation's EVAL_METRICS and
    step. `adapters`: PEFT names → initial LoRA weights copied into the trainer's adapter before
    training (dtrain's initial A; B is zero in both); `adapter`, `ref_model`, `eval_records`: as
    trainer()'s; the eval set is one batch, evaluated every `eval_steps` steps."""
    if eval_records:
        dpo |= dict(eval_strategy="steps", eval_steps=eval_steps)
        dpo |= dict(per_device_eval_batch_size=len(eval_records))
    args = trl_args(steps, batch, lr, max_len, **dpo)
    run = trainer(model_dir, records, args, peft, adapter, ref_model, eval_records)
    if adapters:
        state = run.model.state_dict()
        for key, tensor in adapters.items():  # base_model.model.X.lora_A.weight → ...lora_A.default.weight
            state[key.replace(".weight", ".default.weight")].copy_(tensor)
    run.train()
    history = [entry for entry in run.state.log_history if "grad_norm" in entry]
    assert len(history) == steps, run.state.log_history
    evals = [entry for entry in run.state.log_history if "eval_loss" in entry]
    result: dict[str, list] = {key: [entry[key] for entry in history] for key in METRICS}
    result["eval"] = [{key: entry[key] for key in ("step", *EVAL_METRICS)} for entry in evals]
    return result


def trl_tokenized(model_dir: Path, records: list[dict], max_len: int) -> list[dict[str, list[int]]]:
    """TRL's own tokenization of `records` (its dataset preparation, then its collator's truncation):
    each kept pair's prompt, chosen and rejected token ids, in order."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    run = trainer(model_dir, records, trl_args(1, 1, 0.0, max_len))
    collator = DataCollatorForPreference(pad_token_id=0, max_length=max_len)
    pairs = []
    for example in run.train_dataset:
        batch = collator([example])
        prompt = len(example["prompt_ids"])
        chosen, rejected = (
            row[mask.bool()].tolist()
            for row, mask in zip(batch["input_ids"], batch["completion_mask"], strict=True)
        )
        ids = batch["input_ids"][0][batch["attention_mask"][0].bool()].tolist()
        pairs.append({"prompt_ids": ids[:prompt], "chosen_ids": chosen, "rejected_ids": rejected})
    return pairs


def cached(cache: Path, name: str, inputs: Any, compute) -> Any:
    """compute(), stored in cache/NAME-HASH.pt under a hash of `inputs` (JSON) and the model files."""
    key = hashlib.sha1(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = Path(os.environ.get("REFERENCE_CACHE", cache)) / f"{name}-{key}.pt"
    if path.is_file():
        return torch.load(path)
    result = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(result, path)
    return result


def preference_records(count: int, seed: int = 0, long: bool = False, overlong: bool = True) -> list[dict]:
    """`count` conversational pairs (TRL's explicit prompt) on the tiny tokenizer's tasks, the sixth
    one with a prompt longer than any max_len <= 64 (dropped by TRL and by dtrain; overlong=False:
    none). Completions of very different lengths (1 to 30 letters: some cut at max_len 32) side by
    side, so that packed rows mix short and long sequences (open-instruct#1900's case). Four chosen
    completions in five are letters of the alphabet's first half and their rejected ones of its second
    half, the fifth the other way round: a pattern one step learns, so the policy's reward accuracy on
    the next step's pairs moves off 0 and 1/2 (a chosen/rejected swap in the accuracy shows).
    long=True: every completion at least 40 letters, so every sequence fills max_len 32 (no padding
    anywhere, in any framework)."""
    import random

    rng = random.Random(seed)
    first, second = "abcdefghijklm", "nopqrstuvwxyz"

    def word(letters: str, lo: int, hi: int) -> str:
        return " ".join(rng.choice(letters) for _ in range(rng.randint(lo, hi)))

    low, high = (40, 50) if long else (1, 30)
    records = []
    for _ in range(count - 1 if overlong else count):
        good, bad = (first, second) if rng.random() < 0.8 else (second, first)
        records.append(
            {
                "prompt": [{"role": "user", "content": f"sort: {word(first + second, 1, 8)}"}],
                "chosen": [{"role": "assistant", "content": word(good, low, high)}],
                "rejected": [{"role": "assistant", "content": word(bad, low, high)}],
            }
        )
    if not overlong:
        return records
    too_long = {"role": "user", "content": f"sort: {word(first + second, 70, 70)}"}
    return [*records[:5], {**records[0], "prompt": [too_long]}, *records[5:]]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path
