"""`python benchmarks/gpu_check.py --cpu` runs every check of the GPU check whose mechanism runs on CPU ranks (the GPU
config through `recipe run --cpu`; flash attention through the tests' stand-in kernel), names the ones it skips and
why, and writes its report as markdown."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import REPO

CPU_CHECKS = {1, 2, 3, 4, 5, 7, 8, 10}
GPU_ONLY = {6: "it counts visible GPUs", 9: "MFU is measured against a GPU's peak FLOP/s"}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_gpu_check_runs_every_check_cpu_ranks_can_and_names_the_others(gpu_check_on_cpu_ranks):
    proc, report = gpu_check_on_cpu_ranks.proc, gpu_check_on_cpu_ranks.report
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = {}
    for status, number in re.findall(r"^(PASS|FAIL|SKIP|INFO) +(\d+) ", proc.stdout, re.M):
        results.setdefault(int(number), set()).add(status)
    assert set(results) == CPU_CHECKS | set(GPU_ONLY), proc.stdout
    for number in CPU_CHECKS:
        assert results[number] <= {"PASS", "INFO"}, (number, proc.stdout)
    assert {n for n, statuses in results.items() if "PASS" in statuses} == {1, 2, 3, 4, 5, 7, 10}  # 8 only measures
    for number, why in GPU_ONLY.items():
        assert results[number] == {"SKIP"} and re.search(rf"^SKIP +{number} .*on CPU ranks: {why}", proc.stdout, re.M)
    assert "0 failed, 2 skipped" in proc.stdout
    markdown = report.read_text()
    assert "| check | result | figures |" in markdown
    assert "| 3 FA2 packing isolation (CPU stand-in) | PASS |" in markdown


def test_a_spent_time_budget_starts_nothing_and_still_writes_the_whole_report(tmp_path):
    """--budget-s (for a lent GPU machine of limited time): what cannot start is a SKIP that says why, every check and
    table row is still in the report, and nothing was launched (no run folder in the work folder)."""
    report, work = tmp_path / "report.md", tmp_path / "work"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--cpu", "--budget-s", "0",
                           "--work", str(work), "--markdown", str(report)], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    spent = "not started: the time budget (--budget-s 0) was spent"
    markdown = report.read_text()
    for number in CPU_CHECKS | set(GPU_ONLY):
        assert re.search(rf"^\| {number} [^|]+\| SKIP \| ", markdown, re.M), markdown
    assert markdown.count(spent) == len(CPU_CHECKS | set(GPU_ONLY)) + 8  # and the 8 table rows that are not FP8
    assert "### Knob throughput" in markdown and "0 passed, 0 failed" in proc.stdout
    assert not [p for p in work.iterdir() if p.is_dir()], list(work.iterdir())
