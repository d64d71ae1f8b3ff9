"""Recipe -> typed, checked Recipe; accelerate config -> FSDP settings, each with its source.

Empty on purpose: importing a subpackage must not import torch (see tests/test_where_users_wait.py)."""
