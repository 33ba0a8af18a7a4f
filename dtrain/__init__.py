"""dtrain: post-training of Hugging Face causal LMs (SFT, DPO, GRPO, distillation) with TP and FSDP2 on
one DeviceMesh."""

import logging

# transformers' scheduler module imports peft, which imports bitsandbytes wherever it is installed
# (QLoRA's tests compare with it): on CPUs with AVX512-BF16 its import warns, on every rank, that an
# optional CPU matmul kernel of its own could not be fetched from the hub. dtrain never calls it.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
