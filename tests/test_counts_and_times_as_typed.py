"""Numbers as users type them into `estimate` and `slurm`: a decimal comma is not a thousands separator (1,5B was
read as 15B), and a SLURM time or partition is ASCII and whole, since it goes into the script as typed (full-width
digits were accepted, a partition's trailing line break slipped into an #SBATCH line; a time is written stripped)."""

from __future__ import annotations

import pytest
from conftest import run_in_process, user_error

from accel_fsdp.planning.estimate import parse_count


@pytest.mark.parametrize("text, count", [("104,960,000", 104_960_000), ("1,500B", 1_500_000_000_000),
                                         ("1.5B", 1_500_000_000), ("1_000", 1000), ("175e9", 175_000_000_000)])
def test_counts_with_thousands_grouping_read_as_written(text, count):
    assert parse_count(text) == count


def test_a_decimal_comma_is_refused_not_read_as_thousands():
    for text in ("1,5B", "12,34"):
        assert parse_count(text) is None
        out = user_error("estimate", text)
        assert f"{text}: is not a parameter count: a comma only groups thousands" in out and "1.5B" in out


@pytest.mark.parametrize("option, value", [("--time", "\uff11\uff12:00:00"), ("--time", "1-\uff10"),
                                           ("--partition", "gpu\n"), ("--partition", "gp\u00fc")])
def test_slurm_time_and_partition_are_ascii_and_whole(tmp_path, option, value):
    script = tmp_path / "job.sbatch"
    proc = run_in_process("slurm", "quickstart", "--nodes", "1", "--gpus-per-node", "2", option, value, "-o", script)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"error: {option}: {value!r} is not a" in proc.stderr
    assert not script.exists()


def test_a_bare_count_refuses_each_activation_option_alike():
    """--micro-batch with a bare count was refused and --seq-len silently ignored: both need the model's shape."""
    for option, value in (("--micro-batch", "2"), ("--seq-len", "512")):
        out = user_error("estimate", "7B", option, value)
        assert f"error: {option}: activations need the model's shape" in out and f"drop {option}" in out


def test_a_bare_count_is_named_as_typed_and_counted_once():
    """The header said "estimate: 7,000,000,000 parameters: 7,000,000,000 parameters (...)"."""
    from conftest import cli

    code, out = cli("estimate", "7B")
    assert code == 0 and out.startswith("estimate: 7B: 7,000,000,000 parameters (7,000,000,000 trainable)"), out
