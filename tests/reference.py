"""The parity tests' independent reference: the training data and the training loop written here from
the documented contract (docs/data.md, design.md §1), sharing no dtrain code.

Data (`Data`, `examples`, `layout`, `stream`): the JSONL records read with `json`, each rendered by
the tokenizer's own `apply_chat_template(..., return_assistant_tokens_mask=True)` (the
`prompt_response` format: one user turn, one assistant turn), truncated to max_len, dropped when the
response is empty or no response token is left to learn; labels shifted (a token is the target of the
one before it, -100 where not supervised, and on every document's last position); rows of max_len
slots, one document each or packed best-fit decreasing; the global stream a seeded permutation of
the rows per epoch, step s taking stream rows [s·G, (s+1)·G). Packed documents keep the boundaries
this module's packing gave them.

Loop (`reference_run`): `from_pretrained` in fp32, torch AdamW (decay on matrices only), HF's cosine
schedule with warmup, `clip_grad_norm_`, one micro-batch of the whole global batch (a mixture of
experts: or micro-steps of `Recipe.micro_batch` rows, HF's aux loss over each); packed rows run
document by document (HF's sdpa would attend across a row's documents). It runs with the test
process's CPU kernels and threads (tests/conftest.py: one thread unless DTRAIN_TEST_THREADS says
otherwise), and its result is cached on disk (`cached_run`) keyed by a hash of every input, those
included, so test files in other pytest-xdist workers share it. `AdamAllowance` sizes the weight
tolerance of each element from the run's own AdamW state (tests/README.md, "The error model").
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from filelock import FileLock
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, get_scheduler

from tests.tolerance import AdamAllowance

IGNORE = -100  # the label torch's cross_entropy and HF ignore


@dataclass(frozen=True)
class Data:
    """A `prompt_response` JSONL dataset as dtrain reads it with data.overlong=truncate (the default)."""

    path: Path
    tokenizer: Path  # a folder with the tokenizer and its chat template
    max_len: int
    packing: bool = False
    seed: int = 0
    shuffle: bool = True
    input_key: str = "prompt"
    output_key: str = "response"


@dataclass(frozen=True)
class Recipe:
    """The optimizer and schedule of the run (optim.*, train.* of the parity config)."""

    steps: int
    global_batch: int
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    warmup_steps: int
    max_grad_norm: float
    # A mixture-of-experts model with HF's aux loss: None, one forward of the whole global batch;
    # else micro-steps of this many consecutive stream rows, HF's aux loss of each (with accumulation:
    # summed token loss / the step's targets + coef · aux / micro-steps, a backward each).
    micro_batch: int | None = None
    # The rows' attention mask (1: a token, 0: padding) passed to the model, as HF's Trainer with a
    # padding collator does: its aux loss then leaves the padding out.
    attention_mask: bool = False


@dataclass
class Document:
    input_ids: list[int]
    labels: list[int]  # already shifted: labels[t] is the target at t


@dataclass
class Row:
    """max_len slots: documents back to back, then padding; `spans` are the documents' (start, stop)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    spans: list[tuple[int, int]] = field(default_factory=list)


def render(tokenizer, record: dict, data: Data) -> tuple[list[int], list[int]] | None:
    """Token ids and HF's assistant mask of one record; None for an empty response (dropped)."""
    response = str(record[data.output_key])
    if not response.strip():
        return None
    messages = [
        {"role": "user", "content": str(record[data.input_key])},
        {"role": "assistant", "content": response},
    ]
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]


def shifted_labels(ids: list[int], mask: list[int]) -> list[int]:
    """labels[t] = ids[t + 1] where that token is supervised, else -100; the last position has none."""
    return [ids[t + 1] if mask[t + 1] else IGNORE for t in range(len(ids) - 1)] + [IGNORE]


def _files_digest(paths: list[Path]) -> hashlib._Hash:
    hasher = hashlib.sha256()
    for path in sorted(paths):
        if path.is_file():
            hasher.update(path.name.encode() + path.read_bytes())
    return hasher


def _examples(data: Data) -> tuple[Document, ...]:
    documents = []
    for rendered in _rendered(data):
        if rendered is None:
            continue
        ids, mask = (part[: data.max_len] for part in rendered)  # data.overlong=truncate
        if not any(mask[1:]):  # no response token within max_len: nothing to learn
            continue
        documents.append(Document(ids, shifted_labels(ids, mask)))
    return tuple(documents)


_RENDERED: dict[tuple, list] = {}


def _rendered(data: Data) -> list[tuple[list[int], list[int]] | None]:
    """Every record rendered, once per process for each dataset and tokenizer (by content: the test
    models' folders hold copies of one tokenizer)."""
    files = [*Path(data.tokenizer).iterdir(), Path(data.path)]
    key = _files_digest(files).hexdigest(), data.input_key, data.output_key
    if key not in _RENDERED:
        tokenizer = AutoTokenizer.from_pretrained(data.tokenizer)
        with open(data.path, encoding="utf-8") as lines:
            records = [json.loads(line) for line in lines if line.strip()]
        _RENDERED[key] = [render(tokenizer, record, data) for record in records]
    return _RENDERED[key]


