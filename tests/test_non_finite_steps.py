"""An optimizer step whose gradients are not finite stops the run before it changes a weight (train/finite.py): one
message (exit status 2) with the step, its loss and gradient norm, the weights that hold non-finite values, and the
newest checkpoint, which nothing after it replaced. fp16's skipped steps are the grad scaler's business."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import read_metrics, run_cli, tiny_recipe

from accel_fsdp.config.recipe import Recipe
from accel_fsdp.errors import UserError
from accel_fsdp.checkpoint.consolidate import plain_name
from accel_fsdp.train.finite import NAMES_SHOWN, FiniteSteps


class OneProcess:
    """The accelerator a check reads: the step's loss summed over one rank (counted, to see when it communicates)."""

    num_processes = 1

    def __init__(self):
        self.reductions = 0

    def reduce(self, tensor, reduction):
        assert reduction == "sum"
        self.reductions += 1
        return tensor


def guard(model=None, *, scaled=False, newest=None, resumed=False, k=2, max_grad_norm=1.0):
    recipe = Recipe()
    recipe.training.lr, recipe.training.max_grad_norm = 3e-4, max_grad_norm
    check = FiniteSteps(OneProcess(), model or torch.nn.Linear(2, 2), recipe, accumulation_steps=k, scaled=scaled,
                        newest_checkpoint=lambda: newest,
                        started_from=lambda: ("ckpt/step-000004 (resumed)" if resumed else "r.yaml:3: model", resumed),
                        gather=lambda objects: objects)
    check.start(5 if resumed else 1)
    return check


def problem(check, step, norm, loss):
    with pytest.raises(UserError) as raised:
        check.check(step, torch.tensor(norm), torch.tensor(loss))
    return raised.value.problems[0]


def test_a_finite_norm_is_the_only_host_read_and_no_collective():
    check = guard()
    check.check(3, torch.tensor(12.5), torch.tensor(float("nan")))  # a loss is judged only after a non-finite norm
    assert check.accelerator.reductions == 0


@pytest.mark.parametrize("norm", [float("nan"), float("inf")])
def test_a_non_finite_norm_stops_naming_the_step_its_loss_and_what_to_change(norm):
    check = guard(newest="run/checkpoints/step-000006", max_grad_norm=None)
    found = problem(check, 7, norm, 2 * 3.5)  # two micro-step shares of a 3.5 mean (k=2, one rank)
    assert found.where == "training.lr"
    assert found.message == (f"optimizer step 7's gradient norm is {norm} (its loss: 3.5): the run stops before the "
                             "step changes a weight; the newest checkpoint, run/checkpoints/step-000006, was saved "
                             "before it")
    assert found.fix.startswith("lower training.lr (now 0.0003) or turn clipping on (training.max_grad_norm: 1.0); ")
    assert "start a new run" in found.fix and "accel-fsdp checkpoint consolidate" in found.fix


def test_fp16_goes_on_past_an_overflow_the_scaler_skips_but_not_past_a_non_finite_loss():
    check = guard(scaled=True)
    check.check(3, torch.tensor(float("inf")), torch.tensor(6.0))  # the scaled backward overflowed: a skipped step
    found = problem(check, 4, float("nan"), float("nan"))
    assert "its loss: nan" in found.message and "no checkpoint was written" in found.message
    assert found.fix.endswith("or train in bf16 (training.mixed_precision: bf16), whose range is fp32's; fp16 ends at "
                              "65,504, and run it again (--overwrite)")


def test_damaged_starting_weights_are_named_where_the_run_read_them():
    model = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(NAMES_SHOWN + 2)))
    with torch.no_grad():
        for layer in model:
            layer.weight[0, 0] = float("nan")
        model[0].bias[1] = float("inf")
    found = problem(guard(model), 1, float("nan"), float("nan"))
    assert found.where == "r.yaml:3: model"
    assert found.message.startswith(f"{NAMES_SHOWN + 3} weight tensor(s) hold non-finite values (0.weight, 0.bias, "
                                    "1.weight, 2.weight, 3.weight and 3 more) as this run read them; optimizer step "
                                    "1's gradient norm is nan")
    assert found.fix.startswith("the model's files are damaged")
    resumed = problem(guard(model, resumed=True), 5, float("nan"), float("nan"))
    assert resumed.where.startswith("ckpt/step-000004") and "--resume-from PATH" in resumed.fix
    later = problem(guard(model), 9, float("nan"), float("nan"))  # weights gone bad during the run: the lr's fault
    assert later.where == "training.lr" and later.message.endswith("hold non-finite values (0.weight, 0.bias, "
                                                                   "1.weight, 2.weight, 3.weight and 3 more)")


