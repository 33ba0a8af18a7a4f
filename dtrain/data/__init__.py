"""SFT data, one stage per module: `sources` (datasets: hub, files, folders, mix), `formats`
(chat template, supervision masks, lengths), `packing` (rows, labels, positions), `loader` (the
global seeded stream on StatefulDataLoader), `pipeline` (the stages in order, once per machine)."""

from dtrain.data.formats import load_tokenizer, pad_id
from dtrain.data.loader import Rows, SFTLoader, eval_micro_batches
from dtrain.data.packing import build_row, pack
from dtrain.data.pipeline import SFTData, build_data, prepare, to_rows

__all__ = [
    "Rows",
    "SFTData",
    "SFTLoader",
    "build_data",
    "build_row",
    "eval_micro_batches",
    "load_tokenizer",
    "pack",
    "pad_id",
    "prepare",
    "to_rows",
]