def examples(data: Data) -> list[Document]:
    """The kept documents of the dataset, in file order."""
    return list(_examples(data))


def best_fit_decreasing(lengths: list[int], max_len: int) -> list[list[int]]:
    """Longest document first (ties by index), each into the open row with the least room that still
    holds it, else a new row; among rows with that same room, the one that came to it last. Document
    indices per row, in the order placed."""
    rows: list[list[int]] = []
    room = torch.empty(0, dtype=torch.long)
    since = torch.empty(0, dtype=torch.long)  # when each row came to its room
    for step, index in enumerate(sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))):
        length = lengths[index]
        fits = room >= length
        if fits.any():
            least = room[fits].min()
            row = int(torch.where(room == least, since, -1).argmax())
        else:
            row = len(rows)
            rows.append([])
            room = torch.cat([room, torch.tensor([max_len])])
            since = torch.cat([since, torch.tensor([0])])
        rows[row].append(index)
        room[row] -= length
        since[row] = step
    return rows


def layout(data: Data) -> list[list[int]]:
    """Which documents each row holds: one each, or packed."""
    lengths = [len(doc.input_ids) for doc in _examples(data)]
    return best_fit_decreasing(lengths, data.max_len) if data.packing else [[i] for i in range(len(lengths))]


def pad_id(tokenizer_dir: Path) -> int:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def build_row(documents: list[Document], max_len: int, pad: int) -> Row:
    """Documents back to back, positions restarting at 0 for each; the padding continues the last
    document's positions (it starts no document) and has no labels."""
    ids = [token for doc in documents for token in doc.input_ids]
    labels = [label for doc in documents for label in doc.labels]
    positions = [p for doc in documents for p in range(len(doc.input_ids))]
    spans, start = [], 0
    for doc in documents:
        spans.append((start, start + len(doc.input_ids)))
        start += len(doc.input_ids)
    last = len(documents[-1].input_ids) if documents else 0
    fill = max_len - len(ids)
    return Row(
        input_ids=torch.tensor(ids + [pad] * fill, dtype=torch.long),
        labels=torch.tensor(labels + [IGNORE] * fill, dtype=torch.long),
        position_ids=torch.tensor(positions + list(range(last, last + fill)), dtype=torch.long),
        spans=spans,
    )


def rows(data: Data) -> list[Row]:
    """Every row of one epoch, before the shuffle."""
    documents, pad = _examples(data), pad_id(data.tokenizer)
    return [build_row([documents[i] for i in row], data.max_len, pad) for row in layout(data)]


def epoch_order(num_rows: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """Epoch e's order of the rows: torch.randperm seeded with seed·7919 + e (7919, a prime, keeps
    the seeds of (seed, epoch) pairs apart), or file order without data.shuffle."""
    if not shuffle:
        return list(range(num_rows))
    return torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed * 7919 + epoch)).tolist()


def stream(data: Data, global_batch: int) -> Iterator[list[Row]]:
    """The global batches: step s takes rows [s·G, (s+1)·G) of the epochs' permutations end to end."""
    all_rows = rows(data)
    orders: dict[int, list[int]] = {}
    position = 0
    while True:
        batch = []
        for p in range(position, position + global_batch):
            epoch, index = divmod(p, len(all_rows))
            if epoch not in orders:
                orders[epoch] = epoch_order(len(all_rows), data.seed, epoch, data.shuffle)
            batch.append(all_rows[orders[epoch][index]])
        position += global_batch
        yield batch


