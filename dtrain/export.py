"""Write a Hugging Face model folder from the sharded model or from a dtrain checkpoint.

Every rank writes its own shards with DCP's Hugging Face writer, then rank 0 consolidates them
into standard safetensors: nobody gathers the whole model in memory.

    python -m dtrain.export CHECKPOINT OUT [--dtype bf16|fp32]
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
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, GenerationConfig, PreTrainedTokenizerBase

from dtrain.attention import ATTENTION, CONFIG_KEYS
from dtrain.checkpoint import COMPLETE, is_complete, saved_config
from dtrain.config import Config, ConfigError, MeshShape
from dtrain.distributed import build_parallel, init_distributed, shutdown
from dtrain.model import allocate, build_model, hf_state_dict, load_model_config, tokenizer_source
from dtrain.parallel import fused, vocab

log = logging.getLogger("dtrain")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def export_hf(model: nn.Module, tokenizer: PreTrainedTokenizerBase, out: Path, dtype: str) -> None:
    """Collective: every rank calls it. The folder appears complete or not at all."""
    partial = out.with_name(out.name + ".partial")
    if dist.get_rank() == 0 and partial.exists():
        shutil.rmtree(partial)
    dist.barrier()
    state = {name: tensor.detach().to(DTYPES[dtype]) for name, tensor in hf_state_dict(model).items()}
    # Back to config.vocab_size rows; in the model's order on every rank (collectives), not a set's.
    for name in [name for name in vocab.padded_params(model) if name in state]:
        state[name] = vocab.strip_padding(state[name], model.config.vocab_size)
    state = fused.fuse(model, state)  # split projections back into HF's fused tensors (Phi-3)
    writer = HuggingFaceStorageWriter(str(partial), save_distributed=True, enable_consolidation=True)
    dcp.save(state, storage_writer=writer)
    if dist.get_rank() == 0:
        shutil.rmtree(partial / "sharded", ignore_errors=True)
        config = model.config.__class__.from_dict(model.config.to_dict())
        config.use_cache = True  # dtrain turns the KV cache off for training only
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__name__]
        config.dtype = DTYPES[dtype]
        config.save_pretrained(partial)
        _drop_attention_override(partial / "config.json")
        _generation_config(model).save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        if out.exists():
            shutil.rmtree(out)
        partial.rename(out)
        log.info(f"exported a Hugging Face model to {out} ({dtype})")
    dist.barrier()


def _drop_attention_override(config_json: Path) -> None:
    """dtrain's attention and its settings exist only inside dtrain: exported models use the defaults."""
    config = json.loads(config_json.read_text())
    for key in CONFIG_KEYS:
        config.pop(key, None)
    if config.get("_attn_implementation") == ATTENTION or config.get("attn_implementation") == ATTENTION:
        config.pop("_attn_implementation", None)
        config.pop("attn_implementation", None)
    config_json.write_text(json.dumps(config, indent=2) + "\n")


def _generation_config(model: nn.Module) -> GenerationConfig:
    try:
        return GenerationConfig.from_model_config(model.config)
    except Exception:  # a config without generation fields still exports
        return GenerationConfig()


def export_checkpoint(checkpoint: Path, out: Path, dtype: str) -> None:
    """Rebuild the model of a checkpoint as plain FSDP over this world and export it."""
    from dtrain.data.formats import load_tokenizer

    if not is_complete(checkpoint):
        raise ConfigError(f"{checkpoint}: not a complete dtrain checkpoint (no {COMPLETE})")
    resolved = saved_config(checkpoint)
    config: Config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), resolved))
    model_config = load_model_config(config.model)
    device = init_distributed(config.parallel.timeout_s)
    world = dist.get_world_size()
    parallel = build_parallel(MeshShape(1, world, 1, 1), device)
    config.parallel.tp, config.parallel.dp_shard, config.train.precision = 1, world, "fp32"
    model = build_model(
        model_config, config, parallel, None, vocab.saved_vocab_rows(checkpoint)
    )  # padded as saved
    allocate(model, device)  # every weight comes from the checkpoint
    state = {f"model.{name}": tensor for name, tensor in hf_state_dict(model).items()}
    dcp.load(state, checkpoint_id=str(checkpoint))
    tokenizer = load_tokenizer(tokenizer_source(config.model))
    export_hf(model, tokenizer, out, dtype)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m dtrain.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoint folder (…/checkpoints/step-XXXXXXXX)")
    parser.add_argument("out", type=Path, help="the Hugging Face folder to write")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="[dtrain] %(message)s")
    try:
        export_checkpoint(args.checkpoint, args.out, args.dtype)
    except ConfigError as error:
        print(f"dtrain: error: {error}", file=sys.stderr)
        sys.exit(2)
    finally:
        shutdown()


if __name__ == "__main__":
    main()
