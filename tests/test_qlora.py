"""QLoRA (model.quantize: nf4 with LoRA) through the real CLI on CPU ranks: each rank holds its half of the 4-bit bytes
and the run trains as one process does; a kill and --resume is bit-identical; a resume on another rank count carries
on within the noise model; every rank's slice of every adapter is in the checkpoint; the base a resume rebuilds is
checked against the one the adapters were trained on."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import assert_adam_runs_agree, load_weights, read_metrics, run_cli, save_tiny_model, tiny_recipe

from accel_fsdp.tools.noise import reordered

pytestmark = pytest.mark.multiprocess
STEPS = 6
QLORA = {"quantize": "nf4", "lora": {"enabled": True, "r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}}


def qlora_recipe(folder, model, **training):
    return tiny_recipe(folder / "qlora.yaml", model, "builtin:quickstart", model=QLORA,
                       data={"max_rows": 300, "eval_fraction": 0},
                       training={"max_steps": STEPS, "lr": 1e-2, "mixed_precision": "fp32", **training},
                       checkpoint={"every_steps": 2, "export_dtype": "fp32"}, logging={"every_steps": 1})


def train_rows(run):
    return [r for r in read_metrics(run) if r["kind"] == "train"]


def assert_same_adapters(a, b):
    wa, wb = load_weights(a), load_weights(b)
    assert wa.keys() == wb.keys() and wa
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, tiny_llama):
    """The uninterrupted 2-rank QLoRA run every test here compares with."""
    folder = tmp_path_factory.mktemp("qlora")
    proc = run_cli("recipe", "run", qlora_recipe(folder, tiny_llama), "--output-dir", folder / "run", check=0)
    (folder / "stdout.txt").write_text(proc.stdout)
    return folder / "run"


def test_qlora_on_two_ranks_holds_half_the_4bit_bytes_and_trains_as_one_process_does(tmp_path, tiny_llama,
                                                                                     two_ranks):
    """The feature's core promise: the 4-bit weights sharded (each of 2 ranks holds half the codes and scales, as
    sharding.json says), and the same losses, gradient norms and adapters as one process holding all of them."""
    one = tmp_path / "one"
    run_cli("recipe", "run", qlora_recipe(tmp_path, tiny_llama, micro_batch_size=8), "--output-dir", one,
            "--accelerate-config", "fsdp_1gpu", "--cpu", check=0)
    two_record = json.loads((two_ranks / "sharding.json").read_text())
    one_record = json.loads((one / "sharding.json").read_text())
    half, other_half = two_record["quantized_bytes"]
    (whole,) = one_record["quantized_bytes"]
    assert half == other_half and half + other_half == whole > 0
    assert two_record["quantized_whole_bytes"] == one_record["quantized_whole_bytes"] == whole  # verify's share
    assert two_record["quantized_base"] == one_record["quantized_base"]  # one base, whatever the ranks
    assert two_record["quantized_base"]["layers"] == 14 and two_record["quantized_base"]["method"] == "nf4"
    summary = (two_ranks.parent / "stdout.txt").read_text()
    assert "quantize  nf4: 14 decoder-block linear layers in 4 bits" in summary
    # fp32: the two add each step's token losses and products up in other orders, a step's rounding carrying into
    # the next one's weights (the 4-bit codes dequantize alike on both).
    reference, ours = train_rows(two_ranks), train_rows(one)
    noise = STEPS * reordered(8 * 64)
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in ours] == pytest.approx([r[key] for r in reference], rel=noise), key
    assert_adam_runs_agree(load_weights(one / "final"), load_weights(two_ranks / "final"),
                           [r["lr"] for r in reference], noise)


@pytest.mark.slow
def test_every_ranks_slice_of_every_adapter_is_in_the_checkpoint(two_ranks):
    """What accelerate restored only rank 0's slice of until 2026-09 (accelerate PR#4206): each adapter tensor's
    saved chunks cover all of it, rank 1's rows included, and only adapters are saved (the base is rebuilt)."""
    import torch.distributed.checkpoint as dcp

    checkpoint = two_ranks / "checkpoints" / "step-000004"
    metadata = dcp.FileSystemReader(str(checkpoint / "pytorch_model_fsdp_0")).read_metadata()
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if hasattr(v, "chunks")}
    assert tensors and all("lora_" in k for k in tensors)
    for name, tensor in tensors.items():
        rows = sorted((c.offsets[0], c.offsets[0] + c.sizes[0]) for c in tensor.chunks)
        assert len(rows) == 2 and rows[0][0] == 0 and rows[0][1] == rows[1][0] and rows[1][1] == tensor.size[0], name
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["quantized_base"]["fingerprint"] == json.loads(
        (two_ranks / "sharding.json").read_text())["quantized_base"]["fingerprint"]


