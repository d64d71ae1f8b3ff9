"""Starting ranks: through Accelerate's launcher on one machine, through sbatch under SLURM.

Empty on purpose: importing a subpackage must not import torch (see tests/test_where_users_wait.py)."""
