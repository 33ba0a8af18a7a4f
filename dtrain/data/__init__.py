"""SFT data, one stage per module: `formats` (the FORMATS registry: chat template, supervision masks),
`sources` (datasets: hub, files, folders), `packing` (rows, labels, positions), `loader` (the global
seeded stream on StatefulDataLoader), `pipeline` (the stages in order, once per machine).

The names below load their module on first use, so that the config check's look-up of
`dtrain.data.formats.FORMATS` does not wait on `datasets` and torchdata."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "formats": ("load_tokenizer", "pad_id"),
    "loader": ("Rows", "SFTLoader", "eval_micro_batches"),
    "packing": ("build_row", "pack"),
    "pipeline": ("SFTData", "build_data", "prepare", "to_rows"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"dtrain.data.{_MODULE_OF[name]}"), name)
