"""The package's source keeps to the line length pyproject.toml gives ruff (`[tool.ruff] line-length`), except in the
files whose E501 ruff is told to ignore there: a long line is wrapped in parentheses, never continued with a
backslash."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_no_line_of_the_package_is_longer_than_ruffs_limit():
    ruff = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["ruff"]
    limit = ruff["line-length"]
    exempt = {path for path, rules in ruff.get("lint", {}).get("per-file-ignores", {}).items() if "E501" in rules}
    long_lines = [f"{path.relative_to(REPO)}:{number}: {len(line)} characters"
                  for path in sorted((REPO / "accel_fsdp").rglob("*.py"))
                  if str(path.relative_to(REPO)) not in exempt
                  for number, line in enumerate(path.read_text().splitlines(), 1) if len(line) > limit]
    assert not long_lines, "\n".join(long_lines)


def test_no_line_of_the_package_is_continued_with_a_backslash():
    continued = [f"{path.relative_to(REPO)}:{number}"
                 for path in sorted((REPO / "accel_fsdp").rglob("*.py"))
                 if path.name != "slurm.py"  # its backslashes are the sbatch script's, inside a string
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if line.rstrip().endswith("\\") and not line.lstrip().startswith("#")]
    assert not continued, "\n".join(continued)


def test_no_three_blank_lines_in_a_row_and_none_after_a_block_opens():
    """What deleted code leaves behind (pycodestyle's E303): two blank lines between top-level definitions at most,
    and no blank line as the first line of a block."""
    import re

    opener = re.compile(r"^\s*(if|elif|else|for|while|with|try|except|finally)\b.*:(\s*#.*)?$")
    found = []
    for path in sorted([*(REPO / "accel_fsdp").rglob("*.py"), *(REPO / "tests").glob("*.py"),
                        *(REPO / "benchmarks").glob("*.py")]):
        lines = path.read_text().split("\n")
        blank = 0
        for number, line in enumerate(lines, 1):
            blank = blank + 1 if not line.strip() else 0
            if blank == 3:
                found.append(f"{path.relative_to(REPO)}:{number}: a third blank line")
            if number < len(lines) and opener.match(line.rstrip()) and not lines[number].strip():
                found.append(f"{path.relative_to(REPO)}:{number}: a blank line after the block's opening line")
    assert not found, "\n".join(found)
