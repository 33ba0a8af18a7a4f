"""Vocabularies that tp does not divide (a Llama-2 vocabulary with one added token: 32,001 at tp=2).

The embedding and `lm_head` get `padded_vocab_size` rows, the least multiple of tp (or the rows a
resumed checkpoint was saved with), so both shard evenly over the vocabulary. `config.vocab_size`
keeps the real size: the padded rows are read as zeros, never indexed by a token, and their logit
columns are set to -inf by a forward hook on `lm_head` before any loss sees them, so the softmax,
the loss, the gradients and the grad norm are the unpadded model's. Export strips them again.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from dtrain.config import ConfigError
from dtrain.distributed import redistribute_in_steps

log = logging.getLogger("dtrain")
EMBEDDING_KEY = "model.model.embed_tokens.weight"  # in a dtrain checkpoint (DCP), under "model."


def padded_vocab_size(vocab_size: int, tp: int, saved: int | None = None) -> int:
    """The embedding / lm_head rows for `tp`: `saved` (a resumed checkpoint's rows) when it fits,
    else `vocab_size` rounded up to a multiple of tp."""
    if saved is not None and saved >= vocab_size:
        if saved % tp:
            raise ConfigError(
                f"the resumed checkpoint (checkpoint.resume) has its vocabulary padded to {saved} rows "
                f"(model vocab_size={vocab_size}), "
                f"which parallel.tp={tp} does not divide: resume with a tp that divides {saved}"
            )
        rows = saved
    else:  # no checkpoint, or one of another model (the checkpoint's shape check names it)
        rows = -(-vocab_size // tp) * tp
    if rows != vocab_size:
        log.info(f"vocab padded from {vocab_size} to {rows} for tp={tp} (padded logits are masked)")
    return rows


def saved_vocab_rows(checkpoint: Path | None) -> int | None:
    """The embedding rows of a dtrain checkpoint (padded or not), from its DCP metadata."""
    if checkpoint is None:
        return None
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    entry = metadata.get(EMBEDDING_KEY)
    size = getattr(entry, "size", None)
    return int(size[0]) if size else None


def pad_vocab(model: nn.Module, rows: int) -> None:
    """Give the meta model's embedding and lm_head `rows` rows (tied: one shared weight), and mask
    the padded logit columns. No-op when rows is the config's vocab_size."""
    vocab_size = model.config.vocab_size
    if rows == vocab_size:
        return
    if rows < vocab_size:
        raise ValueError(f"cannot pad a vocabulary of {vocab_size} to {rows} rows")
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head.bias is not None:  # no supported family has one; padding it would need its own mask
        raise ValueError(f"{type(model).__name__}: lm_head with a bias cannot be vocab-padded")
    hidden = embed.weight.shape[1]
    embed.weight = nn.Parameter(torch.empty(rows, hidden, device=embed.weight.device))
    embed.num_embeddings = rows
    head.weight = (
        embed.weight if model.config.tie_word_embeddings else nn.Parameter(torch.empty_like(embed.weight))
    )
    head.out_features = rows
    # Registered before TP's own output hook, so it sees lm_head's raw DTensor output, sharded over
    # the vocabulary; the chunked loss calls the same module, so every chunk is masked too.
    head.register_forward_hook(lambda module, args, logits: mask_padded_logits(logits, vocab_size))


def mask_padded_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Columns >= vocab_size set to -inf (their softmax and gradient are then exactly zero); a
    vocabulary-sharded DTensor is masked on each rank's own columns."""
    if not isinstance(logits, DTensor):
        columns = torch.arange(logits.shape[-1], device=logits.device)
        return logits.masked_fill(columns >= vocab_size, float("-inf"))
    local, mesh, last = logits.to_local(), logits.device_mesh, logits.ndim - 1
    # The padded vocabulary splits evenly, so this rank's columns start at its index among the
    # mesh dimensions that shard them, times the local width. (Plain ints from the mesh: the
    # planner runs this under FakeTensorMode, where torch's offset helper reads a tensor.)
    index, parts = 0, 1
    for dim, placement in enumerate(logits.placements):
        if placement.is_shard(last):
            index, parts = index * mesh.size(dim) + mesh.get_local_rank(dim), parts * mesh.size(dim)
    if local.shape[-1] * parts != logits.shape[-1]:
        raise RuntimeError(f"padded logits {tuple(logits.shape)} do not split evenly: {logits.placements}")
    columns = torch.arange(local.shape[-1], device=local.device) + index * local.shape[-1]
    local = local.masked_fill(columns >= vocab_size, float("-inf"))
    return DTensor.from_local(
        local,
        logits.device_mesh,
        logits.placements,
        run_check=False,
        shape=logits.shape,
        stride=logits.stride(),
    )


def padded_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """The padded vocabulary matrices by (HF) name, both names of a tied weight; {} when unpadded."""
    if model.get_input_embeddings().weight.shape[0] == model.config.vocab_size:
        return {}
    ids = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    return {name: p for name, p in model.named_parameters(remove_duplicate=False) if id(p) in ids}


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """`tensor` with zero rows appended up to `rows`."""
    return F.pad(tensor, (0, 0, 0, rows - tensor.shape[0]))


def _local_rows(param: torch.Tensor) -> tuple[int, int]:
    """The rows [start, stop) of the full matrix that this rank's shard holds."""
    if not isinstance(param, DTensor):
        return 0, param.shape[0]
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return offset[0], offset[0] + shape[0]


@torch.no_grad()
def load_padded_rows(params: dict[str, torch.Tensor], where: dict[str, Path], vocab_size: int) -> None:
    """Fill each rank's shard of the padded matrices from HF safetensors (`where`: each tensor's file;
    `vocab_size` rows there): only this rank's rows are read; padded rows become zeros."""
    for name, param in params.items():
        file = where.get(name)
        if file is None:
            folder = next(iter(where.values())).parent
            raise ConfigError(f"{folder}: no tensor {name!r} in the safetensors files")
        local = param.to_local() if isinstance(param, DTensor) else param
        start, stop = _local_rows(param)
        local.zero_()
        with safe_open(file, "pt") as reader:
            rows = reader.get_slice(name)
            if rows.get_shape()[0] != vocab_size:
                raise ConfigError(
                    f"{file}: {name} has {rows.get_shape()[0]} rows, config vocab_size={vocab_size}"
                )
            if start < vocab_size:
                real = rows[start : min(stop, vocab_size)]
                local[: real.shape[0]].copy_(real)


def strip_padding(tensor: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The first vocab_size rows of a padded matrix, for export. A DTensor stays sharded over the
    mesh dimension whose even split matches torch's uneven one for vocab_size rows (tp's, in a
    training run); without one (an export on another world size) it is gathered whole."""
    if not isinstance(tensor, DTensor):
        return tensor[:vocab_size]
    mesh, rows = tensor.device_mesh, tensor.shape[0]
    placements: list = [Replicate()] * mesh.ndim
    # torch shards vocab_size rows over n ranks in chunks of ceil(vocab_size / n): the same rows as
    # the padded matrix's even chunks when these are that size.
    fits = [
        d
        for d in range(mesh.ndim)
        if rows % mesh.size(d) == 0 and rows // mesh.size(d) == -(-vocab_size // mesh.size(d))
    ]
    dim = max(fits, key=lambda d: (mesh.size(d), d)) if fits else None  # the innermost (tp) on a tie
    if dim is not None:
        placements[dim] = Shard(0)
    local = redistribute_in_steps(tensor, placements).to_local()
    if dim is None:
        local = local[:vocab_size]
    else:
        chunk = rows // mesh.size(dim)
        start = mesh.get_local_rank(dim) * chunk
        local = local[: max(0, min(chunk, vocab_size - start))]
    shape = (vocab_size, *tensor.shape[1:])
    return DTensor.from_local(
        local.contiguous(),
        mesh,
        placements,
        run_check=False,
        shape=shape,
        stride=torch.empty(shape, device="meta").stride(),
    )
