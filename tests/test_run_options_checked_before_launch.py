"""What only the whole job shows, refused before any rank starts: a --profile window after the run's last step, a
warm-up longer than a run whose length comes from training.epochs, a checkpoint.dir that is the run folder or above
it, `recipe validate` judging --num-machines / --num-processes / --output-dir as `recipe run` does, a deferred
gradient reduction that FSDP1 would sum in bf16; and a recipe precision that overrules the accelerate config's is said.
In-process; the launch is replaced, so nothing here starts a rank even where a check is missing."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import cli, user_error

from accel_fsdp.launch import launcher


@pytest.fixture
def no_launch(monkeypatch):
    launched = []
    monkeypatch.setattr(launcher, "launch", lambda *a, **k: launched.append(a) or 0)
    return launched


def test_a_profile_window_after_the_last_step_is_refused(tmp_path, no_launch):
    msg = user_error("recipe", "run", "quickstart", "--output-dir", tmp_path / "run", "--profile", "151-152")
    assert "--profile: steps 151-152 begin after the run's 150 optimizer steps: nothing would be profiled" in msg
    assert "fix: give steps between 1 and 150, e.g. --profile 5-6" in msg
    assert not no_launch and not (tmp_path / "run").exists()


def test_a_profile_window_the_run_reaches_is_launched(tmp_path, no_launch):
    code, out = cli("recipe", "run", "quickstart", "--output-dir", tmp_path / "run", "--profile", "150-152")
    assert code == 0 and len(no_launch) == 1, out


def test_a_warmup_longer_than_a_run_of_epochs_is_refused():
    msg = user_error("recipe", "validate", "quickstart", "--set", "training.max_steps=null",
                     "--set", "training.epochs=0.01", "--set", "training.warmup_steps=100")
    assert "--set training.warmup_steps: 100 warm-up steps exceed the run's 3 optimizer steps (0.01 epoch(s) of" in msg
    assert "fix: set training.warmup_steps to at most 3" in msg


@pytest.mark.parametrize("folder", [".", "..", "../.."])
def test_a_checkpoint_folder_that_holds_the_run_folder_is_refused(tmp_path, no_launch, folder):
    msg = user_error("recipe", "run", "quickstart", "--output-dir", tmp_path / "a" / "run",
                     "--set", f"checkpoint.dir={folder}")
    assert f"is the run folder {tmp_path / 'a' / 'run'} or a folder above it" in msg, msg
    assert "fix: choose a folder of its own, e.g. checkpoints (inside the run folder)" in msg
    assert not no_launch


def test_validate_judges_the_machines_and_run_folder_it_is_given(tmp_path):
    msg = user_error("recipe", "validate", "quickstart", "--num-machines", "3")
    assert "num_processes: 2 processes cannot be split evenly over num_machines = 3" in msg
    (tmp_path / "file").write_text("mine")
    msg = user_error("recipe", "validate", "quickstart", "--output-dir", tmp_path / "file")
    assert f"{tmp_path / 'file'} is a file, not a folder" in msg
    # a multi-machine job is judged without the address `recipe run --main-process-ip` gives at launch
    code, out = cli("recipe", "validate", "quickstart", "--num-machines", "2", "--num-processes", "4")
    assert code == 0, out


def test_a_recipe_precision_that_overrules_the_config_is_said(tmp_path):
    import yaml

    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "accelerate_configs" / "fsdp_cpu.yaml").read_text())
    config["mixed_precision"] = "fp16"
    (tmp_path / "acc.yaml").write_text(yaml.safe_dump(config))
    code, out = cli("recipe", "validate", "quickstart", "--accelerate-config", tmp_path / "acc.yaml",
                    "--set", "training.mixed_precision=fp32")
    assert code == 0 and (f"note: --set training.mixed_precision: fp32 is used; {tmp_path / 'acc.yaml'} says "
                          "mixed_precision: fp16 (the recipe's key wins)") in out, out


def test_a_cadence_the_run_never_reaches_is_said():
    code, out = cli("recipe", "validate", "quickstart", "--set", "checkpoint.every_steps=1000",
                    "--set", "training.eval_every_steps=150")
    assert code == 0, out
    assert ("note: --set checkpoint.every_steps: 1,000 is not below the run's 150 optimizer steps: the final "
            "checkpoint alone is saved") in out
    assert "note: --set training.eval_every_steps: 150 is not below the run's 150 optimizer steps" in out


@pytest.mark.parametrize("config,refused", [("fsdp1_2gpu", True), ("fsdp_cpu", False)])
def test_a_deferred_reduction_that_would_accumulate_in_bf16_is_refused(tmp_path, no_launch, config, refused):
    """FSDP1 under no_sync adds each micro-step's gradient into the unsharded flat parameter's bf16 .grad (its
    post-backward hook returns before the cast to the fp32 reduce dtype): with fsdp.reduce_every_micro_step false the
    step's gradient was summed in bf16 while the key's docs (and README's bf16 paragraph) say fp32. FSDP2 accumulates
    in fp32 and launches."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {architecture: gpt2, tokenizer: 'builtin:quickstart', config_overrides: {n_layer: 2, "
                      "n_embd: 64, n_head: 4}}\ndata: {path: 'builtin:quickstart'}\n"
                      "training: {micro_batch_size: 2, global_batch_size: 8, max_steps: 2, mixed_precision: bf16}\n"
                      "fsdp: {reduce_every_micro_step: false}\n")
    args = ("recipe", "run", recipe, "--output-dir", tmp_path / "run", "--accelerate-config", config, "--cpu")
    if not refused:
        code, out = cli(*args)
        assert code == 0 and len(no_launch) == 1, out
        return
    message = user_error(*args)
    assert "fsdp.reduce_every_micro_step: false under FSDP1 with bf16 compute would add the micro-steps' gradients" in (
        message), message
    assert "keep fsdp.reduce_every_micro_step: true" in message and not no_launch
