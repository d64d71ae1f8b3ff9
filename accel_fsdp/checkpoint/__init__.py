"""Atomic, checksummed checkpoints (store), and export to a Hugging Face folder (consolidate).

Empty on purpose: importing a subpackage must not import torch (see tests/test_where_users_wait.py)."""
