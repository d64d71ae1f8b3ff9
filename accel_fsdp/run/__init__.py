"""The run folder: every path of a run, its owner, the new/resume/overwrite decision, the live-run lock.

Empty on purpose: importing a subpackage must not import torch (see tests/test_where_users_wait.py)."""
