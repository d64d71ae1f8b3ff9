"""The commands around training: bench, baseline, report, generate, verify.

Empty on purpose: importing a subpackage must not import torch (see tests/test_where_users_wait.py)."""
