"""`checkpoint inspect --json` prints what a script can read the same way every time: one object for a checkpoint
folder, a list for a run folder, however many checkpoints the run holds (a run that saved one printed an object)."""

from __future__ import annotations

import json

from conftest import fabricate_checkpoint, run_in_process


def test_a_run_folder_is_a_list_even_with_one_checkpoint_and_a_checkpoint_an_object(tmp_path):
    run = tmp_path / "run"
    step = fabricate_checkpoint(run / "checkpoints", 3)
    described = json.loads(run_in_process("checkpoint", "inspect", run, "--json", check=0).stdout)
    assert isinstance(described, list) and [d["step"] for d in described] == [3]
    fabricate_checkpoint(run / "checkpoints", 6)
    described = json.loads(run_in_process("checkpoint", "inspect", run, "--json", check=0).stdout)
    assert [d["step"] for d in described] == [3, 6]
    one = json.loads(run_in_process("checkpoint", "inspect", step, "--json", check=0).stdout)
    assert isinstance(one, dict) and one["step"] == 3
