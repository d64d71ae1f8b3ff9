"""`python benchmarks/gpu_check.py --cpu --table-only`: the knobs' throughput table (benchmarks/knob_throughput.py) runs
every row CPU ranks can (eager, +compile, +chunked loss, +activation offload on tiny Llama and GPT-2 models) and names
the rows it skips and why (FP8 on CPU and on GPT-2), as markdown."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from knob_throughput import CPU_MODELS, GPU_MODELS, STEPS, VARIANTS, skipped_because  # noqa: E402

TEST_STEPS = 3


def test_fp8_rows_are_skipped_on_cpu_and_for_gpt2_and_a_missing_key_is_named():
    keys = {s.split("=")[0] for v in VARIANTS for s in v.sets}
    llama, gpt2 = GPU_MODELS[0], GPU_MODELS[1]
    fp8 = VARIANTS[-1]
    assert skipped_because(llama, fp8, False, keys) is None
    assert "Conv1D" in skipped_because(gpt2, fp8, False, keys)
    assert "compute capability 8.9" in skipped_because(CPU_MODELS[0], fp8, True, keys)
    without_compile = keys - {"training.compile"}
    assert "is not a recipe key of this build" in skipped_because(llama, VARIANTS[1], False, without_compile)
    assert [v.name for v in VARIANTS] == ["eager", "+compile", "+chunked loss", "+activation offload", "+FP8"]
    # in the order of what matters most when gpu_check's --budget-s cuts the table short
    assert [(m.label, m.seq_len) for m in GPU_MODELS] == [("llama-3.2-1b", 2048), ("gpt2-xl", 1024),
                                                           ("llama-3.2-1b", 8192)]


@pytest.mark.parametrize("cpu,native,expected", [(False, "0", "bf16"), (True, "1", "bf16"), (True, "0", "fp32")])
def test_the_rows_are_bf16_except_on_cpu_ranks_of_a_cpu_that_emulates_it(tmp_path, monkeypatch, cpu, native, expected):
    """GPUs and CPUs with native bf16 (AVX512-BF16, AMX, Arm BF16) run the table in bf16; a CPU that emulates it (AVX2
    alone: a bf16 product of the Llama head's shape took 20x the fp32 one) runs its CPU rows in fp32, and says so."""
    import yaml
    from knob_throughput import recipe_for, table_precision

    from accel_fsdp.hardware import CPU_BF16_ENV

    monkeypatch.setenv(CPU_BF16_ENV, native)
    recipe = yaml.safe_load(recipe_for(CPU_MODELS[0], tmp_path, cpu, ranks=2).read_text())
    assert recipe["training"]["mixed_precision"] == expected
    precision, why = table_precision(cpu)
    assert precision == expected and ("no native bf16" in why) == (expected == "fp32"), why


@pytest.mark.slow(weight=3)  # the suite's longest test (8 rows, 2 of them compiled): 172 s on an AVX512-BF16 CPU, 245 s
@pytest.mark.multiprocess    # on an AVX2-only one (its rows in fp32; 983 s in emulated bf16), about 3 slow tests
def test_the_throughput_table_runs_on_cpu_ranks_and_names_what_it_skips(tmp_path):
    report = tmp_path / "table.md"
    # 3 steps a row, not the table's 20: the rows run the same way (warm-up, then the measured steps); the figures,
    # which this test does not read, are what more steps would make steadier.
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--cpu", "--table-only",
                           "--table-steps", str(TEST_STEPS), "--work", str(tmp_path / "work"), "--markdown",
                           str(report)], capture_output=True, text=True, timeout=3000, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = re.findall(r"^(INFO|SKIP|FAIL) +(llama|gpt2) .*? 128 (\S+(?: \S+)*?):", proc.stdout, re.M)
    by_row = {(family, variant): status for status, family, variant in rows}
    for family in ("llama", "gpt2"):
        for variant in ("eager", "+compile", "+activation offload"):
            assert by_row[(family, variant)] == "INFO", proc.stdout
        assert by_row[(family, "+FP8")] == "SKIP"
    assert "0 failed" in proc.stdout
    markdown = report.read_text()
    assert (f"| model | tokens | variant | result | tokens/s | MFU | peak memory | loss after {TEST_STEPS} steps "
            "| profiled step: share of its wall time |" in markdown)
    # each measured row profiled its last steps: the split of a step (MFU's breakdown on a GPU)
    measured = [line for line in markdown.splitlines() if "| INFO |" in line]
    assert len(measured) == 8 and all(re.search(r"\| fwd\+bwd \d+% / clip \d+% / optimizer \d+% \|$", line)
                                      for line in measured), markdown
    assert STEPS == 20  # what the table runs without --table-steps
