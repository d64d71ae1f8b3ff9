"""Under a locale whose encoding is not UTF-8 (LANG=C with PYTHONUTF8=0, a Latin-1 locale), recipes, paths and data
in UTF-8 still work: the program starts itself again in Python's UTF-8 mode (cli/main.py, reexec_in_utf8_mode)."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO, run_cli


def test_a_unicode_recipe_at_a_unicode_path_validates_under_an_ascii_locale(tmp_path):
    folder = tmp_path / "données ü"
    folder.mkdir()
    recipe = folder / "récipe.yaml"
    text = (REPO / "recipes" / "quickstart.yaml").read_text(encoding="utf-8")
    recipe.write_text("# Geschichten für café — 日本\n" + text, encoding="utf-8")
    result = run_cli("recipe", "validate", recipe, env={"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0"}, check=0)
    assert f"ok: {recipe}" in result.stdout


def test_a_python_told_not_to_use_utf8_mode_is_started_again_once_not_for_ever():
    """`python -X utf8=0` wins over PYTHONUTF8=1: the program starts itself again once, then goes on as it is."""
    result = subprocess.run([sys.executable, "-X", "utf8=0", "-m", "accel_fsdp", "--version"], cwd=REPO, timeout=60,
                            capture_output=True, text=True,
                            env={**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0"})
    assert result.returncode == 0 and "accel-fsdp" in result.stdout, result.stderr
