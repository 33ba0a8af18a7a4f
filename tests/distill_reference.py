"""TRL 1.16's distillation trainers as dtrain.distill's reference (no dtrain code, no tests.helpers):
each step's loss and grad norm (and optionally the trained weights) of

- `gkd_run`: offline distillation, `trl.experimental.gkd.GKDTrainer` at `lmbda=0` (never samples: the
  dataset's completions), records in TRL's `messages` format;
- `distillation_run`: on-policy distillation, `trl.DistillationTrainer` whose sampling method
  (`_generate_single_turn`, the one call that samples) is replaced by a table of FIXED completions per
  prompt; its prompt tokenization, padding, chunked divergence and normaliser run unmodified;

and, without a trainer, the divergence alone: `dense_divergence` (TRL's own
`GKDTrainer.generalized_jsd_loss` on full logits) and `chunked_divergence` (TRL's own
`_chunked_divergence_loss` on hidden states and heads, DistillationTrainer's path).

Every run: fp32 on the CPU, one process, ONE micro-batch per optimizer step (the whole global batch:
per_device_train_batch_size = batch, gradient_accumulation_steps = 1), torch's fused AdamW, a schedule
with no warmup, clipping, the records in file order (GKD: `train_sampling_strategy="sequential"`;
DistillationTrainer: `shuffle_dataset=False`, whose RepeatSampler then walks the records in order and
drops an incomplete last batch; it still permutes the rows inside a step with `torch.randperm`
(`shuffle_sequence_dict`), which changes only the order of the step's sum). Give `steps * batch`
records (one epoch) so both trainers see the same batches.

Temperature. GKDTrainer never passes its `temperature` to the loss (gkd_trainer.py:349: it samples
with it only), so `gkd_run(temperature=T)` with T != 1 calls TRL's own `generalized_jsd_loss` with
`temperature=T` (both logits divided by T, as DistillationTrainer does): the trainer instance's
`generalized_jsd_loss` is that function with `temperature` bound (functools.partial), nothing else
changed. `gkd_temperature_in_loss=False` runs GKDTrainer untouched (its loss is then T = 1 whatever T).

The runs are cached on disk (`cached_*`), keyed by a hash of every input: the model folders' files,
the records, the settings, the installed trl/transformers/peft/torch versions, this module's source,
and the CPU kernels and threads (each rounds differently).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

from tests.tolerance import AdamAllowance

IGNORE = -100
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Recipe:
    """The optimizer, schedule and batch of a run (dtrain's defaults): `batch` records a step, in
    one micro-batch."""

    steps: int
    batch: int
    lr: float
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0  # HF's Trainer decays no bias and no norm weight: compare at 0
    max_grad_norm: float = 1.0
    scheduler: str = "cosine"
    warmup_steps: int = 0
    optim: str = "adamw_torch_fused"
    seed: int = 0


@dataclass(frozen=True)
class Lora:
    """A LoRA student: peft's LoraConfig(r, lora_alpha, target_modules, lora_dropout=0) on the
    student, its weights then overwritten by `adapters` (PEFT's saved names, e.g.
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`: dtrain's initial A, or a
    non-zero A and B). Names not given keep PEFT's init (seeded by Recipe.seed; B = 0)."""

    r: int
    alpha: float
    target_modules: tuple[str, ...] = LORA_TARGETS
    use_rslora: bool = False
    adapters: dict[str, torch.Tensor] = field(default_factory=dict)

    def config(self):
        from peft import LoraConfig

        return LoraConfig(
            task_type="CAUSAL_LM",
            r=self.r,
            lora_alpha=self.alpha,
            target_modules=list(self.target_modules),
            lora_dropout=0.0,
            use_rslora=self.use_rslora,
        )


# ---------------------------------------------------------------------------------------------------
# The divergence alone


def dense_divergence(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels_mask: torch.Tensor,
    beta: float,
    temperature: float = 1.0,
    num_items: int | float | torch.Tensor | None = None,
) -> torch.Tensor:
    """TRL's `GKDTrainer.generalized_jsd_loss` on full logits [..., V]: the sum over the positions
    where `labels_mask` is true of the divergence between softmax(student / T) and softmax(teacher /
    T), divided by `num_items` (default: the mask's count). beta 0: KL(teacher || student); 1:
    KL(student || teacher); else beta·KL(teacher || m) + (1 - beta)·KL(student || m), m = (1 - beta)
    p_student + beta p_teacher. Differentiable in both logits (autograd through TRL's code)."""
    from trl.experimental.gkd import GKDTrainer

    labels = torch.where(labels_mask.bool(), 0, IGNORE)  # TRL's mask is labels != -100
    return GKDTrainer.generalized_jsd_loss(
        student_logits,
        teacher_logits,
        labels,
        beta=beta,
        temperature=temperature,
        num_items_in_batch=num_items,
    )


def dense_divergence_per_token(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels_mask: torch.Tensor,
    beta: float,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Each position's divergence (shape of `labels_mask`, 0 where it is false): TRL's
    `generalized_jsd_loss(reduction="none")` (per vocabulary entry) summed over the vocabulary."""
    from trl.experimental.gkd import GKDTrainer

    mask = labels_mask.bool()
    per_entry = GKDTrainer.generalized_jsd_loss(
        student_logits,
        teacher_logits,
        torch.where(mask, 0, IGNORE),
        beta=beta,
        temperature=temperature,
        reduction="none",
    )
    out = torch.zeros(mask.shape, dtype=per_entry.dtype)
    out[mask] = per_entry.sum(-1)
    return out


def chunked_divergence(
    student_hidden: torch.Tensor,
    student_head: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_head: torch.Tensor,
    labels_mask: torch.Tensor,
    beta: float,
    temperature: float = 1.0,
    num_items: int | float | torch.Tensor | None = None,
    **scales: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's `_chunked_divergence_loss` (DistillationTrainer's loss, distillation_trainer.py:101):
    hidden states [B, K, H_s] / [B, K, H_t] (H may differ), heads [V, H_s] / [V, H_t], the mask [B, K].
    Returns (sum / num_items, or / the mask's count when None; the student entropy's sum; the count).
    `scales`: its student/teacher `_logit_scale`, `_final_logit_softcapping`, `_lm_head_bias`."""
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    return _chunked_divergence_loss(
        student_hidden,
        teacher_hidden,
        student_head,
        teacher_head,
        labels_mask.long(),
        beta,
        num_items_in_batch=num_items,
        temperature=temperature,
        **scales,
    )


# ---------------------------------------------------------------------------------------------------
# Data


def as_messages(prompt: str, response: str) -> dict:
    """A prompt/response pair in GKD's format: {"messages": [user, assistant]}."""
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]}


def as_prompt(prompt: str, response: str | list[int]) -> dict:
    """A prompt/response pair in DistillationTrainer's conversational format, with its fixed completion:
    {"prompt": [user], "completion": response} (text, or token ids used as they are)."""
    return {"prompt": [{"role": "user", "content": prompt}], "completion": response}


def completion_ids(tokenizer, completion: str | list[int], max_completion_length: int) -> list[int]:
    """The token ids a sampled completion would have: text is `tokenizer(text,
    add_special_tokens=False)` then EOS, cut to max_completion_length (a completion that does not end
    within the budget is truncated without EOS, as generate with max_new_tokens stops it); ids are
    used as given. An EOS anywhere but last is refused: sampling stops at the first one."""
    if isinstance(completion, str):
        ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = ids[:max_completion_length]
    else:
        ids = list(completion)
        if len(ids) > max_completion_length:
            raise ValueError(
                f"{len(ids)} completion ids exceed max_completion_length={max_completion_length}"
            )
    if tokenizer.eos_token_id in ids[:-1]:
        raise ValueError(f"EOS before the end of a fixed completion: {ids}")
    if not ids:
        raise ValueError("an empty completion")
    return ids


def gkd_tokenized(tokenizer_dir: Path, records: list[dict], max_length: int = 1024) -> list[dict]:
    """GKD's own tokenization (`DataCollatorForChatML`, what GKDTrainer's default collator does) of
    each record alone: {"input_ids", "scored"}: the row's ids and the ids its loss scores (the labels
    after the causal shift that are not -100), in order."""
    from transformers import AutoTokenizer
    from trl.experimental.utils import DataCollatorForChatML

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    collator = DataCollatorForChatML(tokenizer=tokenizer, max_length=max_length)
    rows = []
    for record in records:
        batch = collator([record])
        labels = batch["labels"][0]
        scored = labels[labels != IGNORE].tolist()
        rows.append({"input_ids": batch["input_ids"][0].tolist(), "scored": scored})
    return rows


# ---------------------------------------------------------------------------------------------------
# The runs


def _common_args(recipe: Recipe) -> dict:
    return dict(
        output_dir=tempfile.mkdtemp(prefix="trl-distill-"),
        per_device_train_batch_size=recipe.batch,
        gradient_accumulation_steps=1,
        max_steps=recipe.steps,
        learning_rate=recipe.lr,
        weight_decay=recipe.weight_decay,
        adam_beta1=recipe.betas[0],
        adam_beta2=recipe.betas[1],
        adam_epsilon=recipe.eps,
        max_grad_norm=recipe.max_grad_norm,
        lr_scheduler_type=recipe.scheduler,
        warmup_steps=recipe.warmup_steps,
        optim=recipe.optim,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,  # exact either way; slower
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=recipe.seed,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def _load(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def saved_name(name: str) -> str:
    """A parameter's name as PEFT saves it (the adapter name `default` left out)."""
    return name.replace(".default.", ".")


def load_adapters(model, lora: Lora | None) -> None:
    """Copy `lora.adapters` (PEFT's saved names) into a PEFT model's parameters."""
    if lora is None or not lora.adapters:
        return
    state = dict(model.named_parameters())
    by_saved = {saved_name(name): param for name, param in state.items()}
    missing = sorted(set(lora.adapters) - set(by_saved))
    if missing:
        raise KeyError(f"adapters name no parameter of the PEFT model: {missing[:4]}")
    with torch.no_grad():
        for name, tensor in lora.adapters.items():
            by_saved[name].copy_(tensor)


class _Recorder:
    """What the trainer did at each step, recorded without changing it: the loss's normaliser
    (`tokens`) and the rows it trained on (`batches`) from compute_loss's arguments, the gradients'
    norm summed in float64 before clipping (`grad_norm_fp64`: torch's fp32 norm of whole tensors, which
    TRL logs as grad_norm, can be ~1e-6 low), and AdamW's allowance for the weights."""

    def __init__(self, trainer, rows_of) -> None:
        self.trainer, self.rows_of = trainer, rows_of
        self.tokens: list[float] = []
        self.batches: list[list[dict]] = []
        self.norms: list[float] = []
        self.allowance: AdamAllowance | None = None
        compute_loss, clip = trainer.compute_loss, trainer._clip_grad_norm

        def recording_compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
            if model.training:
                count = inputs.get("num_items_in_batch", num_items_in_batch)
                self.tokens.append(float(count))
                self.batches.append(rows_of(inputs))
            return compute_loss(model, inputs, return_outputs, num_items_in_batch)

        def recording_clip(model):
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            self.norms.append(sum(g.double().pow(2).sum() for g in grads).sqrt().item())
            return clip(model)

        trainer.compute_loss, trainer._clip_grad_norm = recording_compute_loss, recording_clip

    def track_weights(self) -> None:
        from transformers import TrainerCallback

        recorder = self

        class Allowance(TrainerCallback):
            def on_optimizer_step(self, args, state, control, **kwargs):
                if recorder.allowance is None:
                    optimizer = getattr(recorder.trainer.optimizer, "optimizer", recorder.trainer.optimizer)
                    recorder.allowance = AdamAllowance(optimizer, _trainable(recorder.trainer.model))
                recorder.allowance.step()

        self.trainer.add_callback(Allowance())


def _trainable(model) -> dict[str, torch.Tensor]:
    return {saved_name(name): p for name, p in model.named_parameters() if p.requires_grad}


def _history(trainer, recorder: _Recorder, recipe: Recipe, weights: bool) -> dict:
    logged = [entry for entry in trainer.state.log_history if "grad_norm" in entry]
    assert len(logged) == recipe.steps == len(recorder.norms), trainer.state.log_history
    result = {key: [entry[key] for entry in logged] for key in ("loss", "grad_norm", "learning_rate")}
    if "entropy" in logged[0]:
        result["entropy"] = [entry["entropy"] for entry in logged]
    result |= {"grad_norm_fp64": recorder.norms, "tokens": recorder.tokens, "batches": recorder.batches}
    if weights:
        result["params"] = {name: p.detach().clone() for name, p in _trainable(trainer.model).items()}
        result["allowance"] = recorder.allowance.allowance()
    return result


def _gkd_rows(inputs: dict) -> list[dict]:
    return [
        {"input_ids": ids[mask.bool()].tolist(), "scored": labels[labels != IGNORE].tolist()}
        for ids, mask, labels in zip(
            inputs["input_ids"], inputs["attention_mask"], inputs["labels"], strict=True
        )
    ]


def gkd_trainer(
    student: Path,
    teacher: Path,
    records: list[dict],
    recipe: Recipe,
    beta: float,
    temperature: float = 1.0,
    max_length: int = 1024,
    lora: Lora | None = None,
    gkd_temperature_in_loss: bool = True,
):
    """A GKDTrainer at lmbda=0 (seq_kd off: the records' own completions every step) on fp32 copies of
    `student` and `teacher` (HF folders; the tokenizer is the student's). `records`: GKD's format,
    {"messages": [..., {"role": "assistant", ...}]} (the last message is the completion; the
    messages before it, rendered with the generation prompt, are the prompt)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    args = GKDConfig(
        **_common_args(recipe),
        lmbda=0.0,
        beta=beta,
        temperature=temperature,  # GKD samples with it (never at lmbda=0); its loss ignores it
        seq_kd=False,
        max_length=max_length,
        train_sampling_strategy="sequential",
    )
    trainer = GKDTrainer(
        model=_load(student),
        teacher_model=_load(teacher),
        args=args,
        train_dataset=Dataset.from_list(records),
        processing_class=AutoTokenizer.from_pretrained(student),
        peft_config=lora.config() if lora else None,
    )
    if temperature != 1.0 and gkd_temperature_in_loss:
        # the loss with both logits divided by T: TRL's own function, called with the temperature
        divided = functools.partial(GKDTrainer.generalized_jsd_loss, temperature=temperature)
        trainer.generalized_jsd_loss = divided
    load_adapters(trainer.model, lora)
    return trainer


def gkd_run(
    student: Path,
    teacher: Path,
    records: list[dict],
    recipe: Recipe,
    beta: float,
    temperature: float = 1.0,
    max_length: int = 1024,
    lora: Lora | None = None,
    weights: bool = False,
    gkd_temperature_in_loss: bool = True,
) -> dict:
    """Train `gkd_trainer(...)` recipe.steps steps: {"loss", "grad_norm" (TRL's logged values),
    "learning_rate", "grad_norm_fp64", "tokens" (the normaliser: the step's scored tokens), "batches"
    (per step, each row's {"input_ids", "scored"}, in the step's order)}, and with `weights`
    {"params", "allowance"}: the trained trainable weights (HF names; LoRA: PEFT's saved names) and
    tests/tolerance.py's AdamAllowance of each element."""
    trainer = gkd_trainer(
        student, teacher, records, recipe, beta, temperature, max_length, lora, gkd_temperature_in_loss
    )
    recorder = _Recorder(trainer, _gkd_rows)
    if weights:
        recorder.track_weights()
    trainer.train()
    return _history(trainer, recorder, recipe, weights)


def _fixed_generation(trainer, records: list[dict], max_completion_length: int) -> dict[tuple, list[int]]:
    """{prompt ids: completion ids}: each record's prompt as the trainer tokenizes it
    (`_tokenize_prompts`, its own code) and its fixed completion (`completion_ids`)."""
    table: dict[tuple, list[int]] = {}
    for record in records:
        (prompt,), _, _ = trainer._tokenize_prompts([record["prompt"]])
        ids = completion_ids(trainer._tokenizer, record["completion"], max_completion_length)
        if table.setdefault(tuple(prompt), ids) != ids:
            raise ValueError(f"two fixed completions for one prompt: {record['prompt']!r}")
    return table


def _distillation_rows(inputs: dict) -> list[dict]:
    columns = [inputs[key] for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]
    return [
        {
            "prompt_ids": prompt[prompt_mask.bool()].tolist(),
            "completion_ids": completion[mask.bool()].tolist(),
        }
        for prompt, prompt_mask, completion, mask in zip(*columns, strict=True)
    ]


def distillation_trainer(
    student: Path,
    teacher: Path,
    records: list[dict],
    recipe: Recipe,
    beta: float,
    temperature: float = 1.0,
    max_completion_length: int = 512,
    lora: Lora | None = None,
):
    """TRL's DistillationTrainer on fp32 copies of `student` and `teacher` whose sampling returns each
    record's fixed completion. `records`: {"prompt": messages (conversational: the chat template with
    the generation prompt) or a string (tokenized as is, with the tokenizer's special tokens),
    "completion": text or ids (`completion_ids`)}; only "prompt" goes into the dataset."""
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    args = DistillationConfig(
        **_common_args(recipe),
        beta=beta,
        temperature=temperature,
        max_completion_length=max_completion_length,
        shuffle_dataset=False,
    )
    trainer = DistillationTrainer(
        model=_load(student),
        teacher_model=_load(teacher),
        args=args,
        train_dataset=Dataset.from_list([{"prompt": record["prompt"]} for record in records]),
        processing_class=None,  # TRL loads the student folder's own (left padding and truncation)
        peft_config=lora.config() if lora else None,
    )
    table = _fixed_generation(trainer, records, max_completion_length)

    def fixed_single_turn(prompt_ids, images, multimodal_fields, has_tool_images=False):
        # replaces DistillationTrainer._generate_single_turn (distillation_trainer.py:1003), the one
        # method that samples: the same input (the batch's prompt ids) and output (completion ids)
        return [list(table[tuple(ids)]) for ids in prompt_ids]

    trainer._generate_single_turn = fixed_single_turn
    load_adapters(trainer.model, lora)
    return trainer


def distillation_run(
    student: Path,
    teacher: Path,
    records: list[dict],
    recipe: Recipe,
    beta: float,
    temperature: float = 1.0,
    max_completion_length: int = 512,
    lora: Lora | None = None,
    weights: bool = False,
) -> dict:
    """Train `distillation_trainer(...)` recipe.steps steps: as gkd_run's result, plus "entropy" (the
    student's mean entropy at T, which TRL logs), and "batches" rows {"prompt_ids", "completion_ids"}
    (the scored tokens are the completion ids)."""
    trainer = distillation_trainer(
        student, teacher, records, recipe, beta, temperature, max_completion_length, lora
    )
    recorder = _Recorder(trainer, _distillation_rows)
    if weights:
        recorder.track_weights()
    trainer.train()
    return _history(trainer, recorder, recipe, weights)


# ---------------------------------------------------------------------------------------------------
# Cache


def _digest(name: str, folders: list[Path], settings: Any) -> str:
    import peft
    import transformers
    import trl

    hasher = hashlib.sha256(name.encode())
    for folder in folders:
        for path in sorted(Path(folder).iterdir()):
            if path.is_file():
                hasher.update(path.name.encode() + path.read_bytes())

    def plain(value):
        if isinstance(value, torch.Tensor):
            data = value.detach().contiguous().cpu().numpy().tobytes()
            return hashlib.sha256(data).hexdigest() + str(value.dtype)
        if isinstance(value, Path):
            return None  # a folder counts by its files
        return str(value)

    hasher.update(json.dumps(settings, sort_keys=True, default=plain).encode())
    versions = trl.__version__, transformers.__version__, peft.__version__, torch.__version__
    kernels = torch.backends.cpu.get_cpu_capability(), os.environ.get("MKL_CBWR"), torch.get_num_threads()
    hasher.update(repr((versions, kernels)).encode())
    for module in (_digest, AdamAllowance):  # this module's source and the allowance's
        hasher.update(inspect.getsource(inspect.getmodule(module)).encode())
    return hasher.hexdigest()[:24]


def cached(cache_dir: Path, name: str, folders: list[Path], settings: Any, compute) -> Any:
    """compute(), stored in cache_dir/NAME-HASH.pt (REFERENCE_CACHE overrides cache_dir) under a hash of
    the folders' files and `settings`; a file lock makes a second process (another pytest-xdist worker)
    wait for the first one's result instead of computing it again."""
    folder = Path(os.environ.get("REFERENCE_CACHE", cache_dir))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{_digest(name, folders, settings)}.pt"
    with FileLock(f"{path}.lock"):
        if path.exists():
            return torch.load(path)
        result = compute()
        partial = path.with_suffix(".partial")
        torch.save(result, partial)
        os.replace(partial, path)
        return result


def _settings(records: list[dict], recipe: Recipe, kwargs: dict) -> dict:
    lora = kwargs.get("lora")
    return {"records": records, "recipe": asdict(recipe), **kwargs, "lora": asdict(lora) if lora else None}


def cached_gkd_run(
    cache_dir: Path, student: Path, teacher: Path, records: list[dict], recipe: Recipe, **kwargs
) -> dict:
    """gkd_run, computed once per cache (same keyword arguments)."""
    settings = _settings(records, recipe, kwargs)
    compute = functools.partial(gkd_run, student, teacher, records, recipe, **kwargs)
    return cached(cache_dir, "trl-gkd", [student, teacher], settings, compute)


def cached_distillation_run(
    cache_dir: Path, student: Path, teacher: Path, records: list[dict], recipe: Recipe, **kwargs
) -> dict:
    """distillation_run, computed once per cache (same keyword arguments)."""
    settings = _settings(records, recipe, kwargs)
    compute = functools.partial(distillation_run, student, teacher, records, recipe, **kwargs)
    return cached(cache_dir, "trl-distillation", [student, teacher], settings, compute)
