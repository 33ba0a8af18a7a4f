"""`python -m dtrain.bench`: dtrain's step against a plain loop and the Hugging Face Trainer (__main__.py)."""
