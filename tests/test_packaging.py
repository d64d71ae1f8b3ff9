"""A plain (non-editable) wheel install finds the shipped recipes and accelerate configs by name."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest
from conftest import REPO

from accel_fsdp.config.shipped import shipped_accelerate_configs, shipped_recipes


@pytest.mark.multiprocess
def test_wheel_ships_recipes_and_configs(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path), str(REPO)],
                   check=True, capture_output=True, timeout=600)
    (wheel,) = tmp_path.glob("accel_fsdp-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in shipped_recipes():
        assert f"accel_fsdp/recipes/{name}.yaml" in names, name
    for name in shipped_accelerate_configs():
        assert f"accel_fsdp/accelerate_configs/{name}.yaml" in names, name
    # Installed elsewhere, the package finds them next to itself.
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    out = subprocess.run([sys.executable, "-c", "from accel_fsdp.config.shipped import recipes_dir, resolve_recipe, "
                          "resolve_accelerate_config; print(recipes_dir()); print(resolve_recipe('gpt2-xl')); "
                          "print(resolve_accelerate_config('accelerate_configs/fsdp_2gpu.yaml'))"],
                         cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": ""}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == str(target / "accel_fsdp" / "recipes")
    assert lines[1].startswith(str(target)) and lines[2].startswith(str(target))
