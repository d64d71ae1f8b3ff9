"""What the model is (facts, from config arithmetic), and building it:
config, meta-device checks, weights, LoRA, tokenizer.

Empty on purpose: importing a subpackage must not import torch (see tests/test_where_users_wait.py)."""
