"""An option the chosen work would not read is never silently ignored: `bench --rounds` without --compare-baseline and
`--compare-baseline` with --compare are refused before anything is measured (as `consolidate --base-model` without
--merge and `recipe run --gpu-memory` without --dry-run are); `generate`'s sampling options under greedy decoding are
a note, since a sweep over temperatures from 0 passes the same options to each."""

from __future__ import annotations

from conftest import run_in_process, user_error


def test_bench_refuses_what_its_measurement_would_not_read():
    out = user_error("bench", "quickstart", "--rounds", "3")
    assert "--rounds: only applies to --compare-baseline" in out and "add --compare-baseline, or drop --rounds" in out
    out = user_error("bench", "quickstart", "--compare", "strategies", "--compare-baseline")
    assert "--compare-baseline: cannot be combined with --compare strategies" in out


def test_generate_notes_sampling_options_that_greedy_decoding_ignores(tiny_gpt2):
    proc = run_in_process("generate", tiny_gpt2, "--prompt", "alice has a", "--top-p", "0.9", "--max-new-tokens", "2",
                          check=0)
    assert "note: --top-p only applies to sampling (--temperature above 0): greedy decoding ignores it" in proc.stderr
    quiet = run_in_process("generate", tiny_gpt2, "--prompt", "alice has a", "--temperature", "0.7", "--top-p", "0.9",
                           "--seed", "3", "--max-new-tokens", "2", check=0)
    assert "note:" not in quiet.stderr
