"""Memory and FLOP formulas, FSDP unit discovery, dry run and estimate: answers before any training.

Empty on purpose: importing a subpackage must not import torch (see tests/test_where_users_wait.py)."""
