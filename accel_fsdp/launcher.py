"""The CLI launching itself through Accelerate's own launcher (`accelerate launch`), never a home-made one.

`accel-fsdp recipe run X --accelerate-config C` outside a distributed launch becomes, in effect,
`accelerate launch --config_file C -m accel_fsdp recipe run X ...`: the same command line runs in every rank,
where `inside_launch()` is true and training starts. The config's path travels in ACCEL_FSDP_ACCELERATE_CONFIG
so the ranks read the same file and name it in their messages.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

from accel_fsdp.launch_config import CONFIG_PATH_ENV, AccelerateConfig


def inside_launch() -> bool:
    """True inside a rank started by torchrun / accelerate launch (or SLURM's srun with torchrun)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(config: AccelerateConfig, argv: list[str], *, num_processes: int | None = None) -> int:
    """Run `python -m accel_fsdp <argv>` in every rank the config asks for; return the exit status."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    args = ["--config_file", str(config.path)]
    if num_processes is not None:
        args += ["--num_processes", str(num_processes)]
    if int(config.get("num_machines", 1) or 1) == 1 and not config.get("main_process_port"):
        args += ["--main_process_port", "0"]  # a free port: two runs on one machine must not collide
    if config.get("use_cpu") and not os.environ.get("OMP_NUM_THREADS"):
        # One thread per rank unless told otherwise: CPU ranks share the cores.
        args += ["--num_cpu_threads_per_process", str(max(1, (os.cpu_count() or 1) // int(config.get("num_processes", 1) or 1)))]
    args += ["-m", "accel_fsdp", *argv]
    parsed = launch_command_parser().parse_args(args)
    os.environ[CONFIG_PATH_ENV] = str(config.path.resolve())
    # torchrun's agent logs every child failure with a banner; our ranks already said what went wrong.
    for name in ("torch.distributed.elastic", "torch.distributed.run", "accelerate"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        launch_command(parsed)
    except subprocess.CalledProcessError as e:  # the single-process launcher
        return _status(e.returncode)
    except Exception as e:  # torchrun's ChildFailedError
        failures = getattr(e, "failures", None)
        if not failures:
            raise
        codes = [f.exitcode for f in failures.values()]
        if 2 in codes:
            return 2  # a user error, already explained by rank 0
        for rank, f in sorted(failures.items()):
            if f.exitcode < 0:
                print(f"error: rank {rank} was killed by {signal.Signals(-f.exitcode).name}", file=sys.stderr)
            else:
                print(f"error: rank {rank} exited with status {f.exitcode} (see its output above)", file=sys.stderr)
        return 1
    return 0


def _status(code: int) -> int:
    return 2 if code == 2 else (1 if code else 0)
