"""Write a Hugging Face model folder from the sharded model or from a dtrain checkpoint.

Every rank writes its own shards with DCP's Hugging Face writer, then rank 0 consolidates them
into standard safetensors: nobody gathers the whole model in memory. A LoRA run exports a PEFT
adapter folder (`adapter_config.json`, `adapter_model.safetensors` under PEFT's names, fp32) that
`peft.PeftModel.from_pretrained(base, OUT)` loads, or with --merged the base with the adapters merged.

    python -m dtrain.export CHECKPOINT OUT [--dtype bf16|fp32] [--merged]
    torchrun --nproc_per_node=N -m dtrain.export CHECKPOINT OUT
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from transformers import PreTrainedTokenizerBase

from dtrain.checkpoint import COMPLETE, is_complete, saved_config
from dtrain.config import Config, ConfigError, MeshShape
from dtrain.distributed import build_parallel, init_distributed, shutdown
from dtrain.model import (
    allocate,
    build_model,
    hf_state_dict,
    load_model_config,
    materialize,
    save_config,
    tokenizer_source,
)
from dtrain.parallel import fused, lora, vocab

log = logging.getLogger("dtrain")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def export_hf(model: nn.Module, tokenizer: PreTrainedTokenizerBase, out: Path, dtype: str) -> None:
    """Collective: every rank calls it. The folder appears complete or not at all. A model with LoRA
    adapters writes its PEFT adapter folder instead of the model."""
    if lora.adapter_modules(model):
        export_adapter(model, tokenizer, out)
    else:
        write_model(model, hf_state_dict(model), tokenizer, out, dtype)


def export_merged(model: nn.Module, tokenizer: PreTrainedTokenizerBase, out: Path, dtype: str) -> None:
    """Collective. The HF model with each LoRA adapter merged into its base weight (W + scaling B A)."""
    if not lora.adapter_modules(model):
        raise ConfigError("checkpoint.export_merged: the model has no LoRA adapters (lora.r=0)")
    write_model(model, hf_state_dict(model) | lora.merged_weights(model), tokenizer, out, dtype)


def export_adapter(model: nn.Module, tokenizer: PreTrainedTokenizerBase, out: Path) -> None:
    """Collective. The adapters gathered whole (they are small) and written by rank 0 as PEFT does."""
    from safetensors.torch import save_file

    tensors = lora.peft_tensors(model)
    if dist.get_rank() == 0:
        partial = out.with_name(out.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        save_file(tensors, str(partial / lora.ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config = lora.peft_config(
            getattr(model, lora.SETTINGS_ATTR), model, model.config._name_or_path or None
        )
        (partial / lora.ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        tokenizer.save_pretrained(partial)
        publish(partial, out)
        log.info(f"exported a PEFT LoRA adapter to {out}")
    dist.barrier()


def write_model(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    tokenizer: PreTrainedTokenizerBase,
    out: Path,
    dtype: str,
) -> None:
    """Collective: the HF folder of `state` (hf_state_dict's names, sharded as the model)."""
    partial = out.with_name(out.name + ".partial")
    if dist.get_rank() == 0 and partial.exists():
        shutil.rmtree(partial)
    dist.barrier()
    state = {name: tensor.detach().to(DTYPES[dtype]) for name, tensor in state.items()}
    # Back to config.vocab_size rows; in the model's order on every rank (collectives), not a set's.
    for name in [name for name in vocab.padded_params(model) if name in state]:
        state[name] = vocab.strip_padding(state[name], model.config.vocab_size)
    state = fused.fuse(model, state)  # split projections back into HF's fused tensors (Phi-3)
    writer = HuggingFaceStorageWriter(str(partial), save_distributed=True, enable_consolidation=True)
    dcp.save(state, storage_writer=writer)
    if dist.get_rank() == 0:
        shutil.rmtree(partial / "sharded", ignore_errors=True)
        save_config(model.config, partial, DTYPES[dtype])
        tokenizer.save_pretrained(partial)
        publish(partial, out)
        log.info(f"exported a Hugging Face model to {out} ({dtype})")
    dist.barrier()


def publish(partial: Path, out: Path) -> None:
    """Replace `out` with the finished `partial` folder (rank 0): the folder appears whole or not at all."""
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)


def export_checkpoint(checkpoint: Path, out: Path, dtype: str, merged: bool = False) -> None:
    """Rebuild the model of a checkpoint as plain FSDP over this world and export it. A LoRA
    checkpoint holds the adapters only: the base comes from model.name_or_path as in training."""
    from dtrain.data.formats import load_tokenizer

    if not is_complete(checkpoint):
        raise ConfigError(f"{checkpoint}: not a complete dtrain checkpoint (no {COMPLETE})")
    resolved = saved_config(checkpoint)
    config: Config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), resolved))
    model_config = load_model_config(config.model)
    device = init_distributed(config.parallel.timeout_s)
    world = dist.get_world_size()
    parallel = build_parallel(MeshShape(1, world, 1, 1), device)
    config.parallel.tp, config.parallel.dp_shard = 1, world
    if config.lora.base_dtype != "nf4":  # QLoRA: the NF4 base the run trained on, quantized alike
        config.train.precision, config.lora.base_dtype = "fp32", "fp32"
    model = build_model(
        model_config, config, parallel, None, vocab.saved_vocab_rows(checkpoint)
    )  # padded as saved
    if lora.enabled(config.lora):  # the base as the run had it, then the trained adapters
        materialize(model, device, config.model, config.train.seed, lora.resolve(config.lora))
        saved = lora.adapter_parameters(model)
    else:
        allocate(model, device)  # every weight comes from the checkpoint
        saved = hf_state_dict(model)
    dcp.load({f"model.{name}": tensor for name, tensor in saved.items()}, checkpoint_id=str(checkpoint))
    tokenizer = load_tokenizer(tokenizer_source(config.model))
    if merged:
        export_merged(model, tokenizer, out, dtype)
    else:
        export_hf(model, tokenizer, out, dtype)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m dtrain.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoint folder (…/checkpoints/step-XXXXXXXX)")
    parser.add_argument("out", type=Path, help="the Hugging Face folder to write")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--merged", action="store_true", help="LoRA: the base with the adapters merged in")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="[dtrain] %(message)s")
    try:
        export_checkpoint(args.checkpoint, args.out, args.dtype, args.merged)
    except ConfigError as error:
        print(f"dtrain: error: {error}", file=sys.stderr)
        sys.exit(2)
    finally:
        shutdown()


if __name__ == "__main__":
    main()
