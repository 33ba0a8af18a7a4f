"""The data stages in order: sources → tokenize (datasets.map, cached, once per machine) → drop what
cannot train → eval hold-out → weighted mix → rows (packed or not) → loaders."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import datasets
import torch
import torch.distributed as dist
from datasets.fingerprint import Hasher
from transformers import PreTrainedTokenizerBase

from dtrain.config import ConfigError, DataConfig, Source, TrainConfig
from dtrain.data.completions import Completions
from dtrain.data.formats import FORMATS, KEPT, NOTHING_TO_LEARN, TRUNCATED, pad_id, tokenize_example
from dtrain.data.loader import Rows, SFTLoader, eval_micro_batches
from dtrain.data.packing import efficiency, one_per_row, pack
from dtrain.data.pairs import Pairs, eval_pair_batches
from dtrain.data.prompts import Prompts
from dtrain.data.sources import Places, load_split, places

log = logging.getLogger("dtrain")

# Bump when tokenize_example or a format (formats.FORMATS) changes what it writes, so old cache
# files are not reused.
TOKENIZE_VERSION = 2  # 2: the prompt_completion format (dtrain.distill)
T = TypeVar("T")
PREPARE_TIMEOUT_S = 24 * 3600  # how long ranks wait for local rank 0 to tokenize
NAMED = 3  # the examples of each kind dropped (or kept with nothing to learn) that the start names


@dataclass
class SFTData:
    train: SFTLoader
    eval: list[dict[str, torch.Tensor]] | None  # this dp rank's eval micro-batches
    num_examples: int  # training examples (before packing)
    efficiency: float  # non-pad tokens / slots of the training rows
    # the examples of the training sources dropped, or kept with nothing to learn, by why (formats'
    # statuses): for the start line
    flagged: Counter = dataclasses.field(default_factory=Counter)

    def examples(self) -> str:
        """The training examples for the start line: how many, and those flagged, by why."""
        dropped = [f"{n} {status}" for status, n in sorted(self.flagged.items()) if status not in KEPT]
        idle = [f"{n} {status}" for status, n in sorted(self.flagged.items()) if status in NOTHING_TO_LEARN]
        notes = []
        if idle:
            notes.append(f"kept with nothing to learn: {', '.join(idle)}")
        if dropped:
            notes.append(f"dropped: {', '.join(dropped)}")
        return f"{self.num_examples} examples" + (f" ({'; '.join(notes)})" if notes else "")


def build_data(
    data: DataConfig, train: TrainConfig, tokenizer: PreTrainedTokenizerBase, dp_rank: int, dp_size: int
) -> SFTData:
    train_examples, eval_examples, flagged = once_per_machine(
        lambda: prepare_counted(data, tokenizer, train.seed)
    )
    rows = to_rows(train_examples, data, tokenizer)
    if isinstance(rows, Prompts):  # completions come later (dtrain.grpo), packed per micro-batch
        fill = 0.0
        log.info(f"data: {len(rows)} training prompts, {train.global_batch_size} a generation")
    elif isinstance(rows, Pairs):  # packed per micro-batch: the fill is known as each one is built
        fill = efficiency(column(train_examples, "length"), [[]] * (2 * len(rows)), data.max_len)
        log.info(
            f"data: {len(rows)} training pairs, two sequences each of at most {data.max_len} tokens "
            f"({'packed per micro-batch' if data.packing else f'one per row: efficiency {fill:.1%}'})"
        )
    elif isinstance(rows, Completions):  # likewise, a sequence per example
        fill = efficiency(column(train_examples, "length"), [[]] * len(rows), data.max_len)
        log.info(
            f"data: {len(rows)} training prompts with completions, a sequence each of at most "
            f"{data.max_len} tokens "
            f"({'packed per micro-batch' if data.packing else f'one per row: efficiency {fill:.1%}'})"
        )
    else:
        fill = efficiency(column(train_examples, "length"), rows.rows, data.max_len)
        log.info(
            f"data: {len(train_examples)} training examples in {len(rows)} rows of {data.max_len} "
            f"({'packed' if data.packing else 'one per row'}), efficiency {fill:.1%} (non-pad tokens / slots)"
        )
    loader = SFTLoader(
        rows,
        global_batch_size=train.global_batch_size,
        micro_batch_size=train.micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=train.seed,
        shuffle=data.shuffle,
        num_workers=data.num_workers,
    )
    evals = None
    if eval_examples is not None:
        eval_rows = to_rows(eval_examples, data, tokenizer)
        batches = eval_pair_batches if isinstance(eval_rows, Pairs) else eval_micro_batches
        evals = batches(eval_rows, train.micro_batch_size, dp_rank, dp_size)
        log.info(f"data: {len(eval_examples)} eval examples in {len(eval_rows)} rows")
    return SFTData(loader, evals, len(train_examples), fill, flagged)


def to_rows(
    examples: datasets.Dataset, data: DataConfig, tokenizer: PreTrainedTokenizerBase
) -> Rows | Pairs | Prompts | Completions:
    if all(source.format == "prompt" for source in data.sources()):  # dtrain.grpo's prompts
        return Prompts(examples)
    if data.preference:  # pairs, packed per micro-batch (dtrain/data/pairs.py)
        return Pairs(examples, data.max_len, pad_id(tokenizer), data.packing)
    if data.completions:  # prompts with completions, packed per micro-batch (dtrain/data/completions.py)
        return Completions(examples, data.max_len, pad_id(tokenizer), data.packing)
    layout = pack(column(examples, "length"), data.max_len) if data.packing else one_per_row(len(examples))
    return Rows(examples, layout, data.max_len, pad_id(tokenizer))


def column(dataset: datasets.Dataset, name: str) -> list:
    """A whole column as a list at once (datasets' Column costs ~100 µs per item indexed)."""
    return dataset[name][:]


def prepare(
    data: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int
) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """The training examples (mixed) and the eval examples (or None), tokenized and filtered."""
    train_examples, eval_examples, _ = prepare_counted(data, tokenizer, seed)
    return train_examples, eval_examples


def prepare_counted(
    data: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int
) -> tuple[datasets.Dataset, datasets.Dataset | None, Counter]:
    """prepare's, and the training sources' examples dropped or kept with nothing to learn, by why."""
    train_parts, eval_parts, weights, flagged = [], [], [], Counter()
    for source in data.sources():
        examples, counts = tokenized(source.split, source, data, tokenizer)
        flagged += counts
        if data.eval_fraction > 0:
            examples, held_out = hold_out(examples, data.eval_fraction, seed, source)
            eval_parts.append(held_out)
        elif data.eval_split is not None:
            eval_parts.append(tokenized(data.eval_split, source, data, tokenizer)[0])
        train_parts.append(examples)
        weights.append(source.weight)
    train_examples = mix(train_parts, weights, seed)
    eval_examples = datasets.concatenate_datasets(eval_parts) if eval_parts else None
    return train_examples, eval_examples, flagged


def tokenized(
    split: str, source: Source, data: DataConfig, tokenizer: PreTrainedTokenizerBase
) -> tuple[datasets.Dataset, Counter]:
    """The source's split tokenized with datasets.map (cached under a fingerprint of everything that
    shapes the result), its examples counted and named (FILE:LINE) by why they are dropped or have
    nothing to learn, the kept ones; with those counts. A source with nothing to learn is refused."""
    dataset = load_split(source, split)
    named = places(source, split, dataset)
    settings = dict(max_len=data.max_len, overlong=data.overlong)
    fingerprint = Hasher.hash(
        [
            dataset._fingerprint,
            dataclasses.asdict(source),
            settings,
            tokenizer_identity(tokenizer),
            TOKENIZE_VERSION,
        ]
    )
    result = dataset.map(
        tokenize_example,
        fn_kwargs=dict(tokenizer=tokenizer, source=source, places=named, **settings),
        with_indices=True,
        remove_columns=dataset.column_names,
        features=FORMATS[source.format].features,
        num_proc=data.num_proc if data.num_proc > 1 else None,
        new_fingerprint=fingerprint,
        desc=f"tokenizing {source.path}",
    )
    statuses = column(result, "status")
    counts = Counter(statuses)
    flagged = Counter({s: n for s, n in counts.items() if s not in KEPT or s in NOTHING_TO_LEARN})
    if log.isEnabledFor(logging.INFO):  # rank 0 (the others log errors only): naming reads the files
        what = described(statuses, counts, named, data)
        log.info(f"data: {source.path} [{split}]: {len(result)} examples, {what}")
    keep = [i for i, status in enumerate(statuses) if status in KEPT]
    if not keep or all(statuses[i] in NOTHING_TO_LEARN for i in keep):
        left = "no example left after filtering" if not keep else "no example with anything to learn"
        raise ConfigError(
            f"{source.where}: {left} ({dict(counts)}); check data.format, the keys, data.max_len and "
            "data.overlong"
        )
    examples = result.select(keep, keep_in_memory=True) if len(keep) < len(result) else result
    return examples, flagged


def described(statuses: list[str], counts: Counter, named: Places, data: DataConfig) -> str:
    """What tokenizing did to a source's examples: truncated, dropped and kept with nothing to learn,
    each kind counted and its first NAMED examples named (FILE:LINE)."""

    def kinds(selected: list[str]) -> str:
        parts = []
        for status in selected:
            first = [named(i) for i, s in enumerate(statuses) if s == status][:NAMED]
            more = ", ..." if counts[status] > NAMED else ""
            parts.append(f"{counts[status]} {status} ({', '.join(first)}{more})")
        return ", ".join(parts)

    dropped = sorted(status for status in counts if status not in KEPT)
    text = f"{counts[TRUNCATED]} truncated to data.max_len={data.max_len}, dropped {kinds(dropped) or 'none'}"
    nothing = sorted(status for status in counts if status in NOTHING_TO_LEARN)
    if nothing:
        text += f"; kept with nothing to learn (as TRL keeps them): {kinds(nothing)}"
    return text


def tokenizer_identity(tokenizer: PreTrainedTokenizerBase) -> list[Any]:
    """What the tokenized result depends on: vocabulary and rules, template, special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return [
        backend.to_str() if backend is not None else tokenizer.get_vocab(),
        tokenizer.chat_template,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
    ]


def hold_out(
    examples: datasets.Dataset, fraction: float, seed: int, source: Source
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """A seeded fraction of the examples for eval, the rest for training."""
    count = round(fraction * len(examples))
    if not 0 < count < len(examples):
        raise ConfigError(
            f"data.eval_fraction={fraction}: holds out {count} of the {len(examples)} examples of "
            f"{source.path!r}; need at least one for eval and one for training"
        )
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    return (
        examples.select(sorted(order[count:]), keep_in_memory=True),
        examples.select(sorted(order[:count]), keep_in_memory=True),
    )


def mix(parts: list[datasets.Dataset], weights: list[float], seed: int) -> datasets.Dataset:
    """One epoch of the mix: as many examples as all sources together, source i's share
    weight_i / Σ weights (largest remainder); a source smaller than its share repeats, a larger one
    is subsampled, both in a seeded order."""
    if len(parts) == 1:
        return parts[0]
    total = sum(len(part) for part in parts)
    shares = [w / sum(weights) * total for w in weights]
    counts = [int(share) for share in shares]
    by_remainder = sorted(range(len(parts)), key=lambda i: (counts[i] - shares[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    chosen = []
    for i, (part, count) in enumerate(zip(parts, counts, strict=True)):
        order = torch.randperm(len(part), generator=torch.Generator().manual_seed(seed * 1009 + i)).tolist()
        chosen.append(part.select([order[k % len(part)] for k in range(count)], keep_in_memory=True))
    log.info(f"data: mix of {len(parts)} sources, examples per epoch {counts}")
    return datasets.concatenate_datasets(chosen)


def once_per_machine(prepare_fn: Callable[[], T]) -> T:
    """Local rank 0 runs prepare_fn first (so datasets' cache is filled once per machine); the
    other ranks then run it and read the cache. An error on any rank reaches every rank, instead
    of leaving the others waiting in a barrier."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return prepare_fn()
    first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    if not first:
        datasets.disable_progress_bars()
    # Tokenizing a large dataset can outlast parallel.timeout_s: wait on a group of our own. A rank
    # that dies does not leave the others waiting that long: torchrun stops them.
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=PREPARE_TIMEOUT_S))
    result: Any = None
    try:
        for turn in (True, False):
            error: BaseException | None = None
            if first == turn:
                try:
                    result = prepare_fn()
                except Exception as caught:  # shared below, then raised on every rank
                    error = caught
            _raise_if_any(error, group)
    finally:
        dist.destroy_process_group(group)
    return result


def _raise_if_any(error: BaseException | None, group: dist.ProcessGroup) -> None:
    messages: list[Any] = [None] * dist.get_world_size()
    mine = None if error is None else (isinstance(error, ConfigError), str(error))
    dist.all_gather_object(messages, mine, group=group)
    if error is not None:
        raise error
    for rank, message in enumerate(messages):
        if message is not None:
            is_config, text = message
            if is_config:
                raise ConfigError(text)
            raise RuntimeError(f"data preparation failed on rank {rank}: {text}")
