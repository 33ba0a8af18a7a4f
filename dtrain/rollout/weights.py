"""The policy's weights as a generator loads them: under Hugging Face's names, whole, one parameter at
a time, from the sharded training model (a collective: every rank runs the same gathers in the same
order, and each rank gets every tensor).

Each of `hf_state_dict`'s parameters (the names an HF model's state dict has, the tied `lm_head`
left out as HF's files leave it) is gathered whole with `full_tensor()` (FSDP2 over dp, tensor
parallel over tp, experts over the ep mesh), then:
- a LoRA-adapted weight is merged with its adapter, PEFT's `merge_and_unload` (`lora.merge` on the
  whole matrices: W + (B @ A) · scaling, in fp32); an NF4 base (QLoRA) is dequantized first;
- a vocabulary padded for tp (dtrain/parallel/vocab.py) loses its padding rows;
- the parts of a fused projection split at build time (Phi-3's qkv_proj, dtrain/parallel/fused.py)
  are held until the last one arrives, and go out as HF's fused tensor;
- it is cast to the generator's dtype and handed over; the caller copies it before asking for the
  next, and it is freed then.
At most one HF parameter (a fused one's parts, a merged weight's adapter) exists whole at a time, so
the sync never holds a second model: the generator's own copy (hf) or vLLM's (vllm) is the only one.

`export.write_model` writes the same tensors (hf_state_dict, lora.merge, vocab.strip_padding,
fused's groups) without gathering them: DCP writes each rank's shards.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from dtrain.distributed import gather_whole
from dtrain.model import hf_state_dict
from dtrain.parallel import fused, lora, qlora, vocab


def whole(param: torch.Tensor) -> torch.Tensor:
    """A parameter's full tensor (a collective for a DTensor); an NF4 base dequantized to fp32 first."""
    if qlora.is_nf4(param):
        param = qlora.dequantized(param, torch.float32)
    return gather_whole(param)  # an axis at a time: full_tensor() warns on FSDP-after-tp placements


@torch.no_grad()
def hf_weights(model: nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective. (HF name, whole tensor in `dtype`) of each of the model's weights, in the model's
    order (the module docstring says how each is made): the optimizer's sharded parameters (FSDP's
    state_dict swaps a root still gathered after a forward back to them). A yielded tensor may share
    storage with the parameter: copy it, and do not keep it past the next one."""
    adapted = lora.adapter_modules(model)
    padded = set(vocab.padded_params(model))
    fused_groups = fused.groups(model)
    part_of = {part: name for name, parts in fused_groups.items() for part in parts}
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in hf_state_dict(model).items():
        module = adapted.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
        if module is not None:
            a, b = whole(module.lora_A.weight), whole(module.lora_B.weight)
            tensor = lora.merge(whole(param), a, b, module.scaling)
            del a, b
        else:
            tensor = whole(param)
        if name in padded:
            tensor = vocab.strip_padding(tensor, model.config.vocab_size)
        tensor = tensor.detach().to(dtype)
        if name not in part_of:
            yield name, tensor
            del tensor
            continue
        parts = held.setdefault(part_of[name], {})
        parts[name] = tensor
        del tensor
        if len(parts) == len(fused_groups[part_of[name]]):
            fused_name = part_of[name]
            joined = torch.cat([parts[part] for part in fused_groups[fused_name]])
            del held[fused_name], parts
            yield fused_name, joined
            del joined
    if held:  # a part hf_state_dict does not name: a split module without all of its parts
        raise RuntimeError(f"fused projections with missing parts: {sorted(held)}")
