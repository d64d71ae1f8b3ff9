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
from accel_fsdp.train.finite import NAMES_SHOWN, FiniteSteps, StepFlag, skips_on_device


class OneProcess:
    """The accelerator a check reads: the step's loss summed over one rank (counted, to see when it communicates)."""

    num_processes = 1

    def __init__(self):
        self.reductions = 0

    def reduce(self, tensor, reduction):
        assert reduction == "sum"
        self.reductions += 1
        return tensor


def guard(model=None, *, scaled=False, newest=None, resumed=False, k=2, max_grad_norm=1.0, optimizer=None):
    recipe = Recipe()
    recipe.training.lr, recipe.training.max_grad_norm = 3e-4, max_grad_norm
    check = FiniteSteps(OneProcess(), model or torch.nn.Linear(2, 2), recipe, accumulation_steps=k, scaled=scaled,
                        newest_checkpoint=lambda: newest, optimizer=optimizer,
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


class Wrapped:
    """Accelerate's AcceleratedOptimizer, as far as the decision reads it."""

    def __init__(self, optimizer):
        self.optimizer = optimizer


def test_the_device_skips_a_step_only_for_an_optimizer_that_reads_the_flag_and_no_scaler_sets_it():
    params = [torch.nn.Parameter(torch.zeros(2))]
    fused = torch.optim.AdamW(params, fused=True)
    assert skips_on_device(fused, scaled=False) and skips_on_device(Wrapped(fused), scaled=False)
    assert not skips_on_device(fused, scaled=True)  # fp16: the grad scaler sets found_inf itself
    assert not skips_on_device(torch.optim.AdamW(params, foreach=True), scaled=False)  # found_inf: fused only
    assert not skips_on_device(torch.optim.SGD(params, lr=0.1), scaled=False)
    assert guard(optimizer=torch.optim.AdamW(params, foreach=True)).flag is None  # read at once, as before
    # a norm where the parameters are not (a GPU's, of parameters offloaded to the host): read at once, since torch
    # would hand the kernel a non-blocking copy of the verdict (the meta device stands in for the GPU here)
    assert StepFlag(fused).serves(torch.tensor(1.0)) and not StepFlag(fused).serves(torch.tensor(1.0, device="meta"))
    check = guard(optimizer=fused)
    check.flag.serves = lambda norm: False  # as for that norm: the first step decides, and reads at once
    with pytest.raises(UserError):
        check.guard(1, torch.tensor(float("nan")), torch.tensor(1.0))
    assert check.flag is None and check.pending is None and getattr(fused, "found_inf", None) is None


def one_step(model, optimizer, check, step, poisoned=False):
    loss = model(torch.ones(1, 2)).sum() * (float("nan") if poisoned else 1.0)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    check.guard(step, norm, loss.detach())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_a_non_finite_step_is_skipped_on_the_device_and_stops_the_run_when_the_host_reads_it():
    """The fused kernel leaves weights, moments and step counts as they were; the host's read comes at the next
    step's guard (or before a row, an evaluation, a checkpoint: `confirm`), with the message of the step itself."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    check = guard(model, optimizer=Wrapped(optimizer), newest="run/checkpoints/step-000002")
    one_step(model, optimizer, check, 1)
    one_step(model, optimizer, check, 2)  # confirms step 1: finite, no collective
    assert check.accelerator.reductions == 0 and check.pending.step == 2
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    state = {name: {k: v.clone() for k, v in optimizer.state[p].items()} for name, p in model.named_parameters()}
    one_step(model, optimizer, check, 3, poisoned=True)  # confirms step 2, hands step 3 to the device's skip
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
        for key, value in optimizer.state[p].items():
            assert torch.equal(value, state[name][key]), (name, key)
    with pytest.raises(UserError) as raised:
        check.confirm()
    assert raised.value.problems[0].message.startswith("optimizer step 3's gradient norm is nan (its loss: nan): the "
                                                       "run stops before the step changes a weight; the newest "
                                                       "checkpoint, run/checkpoints/step-000002, was saved before it")
    check.confirm()  # read once: nothing waits any more
    one_step(model, optimizer, check, 4)  # a later finite step is taken as ever
    assert not torch.equal(model.weight, before["weight"])


def test_a_finite_verdict_leaves_the_update_bit_for_bit_as_without_it():
    """The flag changes no step it lets through: weights, moments and step counts equal, bit for bit, those of the
    same fused AdamW without `found_inf` (its step counts have 0.0 subtracted: exact)."""
    models = []
    for with_flag in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01, fused=True)
        flag = StepFlag(optimizer)
        for step in range(5):
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).sum().backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if with_flag:
                assert StepFlag.finite(flag.set(step, norm, norm))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        models.append((model, optimizer))
    (plain, plain_opt), (flagged, flagged_opt) = models
    for a, b in zip(plain.parameters(), flagged.parameters()):
        assert torch.equal(a, b)
        assert all(torch.equal(plain_opt.state[a][k], flagged_opt.state[b][k]) for k in plain_opt.state[a])


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
    """torchao's NF4Tensor implements no isfinite (torch.isfinite raises on it); training never writes it, so the
    search skips it and still names the adapters' weights."""
    from accel_fsdp.model.nf4 import to_nf4

    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 2, bias=False))
    model[0].weight = torch.nn.Parameter(to_nf4(torch.randn(64, 64, dtype=torch.bfloat16)), requires_grad=False)
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")
    assert guard(model).nonfinite_weights() == ["1.weight"]
