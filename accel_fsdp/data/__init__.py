"""Rows -> checks -> split -> tokens with loss masks -> packing -> global batches.

Empty on purpose: importing a subpackage must not import torch (see tests/test_where_users_wait.py)."""
