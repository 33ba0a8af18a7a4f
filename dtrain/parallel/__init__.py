"""Tensor parallel plans per model family and the one function that applies TP, AC and FSDP."""