def summed_loss(model, batch: list[Row], packed: bool) -> torch.Tensor:
    """The batch's summed token loss: whole rows, or (packed) each document alone."""
    if not packed:
        ids = torch.stack([row.input_ids for row in batch])
        labels = torch.stack([row.labels for row in batch])
        logits = model(input_ids=ids, use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    total = torch.zeros(())
    for row in batch:
        for start, stop in row.spans:
            logits = model(input_ids=row.input_ids[None, start:stop], use_cache=False).logits[0]
            total = total + F.cross_entropy(
                logits, row.labels[start:stop], ignore_index=IGNORE, reduction="sum"
            )
    return total


def summed_loss_and_aux(
    model, batch: list[Row], packed: bool, micro_batch: int | None = None, attention_mask: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture-of-experts model whose config sets output_router_logits: the batch's summed token
    loss and HF's own router load-balancing loss (`aux_loss`): of the whole batch from one forward,
    or with `micro_batch` the mean of each micro-step's (that many consecutive rows, one forward
    each: their sum is differentiated at once, which is accumulation). Every slot of every row
    counted (no attention mask), or with `attention_mask` the rows' tokens only (the mask HF's
    Trainer passes with a padding collator: the padding is each row's tail)."""
    if packed:
        raise ValueError("the reference has no aux loss over packed rows (it runs documents one by one)")
    size = micro_batch or len(batch)
    summed, auxes = torch.zeros(()), []
    for rows in (batch[start : start + size] for start in range(0, len(batch), size)):
        ids = torch.stack([row.input_ids for row in rows])
        labels = torch.stack([row.labels for row in rows])
        inputs = dict(input_ids=ids, use_cache=False, output_router_logits=True)
        if attention_mask:
            slots = torch.arange(ids.shape[1])
            inputs["attention_mask"] = torch.stack([(slots < row.spans[-1][1]).long() for row in rows])
        out = model(**inputs)
        summed = summed + F.cross_entropy(
            out.logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum"
        )
        auxes.append(out.aux_loss)
    return summed, sum(auxes) / len(auxes)


def reference_run(model_dir: Path, data: Data, recipe: Recipe) -> dict:
    """Train the HF model on the global batches: {"losses", "norms", "params"} (params detached),
    "allowance" (tests/tolerance.py's AdamAllowance: each weight element's tolerance) and what it ran
    on ("model", "data")."""
    return _train(model_dir, data, recipe)


def grad_norm(parameters) -> float:
    """The global norm of the gradients, summed in float64: the norm of the gradients the run
    computed, without the error of an fp32 norm of the whole of each tensor (torch's
    clip_grad_norm_ sums a tensor's squares in fp32: 1e-6 low at these sizes, where a sharded run's
    norms of smaller pieces are closer)."""
    return sum(p.grad.double().pow(2).sum() for p in parameters if p.grad is not None).sqrt().item()


# Families whose attention HF computes in its eager implementation only: GPT-OSS's attention sinks
# (its model class refuses sdpa).
EAGER_ATTENTION = {"gpt_oss"}


def attention_implementation(model_dir: Path) -> str:
    return "eager" if AutoConfig.from_pretrained(model_dir).model_type in EAGER_ATTENTION else "sdpa"


def _train(model_dir: Path, data: Data, recipe: Recipe) -> dict:
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attention_implementation(model_dir)
    )
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": recipe.weight_decay}, {"params": vectors, "weight_decay": 0.0}],
        lr=recipe.lr,
        betas=recipe.betas,
        eps=recipe.eps,
    )
    scheduler = get_scheduler(
        "cosine", optimizer, num_warmup_steps=recipe.warmup_steps, num_training_steps=recipe.steps
    )
    named = dict(model.named_parameters())
    allowance = AdamAllowance(optimizer, named)
    batches = stream(data, recipe.global_batch)
    losses, norms, aux_losses = [], [], []
    moe_aux = getattr(model.config, "output_router_logits", False)  # HF adds its router loss then
    for _ in range(recipe.steps):
        batch = next(batches)
        targets = sum(int((row.labels != IGNORE).sum()) for row in batch)
        if moe_aux:
            summed, aux = summed_loss_and_aux(
                model, batch, data.packing, recipe.micro_batch, recipe.attention_mask
            )
            loss = summed / targets + model.config.router_aux_loss_coef * aux
            aux_losses.append(aux.item())
        else:
            loss = summed_loss(model, batch, data.packing) / targets
        loss.backward()
        norms.append(grad_norm(model.parameters()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.max_grad_norm)
        losses.append(loss.item())
        optimizer.step()
        allowance.step()
        scheduler.step()
        optimizer.zero_grad()
    params = {name: param.detach().clone() for name, param in model.named_parameters()}
    return {
        "losses": losses,
        "norms": norms,
        "params": params,
        "allowance": allowance.allowance(),
        **({"aux_losses": aux_losses} if moe_aux else {}),
        "model": str(model_dir),
        "data": _plain(data),
    }


def _plain(data: Data) -> dict:
    """The settings as plain values (torch.load's weights_only reads no Path)."""
    return {key: str(value) if isinstance(value, Path) else value for key, value in asdict(data).items()}


def _digest(model_dir: Path, data: Data, recipe: Recipe) -> str:
    """A hash of everything the run depends on: the model's and tokenizer's files, the dataset's
    bytes, the data settings and recipe, this module's and tests/tolerance.py's source, and the CPU
    kernels and threads it runs with (each rounds differently; tests/conftest.py sets them)."""
    hasher = _files_digest([*Path(model_dir).iterdir(), *Path(data.tokenizer).iterdir(), Path(data.path)])
    settings = {**_plain(data), "path": None, "tokenizer": None}
    hasher.update(json.dumps([settings, asdict(recipe)], sort_keys=True).encode())
    for module in (_digest, AdamAllowance):  # this module's source and the allowance's
        hasher.update(inspect.getsource(inspect.getmodule(module)).encode())
    kernels = torch.backends.cpu.get_cpu_capability(), os.environ.get("MKL_CBWR"), torch.get_num_threads()
    hasher.update(repr(kernels).encode())
    return hasher.hexdigest()[:24]


def cached_run(cache_dir: Path, model_dir: Path, data: Data, recipe: Recipe) -> dict:
    """reference_run, computed once per cache_dir: a file lock makes a second process (another
    pytest-xdist worker) wait for the first one's result instead of computing it again."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"{_digest(model_dir, data, recipe)}.pt"
    with FileLock(f"{path}.lock"):
        if path.exists():
            return torch.load(path)
        result = reference_run(model_dir, data, recipe)
        partial = path.with_suffix(".partial")
        torch.save(result, partial)
        os.replace(partial, path)
        return result