@pytest.mark.slow
def test_a_kill_and_resume_of_qlora_is_bit_identical(tmp_path, tiny_llama, two_ranks):
    """Killed after step 5, resumed from step 4 on 2 ranks: every rank's adapter slice and optimizer state come back,
    the base is rebuilt from the model files (and checked), and the adapters end bit-identical."""
    recipe, run = qlora_recipe(tmp_path, tiny_llama), tmp_path / "run"
    killed = run_cli("recipe", "run", recipe, "--output-dir", run, env={"ACCEL_FSDP_FAULT": "kill:5"})
    assert killed.returncode == 1, killed.stderr[-3000:]
    resumed = run_cli("recipe", "run", recipe, "--output-dir", run, "--resume", check=0)
    assert "continuing from" in resumed.stdout and "at step 4" in resumed.stdout
    assert_same_adapters(run / "final", two_ranks / "final")
    assert [r["loss"] for r in train_rows(run)] == [r["loss"] for r in train_rows(two_ranks)]


@pytest.mark.slow
def test_a_qlora_checkpoint_of_two_ranks_resumes_on_one_within_the_noise_model(tmp_path, tiny_llama, two_ranks):
    recipe, run = qlora_recipe(tmp_path, tiny_llama, micro_batch_size=8), tmp_path / "run"
    proc = run_cli("recipe", "run", recipe, "--output-dir", run, "--accelerate-config", "fsdp_1gpu", "--cpu",
                   "--resume-from", two_ranks / "checkpoints" / "step-000002", check=0)
    assert "resharding from 2 to 1 ranks" in proc.stdout
    reference = {r["step"]: r for r in train_rows(two_ranks)}
    noise = STEPS * reordered(8 * 64)
    for row in train_rows(run):
        for key in ("loss", "grad_norm"):
            assert row[key] == pytest.approx(reference[row["step"]][key], rel=noise), (row["step"], key)
    assert_adam_runs_agree(load_weights(run / "final"), load_weights(two_ranks / "final"),
                           [r["lr"] for r in reference.values()], noise)


@pytest.mark.slow
def test_a_resume_onto_changed_model_files_is_refused_naming_both_fingerprints(tmp_path):
    """The base is not in the checkpoint: a model folder changed since is caught by the fingerprint, one message."""
    from safetensors.torch import load_file, save_file

    model = save_tiny_model(tmp_path / "model", "llama")
    recipe, run = qlora_recipe(tmp_path, model, max_steps=2), tmp_path / "run"
    run_cli("recipe", "run", recipe, "--output-dir", run, check=0)
    weights = load_file(model / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"][0, 0] += 0.5
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    proc = run_cli("recipe", "run", recipe, "--output-dir", run, "--resume", "--set", "training.max_steps=4")
    assert proc.returncode == 2, proc.stderr[-3000:]
    # Caught before the launch by the starting weights' fingerprint (checkpoint/index.py _check_starting_weights);
    # the 4-bit base's own (a torchao that quantizes otherwise) is tests/test_quantize.py's.
    assert re.search(r"changed since the checkpoint .* \(its LoRA adapters were trained over the weights as they were "
                     r"then; fingerprint \S+, now \S+\)", proc.stderr), proc.stderr
    assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.stderr
