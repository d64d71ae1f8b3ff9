"""The accelerator, the setup, the loop, and what a run observes (metrics, traces, faults, lifetime).

Empty on purpose: importing a subpackage must not import torch (see tests/test_where_users_wait.py)."""
