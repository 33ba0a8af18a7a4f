"""Where examples come from: a hub dataset id, a local file or folder, one split, the first
max_samples (one `Source`, resolved by `DataConfig.sources()`), and how errors and logs name one of
its examples (`Places`: FILE:LINE). Everything loads through Hugging Face `datasets`."""

from __future__ import annotations

import csv
import functools
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import datasets

from dtrain.config import ConfigError, Source
from dtrain.data.formats import FORMATS

# datasets' packaged builder for each local file suffix.
BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


def load_split(source: Source, split: str) -> datasets.Dataset:
    """The split of the source, cut to max_samples, with the columns its format needs checked."""
    path = os.path.expanduser(source.path)
    where = source.where
    try:
        dataset = _load(path, split, where)
    except ConfigError:
        raise
    except ValueError as error:  # datasets' "Unknown split" and friends; a byte that is not UTF-8
        raise ConfigError(first_malformed_json_line(path) or f"{where} split {split!r}: {error}") from error
    if source.max_samples is not None:
        dataset = dataset.select(range(min(source.max_samples, len(dataset))))
    if len(dataset) == 0:
        raise ConfigError(f"{where} split {split!r}: the dataset is empty")
    for key, column in FORMATS[source.format].columns(source).items():
        if column not in dataset.column_names:
            named = f"{source.key(key)}, " if hasattr(source, key) else ""  # else a column the format fixes
            raise ConfigError(
                f"{where}: missing key {column!r} ({named}{source.key('format')}={source.format}); "
                f"the dataset has columns {dataset.column_names}"
            )
    return dataset


def _load(path: str, split: str, where: str) -> datasets.Dataset:
    if os.path.isfile(path):
        suffix = Path(path).suffix
        if suffix not in BUILDERS:
            raise ConfigError(f"{where}: unknown file type {suffix!r}; use one of {sorted(BUILDERS)}")
        if is_blank(path):  # datasets' json builder fails on these with a bare StopIteration
            raise ConfigError(f"{where}: the file is empty")
        return _load_files(BUILDERS[suffix], path, split, where)
    if os.path.isdir(path):
        if (Path(path) / "state.json").is_file() or (Path(path) / "dataset_dict.json").is_file():
            saved = datasets.load_from_disk(path)  # a save_to_disk folder
            return saved[split] if isinstance(saved, datasets.DatasetDict) else saved
        return _load_files(path, None, split, where)
    try:  # a hub id; datasets handles the download and its cache
        return datasets.load_dataset(path, split=split)
    except ValueError:
        raise
    except Exception as error:  # the hub's errors are many; the user needs the id and the cause
        raise ConfigError(
            f"{where}: not a local file or folder, and loading it from the hub failed: {error}"
        ) from error


def _load_files(builder: str, data_files: str | None, split: str, where: str) -> datasets.Dataset:
    """A packaged builder on files, or (data_files None) a folder whose builder datasets infers.
    datasets' own error log is muted: the ConfigError below says what it would, with the line."""
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        if data_files is None:
            return datasets.load_dataset(builder, split=split)
        return datasets.load_dataset(builder, data_files=data_files, split=split)
    except FileNotFoundError as error:  # a folder without data files, among others
        raise ConfigError(f"{where}: {error}") from error
    except datasets.exceptions.DatasetGenerationError as error:
        bad = first_malformed_json_line(data_files or builder)
        if bad:
            raise ConfigError(bad) from error
        raise ConfigError(f"{where}: cannot be read: {error.__cause__ or error}") from error
    finally:
        logger.setLevel(level)


def is_blank(path: str) -> bool:
    with open(path, "rb") as file:
        while chunk := file.read(1 << 16):
            if chunk.strip():
                return False
    return True