def test_names_lose_the_wrappers_of_fsdp_checkpointing_and_compile():
    assert plain_name("model._fsdp_wrapped_module.layers.0._checkpoint_wrapped_module._orig_mod.mlp.weight") == \
        "model.layers.0.mlp.weight"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_run_stops_at_its_first_non_finite_step_and_keeps_what_it_saved(tmp_path, tiny_gpt2, stories):
    """On 2 CPU ranks. nan written into rank 1's shard after step 3 (rank 0's shards are finite, so only the global
    norm tells every rank): step 4 is not taken, the step-2 checkpoint stays the newest, one message. Then weights
    damaged in the model's own file: the first step names them and the file."""
    recipe = tiny_recipe(tmp_path / "r.yaml", tiny_gpt2, stories, checkpoint={"every_steps": 2, "keep_last": None})
    proc = run_cli("recipe", "run", recipe, "--output-dir", tmp_path / "run", env={"ACCEL_FSDP_FAULT": "nan:3@1"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    poisoned = proc.stderr.split("[fault] nan written into ")[1].split(" after")[0]
    newest = tmp_path / "run" / "checkpoints" / "step-000002"
    lr_line = recipe.read_text().splitlines().index("  lr: 0.003") + 1
    message = (f"error: {recipe}:{lr_line}: training.lr: optimizer step 4's gradient norm is nan (its loss: nan): the "
               f"run stops before the step changes a weight; the newest checkpoint, {newest}, was saved before it; 1 "
               f"weight tensor(s) hold non-finite values ({poisoned})\n    fix: lower training.lr (now 0.003); ")
    assert proc.stderr.count(message) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert sorted(p.name for p in newest.parent.glob("step-*")) == ["step-000002"]
    assert [r["step"] for r in read_metrics(tmp_path / "run") if r["kind"] == "train"] == [1, 2, 3]
    assert not (tmp_path / "run" / "final").exists()

    damaged = _with_nan_weights(tiny_gpt2, tmp_path / "damaged")
    recipe = tiny_recipe(tmp_path / "d.yaml", damaged, stories)
    proc = run_cli("recipe", "run", recipe, "--output-dir", tmp_path / "run-d")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count(f"error: {recipe}:3: model.name_or_path ({damaged}): 1 weight tensor(s) hold non-finite "
                             "values (transformer.h.1.mlp.c_fc.weight) as this run read them; optimizer step 1's "
                             "gradient norm is nan (its loss: nan)") == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not list((tmp_path / "run-d" / "checkpoints").glob("step-*"))


def _with_nan_weights(model: Path, folder: Path) -> Path:
    """A copy of `model` whose one weight holds a nan, in a file that is otherwise sound (its sizes, its header)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model, folder)
    weights = load_file(folder / "model.safetensors")
    weights["transformer.h.1.mlp.c_fc.weight"][3, 5] = math.nan
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_the_fault_writes_into_a_shard_the_rank_holds():
    from accel_fsdp.train.faults import Faults

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    Faults("nan:3@0", rank=0).after_step(3, model)
    assert math.isnan(model[0].weight.view(-1)[0].item()) and torch.isfinite(model[0].bias).all()
    untouched = torch.nn.Linear(2, 2)
    Faults("nan:3@1", rank=0).after_step(3, untouched)
    assert torch.isfinite(untouched.weight).all()


def test_a_4bit_base_is_passed_over_when_the_weights_are_searched():
    """torchao's NF4Tensor has no isfinite (NotImplementedError); training never writes it, so the search skips it
    and still names the adapters' weights."""
    from accel_fsdp.model.nf4 import to_nf4

    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 2, bias=False))
    model[0].weight = torch.nn.Parameter(to_nf4(torch.randn(64, 64, dtype=torch.bfloat16)), requires_grad=False)
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")
    assert guard(model).nonfinite_weights() == ["1.weight"]
