"""An accelerate config's use_cpu is read one way by every reader (AccelerateConfig.uses_cpu, as the ranks' settings
read it): the SLURM script took only the text "true" for CPU ranks (use_cpu: 1 wrote a GPU job, --gres and all,
for ranks that train on CPUs), and the launcher took any value Python finds true (use_cpu: "false" gave a GPU job
the CPU ranks' one thread each). The config check accepts both values as true or false (config/accelerate.py
`as_bool`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import run_in_process

from accel_fsdp.config.shipped import resolve_accelerate_config

CONFIGS = {"1": ("fsdp_cpu", True), '"false"': ("fsdp_2gpu", False)}
"""The value written -> (the shipped config it is written into, whether the ranks run on CPUs)."""


def config_with_use_cpu(tmp_path: Path, value: str) -> Path:
    shipped, _ = CONFIGS[value]
    text = resolve_accelerate_config(shipped).read_text()
    text, replaced = re.subn(r"(?m)^use_cpu: \w+", f"use_cpu: {value}", text)
    if not replaced:
        text += f"\nuse_cpu: {value}\n"
    path = tmp_path / f"{shipped}-use-cpu.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("value", sorted(CONFIGS))
def test_every_reader_takes_use_cpu_as_the_ranks_do(tmp_path, monkeypatch, value):
    from accel_fsdp.config.accelerate import load_accelerate_config
    from accel_fsdp.hardware import OMP_THREADS_ENV
    from accel_fsdp.launch.launcher import _environment_args

    # The launcher gives CPU ranks a thread count unless OMP_NUM_THREADS says one (a test before this one in the same
    # process may have set it: the CLI settles it for libgomp)
    monkeypatch.delenv(OMP_THREADS_ENV, raising=False)
    cpu = CONFIGS[value][1]
    config = load_accelerate_config(config_with_use_cpu(tmp_path, value))
    assert config.uses_cpu() is cpu
    assert ("--num_cpu_threads_per_process" in _environment_args(config, 2)) is cpu

    script = tmp_path / "job.sbatch"
    ranks = "CPU ranks" if cpu else "GPUs"
    out = run_in_process("slurm", "quickstart", "--nodes", "2", "--gpus-per-node", "2", "--accelerate-config",
                         config.path, "--output-dir", tmp_path / "run", "-o", script, check=0).stdout
    assert f"2 node(s) x 2 {ranks}" in out, out
    assert ("#SBATCH --gres=gpu:2" in script.read_text()) is not cpu