def first_malformed_json_line(path: str) -> str | None:
    """`file:line: why` for the first line of a JSON-lines file that does not parse (arrow's own
    error counts rows within a block, not lines in the file)."""
    files = sorted(Path(path).rglob("*.json*")) if os.path.isdir(path) else [Path(path)]
    for file in files:
        if file.suffix not in (".json", ".jsonl") or not file.is_file():
            continue
        with file.open("rb") as lines:
            if lines.read(1) == b"[":  # one JSON document, not lines
                continue
            lines.seek(0)
            for number, raw in enumerate(lines, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    byte = f"0x{raw[error.start]:02x}"
                    return f"{file}:{number}: not UTF-8 (byte {byte}, column {error.start + 1})"
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    why = error.msg.removesuffix(" at")  # "Invalid control character at": the column follows
                    return f"{file}:{number}: malformed JSON ({why}, column {error.colno})"
                if not isinstance(record, dict):
                    return f"{file}:{number}: expected a JSON object, got {type(record).__name__}"
    return None


# Local files whose examples are lines (or CSV records) of the file: the builders datasets reads them with.
LINE_BUILDERS = ("json", "csv")


@dataclass(frozen=True)
class Places:
    """How a source's examples are named in errors and logs: `FILE:LINE` where the example is a line of
    a local JSON-lines file (a record of a CSV file: the line it starts on), as malformed JSON is
    named; else `PATH [SPLIT] example INDEX`, INDEX datasets' index of the example in that split (a
    hub dataset, Parquet, Arrow, a JSON array, a `save_to_disk` folder). Each file's lines are read
    only when an example is named."""

    label: str  # `PATH [SPLIT] example`
    files: tuple[str, ...] = ()  # the split's line-based files, in the order datasets reads them
    rows: tuple[tuple[int, int], ...] = ()  # the split's slices of their records: (start, stop)

    def __call__(self, index: int) -> str:
        located = self.line(index)
        return f"{located[0]}:{located[1]}" if located else f"{self.label} {index}"

    def line(self, index: int) -> tuple[str, int] | None:
        """(file, line) of example `index` of the split, or None."""
        for start, stop in self.rows:
            if index < stop - start:
                row = start + index
                break
            index -= stop - start
        else:
            return None
        for file in self.files:
            lines = record_lines(file, os.stat(file).st_mtime_ns)
            if row < len(lines):
                return file, lines[row]
            row -= len(lines)
        return None


def places(source: Source, split: str, dataset: datasets.Dataset) -> Places:
    """How `dataset` (load_split's, of `source` and `split`) names its examples (Places)."""
    path = os.path.expanduser(source.path)
    label = Places(f"{source.path} [{split}] example")
    name = split.split("[", 1)[0]
    try:
        total = dataset.info.splits[name].num_examples
    except (AttributeError, KeyError, TypeError):
        return label
    if os.path.isfile(path):
        files = [path] if BUILDERS.get(Path(path).suffix) in LINE_BUILDERS else []
    elif os.path.isdir(path) and not (Path(path) / "state.json").is_file():
        try:
            files = [str(file) for file in datasets.load_dataset_builder(path).config.data_files[name]]
        except Exception:  # what datasets cannot say, names by index
            return label
        if any(BUILDERS.get(Path(file).suffix) not in LINE_BUILDERS for file in files):
            return label
    else:
        return label
    if not files or any(Path(file).suffix in (".json", ".jsonl") and is_json_array(file) for file in files):
        return label
    instructions = datasets.ReadInstruction.from_spec(split).to_absolute({name: total})
    return Places(label.label, tuple(files), tuple((part.from_, part.to) for part in instructions))


def is_json_array(path: str) -> bool:
    """Whether a .json file is one JSON document (an array), not JSON lines."""
    with open(path, "rb") as file:
        return file.read(1 << 10).lstrip()[:1] == b"["


@functools.lru_cache(maxsize=16)
def record_lines(path: str, modified: int) -> list[int]:
    """The line (from 1) each example of a local file starts on, in datasets' order: a JSON-lines
    file's non-blank lines, a CSV file's records after its header (blank lines skipped, a quoted field
    may span lines). `modified` keys the cache to the file's version."""
    if Path(path).suffix == ".csv":
        starts, end = [], 0
        with open(path, newline="", encoding="utf-8", errors="replace") as file:
            reader = csv.reader(file)
            for row in reader:
                start, end = end + 1, reader.line_num
                if row and not (len(row) == 1 and not row[0].strip()):  # pandas skips blank lines
                    starts.append(start)
        return starts[1:]  # the header is not an example
    with open(path, "rb") as file:
        return [number for number, line in enumerate(file, start=1) if line.strip()]
