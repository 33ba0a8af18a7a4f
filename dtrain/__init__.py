"""dtrain: supervised fine-tuning of Hugging Face causal LMs with TP and FSDP2 on one DeviceMesh."""
