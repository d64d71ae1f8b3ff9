"""Under stock `accelerate launch` every rank meets a mistake of the recipe, the command line or the launch settings
before the process group exists, where no store can say which rank speaks: the first rank of the machine to get there
says it (a claim in the temporary folder), once, instead of local rank 0 alone (stopped by torchrun before it spoke
when a faster rank had ended) or every rank. In-process: the claim, and where a launched rank reads the recipe."""

from __future__ import annotations

import os
import time

from accel_fsdp.train import lifetime


def test_the_first_rank_of_a_machine_to_claim_a_message_says_it(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert lifetime._first_on_this_machine("abc") is True
    assert lifetime._first_on_this_machine("abc") is False  # every other rank of this launch
    assert lifetime._first_on_this_machine("def") is True  # another message
    claim = next(tmp_path.glob("accel-fsdp-said-*-abc"))
    old = time.time() - 120
    os.utime(claim, (old, old))  # a launcher long gone whose process id came back
    assert lifetime._first_on_this_machine("abc") is True
    monkeypatch.delenv("LOCAL_RANK")
    assert lifetime._first_on_this_machine("ghi") is None  # not a launched rank: nothing to claim


def test_claims_of_launches_long_over_are_swept_by_the_next_claim(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    gone, recent = tmp_path / "accel-fsdp-said-1-old", tmp_path / "accel-fsdp-said-2-recent"
    gone.touch(), recent.touch()
    old = time.time() - 2 * lifetime.CLAIM_SECONDS
    os.utime(gone, (old, old))
    assert lifetime._first_on_this_machine("abc") is True
    assert sorted(p.name.rsplit("-", 1)[-1] for p in tmp_path.iterdir()) == ["abc", "recent"]


def test_in_a_launched_rank_the_recipe_is_read_where_a_mistake_is_said_once(monkeypatch, tmp_path):
    """The recipe and the command line are checked inside `run_rank` (end_with_user_error: once for all ranks), not
    before it (click: every rank)."""
    from click.testing import CliRunner

    from accel_fsdp.cli import main
    from accel_fsdp.cli import recipe as recipe_cli
    from accel_fsdp.errors import UserError

    seen = []

    def run_rank(train):
        try:
            train()
        except UserError as e:
            seen.append(e.format_message())
        raise SystemExit(2)

    monkeypatch.setattr(recipe_cli, "run_rank", run_rank)
    monkeypatch.setattr(recipe_cli, "die_with_launcher", lambda: None)
    for name, value in dict(LOCAL_RANK="0", RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(name, value)  # a rank's whole environment, as torchrun gives it
    result = CliRunner().invoke(main, ["recipe", "run", "quickstart", "--output-dir", str(tmp_path / "run"),
                                       "--set", "training.max_steps=2"])
    assert result.exit_code == 2 and len(seen) == 1, result.output
    assert "training.warmup_steps: 15 warm-up steps exceed training.max_steps = 2" in seen[0]
