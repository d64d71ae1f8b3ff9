"""`python -m accel_fsdp` (what `accelerate launch -m accel_fsdp ...` runs in every rank)."""

from accel_fsdp.cli import main

main()
