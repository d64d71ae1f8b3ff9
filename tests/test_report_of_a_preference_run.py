"""`report` of a preference run (DPO, ...): its loss is of pairs, not tokens, so exp() of it is no perplexity. The text
left it out, while --json printed it as final_eval_ppl; both say none now, and a language-model run keeps its own."""

from __future__ import annotations

import json

from conftest import run_in_process

TRAIN = {"kind": "train", "step": 4, "loss": 0.5034, "lr": 6.5e-4, "grad_norm": 0.55, "tokens_per_s": 6235.4,
         "tokens_per_s_per_rank": 3117.7, "step_time_s": 0.61, "tokens_seen": 15074,
         "peak_memory_bytes": [467496960, 466587648], "peak_memory_bytes_run": [467496960, 466587648],
         "source_tokens": {"pref": 424}}
PAIRS = {"reward_chosen": 0.85, "reward_rejected": 0.38, "reward_margin": 0.47, "reward_accuracy": 1.0,
         "logps_chosen": -3.65, "logps_rejected": -4.37}
EVAL = {"kind": "eval", "step": 4, "eval_loss": 0.4867, "eval_ppl": 1.627, "eval_tokens": 529,
        "eval_loss_by_source": {"pref": 0.4867}}
"""Rows as a 4-step quickstart-dpo run on 2 CPU ranks logged them (README.md, What a run logs)."""


def report(run, rows) -> tuple[dict, str]:
    run.mkdir(exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return (json.loads(run_in_process("report", run, "--json", check=0).stdout),
            run_in_process("report", run, check=0).stdout)


def test_a_preference_run_reports_no_perplexity_in_text_or_json(tmp_path):
    summary, text = report(tmp_path / "dpo", [{**TRAIN, **PAIRS},
                                              {**EVAL, **{f"eval_{k}": v for k, v in PAIRS.items()}}])
    assert summary["final_eval_ppl"] is None and summary["final_eval_reward_accuracy"] == 1.0
    assert "perplexity" not in text and "eval loss 0.4867 at the end" in text
    summary, text = report(tmp_path / "lm", [TRAIN, EVAL])
    assert summary["final_eval_ppl"] == 1.627 and "eval loss 0.4867 (perplexity 1.63) at the end" in text


def test_a_report_of_a_run_still_training_says_so_not_at_the_end(tmp_path):
    """`report` while the run trains (the obvious check of its progress) gives the figures so far, naming the live run
    that holds the folder, where it said "at the end"."""
    from accel_fsdp.files import FileLock
    from accel_fsdp.layout import LOCK_FILE

    run = tmp_path / "dpo"
    rows = [{**TRAIN, **PAIRS}, {**EVAL, **{f"eval_{k}": v for k, v in PAIRS.items()}}]
    with FileLock(run.mkdir() or run / LOCK_FILE):  # as a live run holds its folder
        summary, text = report(run, rows)
    assert "4 steps, 15,074 tokens so far: still running (" in text, text
    assert "at the end" not in text and "eval loss 0.4867 so far" in text and "accuracy 1.000 so far (train)" in text
    assert summary["live"]
    assert "at the end" in report(run, rows)[1]  # the lock released: the run ended
