"""Checkpoints through the real CLI on 2 CPU ranks: exact resume after SIGKILL, crashes during a save, fewer ranks,
full vs sharded saves, consolidation into a Hugging Face folder, LoRA adapters, and every way it can go wrong."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    LOGIT_PATH,
    TRACE_UNITS,
    load_weights,
    read_metrics,
    run_cli,
    run_in_process,
    tiny_recipe,
    units_by_step,
)

from accel_fsdp.files import crc32_of
from accel_fsdp.tools.noise import SIGMAS, reordered

pytestmark = pytest.mark.multiprocess
STEPS = 12


def make_recipe(folder: Path, model: Path, data: Path, **overrides) -> Path:
    sections = {
        "model": {"config_overrides": {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}},  # RNG matters
        "training": {"max_steps": STEPS, "mixed_precision": "fp32", "eval_every_steps": 5},
        "checkpoint": {"every_steps": 3, "keep_last": None, "export_dtype": "fp32"},
        "logging": {"every_steps": 1, "sample_prompt": "alice has a", "sample_max_new_tokens": 12},
    }
    for section, values in overrides.items():
        sections.setdefault(section, {}).update(values)
    return tiny_recipe(folder / "recipe.yaml", model, data, **sections)


def dropout_spread(model: Path, data: Path, draws: int = 16) -> float:
    """Relative standard deviation, over dropout masks, of the loss of one global batch (8 rows of 64 tokens of `data`)
    through `model`: how far two runs that draw other masks for the same rows see a step's loss apart."""
    import statistics

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    lines = data.read_text().splitlines()[:64]
    stream = [t for line in lines for t in tok(json.loads(line)["text"])["input_ids"] + [tok.eos_token_id]]
    ids = torch.tensor(stream[:8 * 64]).view(8, 64)
    net = AutoModelForCausalLM.from_pretrained(model).train()  # dropout on
    losses = []
    with torch.no_grad():
        for seed in range(draws):
            torch.manual_seed(seed)
            losses.append(float(net(input_ids=ids, labels=ids).loss))
    return statistics.stdev(losses) / statistics.mean(losses)


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_weights(a), load_weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_gpt2, stories) -> Path:
    """An uninterrupted run: the yardstick of every resume test."""
    folder = tmp_path_factory.mktemp("reference")
    proc = run_cli("recipe", "run", make_recipe(folder, tiny_gpt2, stories), "--output-dir", folder / "run",
                   env=TRACE_UNITS, check=0)
    (folder / "stdout.txt").write_text(proc.stdout)
    return folder / "run"


def test_generate_from_the_export_continues_like_the_trained_model(reference):
    """The sample printed at the end of training (the live, sharded model) and `accel-fsdp generate` on the export
    agree token for token (fp32, greedy)."""
    trained = (reference.parent / "stdout.txt").read_text().split("sample: 'alice has a' -> ")[1].splitlines()[0]
    out = run_in_process("generate", reference, "--prompt", "alice has a", "--max-new-tokens", "12", check=0).stdout
    assert out.strip() == f"alice has a {trained.strip(chr(39))}"
    sampled = run_in_process("generate", reference / "final", "--prompt", "alice has a", "--temperature", "1.0",
                             "--top-p", "0.9", "--seed", "1", check=0).stdout
    assert sampled.startswith("alice has a ")


def test_sigkill_at_a_random_step_then_resume_equals_uninterrupted(tmp_path, reference, tiny_gpt2, stories):
    step = random.randint(4, STEPS - 1)
    recipe = make_recipe(tmp_path, tiny_gpt2, stories)
    run = tmp_path / "run"
    killed = run_cli("recipe", "run", recipe, "--output-dir", run,
                     env={**TRACE_UNITS, "ACCEL_FSDP_FAULT": f"kill:{step}"})
    assert killed.returncode == 1, killed.stderr[-3000:]
    assert "rank 0 was killed by SIGKILL" in killed.stderr
    assert "the run can go on from its newest checkpoint: the same command with --resume auto" in killed.stderr
    assert not (run / "final").exists()
    resumed = run_cli("recipe", "run", recipe, "--output-dir", run, "--resume", env=TRACE_UNITS, check=0)
    last_saved = (step - 1) // 3 * 3  # the kill comes before the checkpoint of its own step
    assert f"continuing from {run / 'checkpoints' / f'step-{last_saved:06d}'} at step {last_saved}" in resumed.stdout
    assert_same_weights(run / "final", reference / "final")
    # Every training row in the same order: none repeated, none skipped.
    assert units_by_step(run) == units_by_step(reference), f"killed after step {step}"
    assert sorted(units_by_step(run)) == list(range(1, STEPS + 1))
    # The metrics file holds one row per step, the interrupted attempt's extra steps dropped.
    train_steps = [r["step"] for r in read_metrics(run) if r["kind"] == "train"]
    assert train_steps == sorted(set(train_steps)) and train_steps[-1] == STEPS


@pytest.mark.slow
def test_sigkill_during_a_save_keeps_the_previous_checkpoint(tmp_path, reference, tiny_gpt2, stories):
    recipe = make_recipe(tmp_path, tiny_gpt2, stories)
    run = tmp_path / "run"
    killed = run_cli("recipe", "run", recipe, "--output-dir", run, env={"ACCEL_FSDP_FAULT": "kill-in-save:6"})
    assert killed.returncode == 1
    ckpts = run / "checkpoints"
    assert (ckpts / "step-000003" / "manifest.json").exists()
    assert not (ckpts / "step-000006").exists() and (ckpts / ".tmp-step-000006").exists()
    inspected = run_in_process("checkpoint", "inspect", run, check=0).stdout
    assert "step-000003: complete" in inspected
    assert ".tmp-step-000006: INCOMPLETE: a save that never finished" in inspected
    msg = run_in_process("checkpoint", "consolidate", ckpts / ".tmp-step-000006", tmp_path / "out", check=2).stderr
    assert "incomplete or corrupt checkpoint: a save that never finished" in msg
    run_cli("recipe", "run", recipe, "--output-dir", run, "--resume", check=0)
    assert not (ckpts / ".tmp-step-000006").exists()
    assert_same_weights(run / "final", reference / "final")


@pytest.fixture(scope="module")
def resumed_on_one_rank(tmp_path_factory, reference, tiny_gpt2, stories) -> tuple[Path, str]:
    """The reference's step-6 checkpoint resumed on 1 rank to the end: its run folder and output. Its own checkpoints
    (steps 9 and 12) are 1-rank checkpoints, which the 1 -> 2 test resumes on 2 ranks."""
    folder = tmp_path_factory.mktemp("one-rank")
    recipe = make_recipe(folder, tiny_gpt2, stories, training={"micro_batch_size": 8})  # same global batch
    proc = run_cli("recipe", "run", recipe, "--output-dir", folder / "run", "--accelerate-config", "fsdp_1gpu", "--cpu",
                   "--resume-from", reference / "checkpoints" / "step-000006", env=TRACE_UNITS, check=0)
    return folder / "run", proc.stdout


@pytest.mark.slow
def test_resume_on_one_rank_from_a_two_rank_checkpoint(resumed_on_one_rank, reference, stories):
    run, stdout = resumed_on_one_rank
    assert "resharding from 2 to 1 ranks" in stdout
    expected = {s: units for s, units in units_by_step(reference).items() if s > 6}
    assert units_by_step(run) == expected
    # Model and optimizer state arrive intact on one rank: training carries on where it was. (Not bitwise: the
    # dropout streams of two ranks cannot be replayed by one.) Two draws of other masks for the same rows differ by
    # at most SIGMAS x sqrt(2) spreads of a batch's loss; the masks move the later weights, and so the evaluation, less.
    spread = SIGMAS * math.sqrt(2) * dropout_spread(reference / "final", stories)
    ours = [r for r in read_metrics(run) if r["kind"] == "eval"][-1]["eval_loss"]
    theirs = [r for r in read_metrics(reference) if r["kind"] == "eval"][-1]["eval_loss"]
    assert ours == pytest.approx(theirs, rel=spread)
    first = [r for r in read_metrics(run) if r["kind"] == "train"][0]
    expected_first = next(r for r in read_metrics(reference) if r["kind"] == "train" and r["step"] == 7)
    assert first["step"] == 7 and first["loss"] == pytest.approx(expected_first["loss"], rel=spread)


@pytest.mark.slow
def test_resume_on_two_ranks_from_a_one_rank_checkpoint(tmp_path, reference, resumed_on_one_rank, tiny_gpt2, stories):
    """1 -> 2: a 1-rank run's checkpoint continues on 2 ranks with the same rows per step."""
    one = resumed_on_one_rank[0]
    recipe = make_recipe(tmp_path, tiny_gpt2, stories, training={"micro_batch_size": 8})
    assert json.loads((one / "checkpoints" / "step-000009" / "manifest.json").read_text())["world_size"] == 1
    two = tmp_path / "two"
    proc = run_cli("recipe", "run", recipe, "--output-dir", two, "--resume-from", one / "checkpoints" / "step-000009",
                   "--set", "training.micro_batch_size=4", env=TRACE_UNITS, check=0)
    assert "resharding from 1 to 2 ranks" in proc.stdout
    assert units_by_step(two) == {s: units for s, units in units_by_step(reference).items() if 9 < s <= STEPS}


@pytest.mark.slow
def test_full_and_sharded_checkpoints_hold_the_same_model(tmp_path, reference, tiny_gpt2, stories):
    """A run saving FULL_STATE_DICT that resumes from the reference's sharded step 6 (a switched
    checkpoint.state_dict_type, resume-safe) ends where the reference does, writing FULL checkpoints at steps 9 and 12;
    a run resumed from its FULL step 9 ends there too. Two resumes, not a third run from the start: the reference's
    sharded checkpoints and final export are the yardstick of both."""
    recipe = make_recipe(tmp_path, tiny_gpt2, stories, checkpoint={"state_dict_type": "FULL_STATE_DICT"})
    # a run that switched checkpoint.state_dict_type reads the checkpoint as it was written: a sharded one read by a
    # run saving FULL was "incomplete or corrupt" (the plugin kept the FULL type's rank-0 config)
    switched = tmp_path / "switched"
    proc = run_cli("recipe", "run", recipe, "--output-dir", switched, "--resume-from",
                   reference / "checkpoints" / "step-000006", check=0)
    assert "at step 6" in proc.stdout
    assert_same_weights(switched / "final", reference / "final")
    described = json.loads(run_in_process("checkpoint", "inspect", switched / "checkpoints" / "step-000012", "--json",
                                          check=0).stdout)
    assert described["state_dict_type"] == "FULL_STATE_DICT" and described["complete"]
    assert (switched / "checkpoints" / "step-000012" / "pytorch_model_fsdp.bin").exists()
    # and a FULL checkpoint resumes like a sharded one
    resumed = run_cli("recipe", "run", recipe, "--output-dir", tmp_path / "again", "--set", "training.max_steps=12",
                      "--resume-from", switched / "checkpoints" / "step-000009", check=0)
    assert "at step 9" in resumed.stdout
    assert_same_weights(tmp_path / "again" / "final", reference / "final")


def test_consolidate_streams_shards_and_transformers_loads_the_same_logits(tmp_path, reference):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = reference / "checkpoints" / "step-000012"
    out = tmp_path / "hf"
    proc = run_in_process("checkpoint", "consolidate", reference, out, "--max-shard-size", "100KB", check=0)
    assert "peak memory" in proc.stdout and "largest shard" in proc.stdout
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]  # tied to transformer.wte.weight: written once
    for f in ["config.json", "generation_config.json", "tokenizer.json", "recipe.yaml"]:
        assert (out / f).exists(), f
    umask = os.umask(0)
    os.umask(umask)  # the export's files as the umask says (safetensors writes 0600): others on a cluster read them
    assert {(p.stat().st_mode & 0o777) for p in out.iterdir() if p.is_file()} == {0o666 & ~umask}

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    # Reference: torch's own DCP -> state dict conversion, loaded into the same architecture.
    dcp_to_torch_save(ckpt / "pytorch_model_fsdp_0", tmp_path / "full.pt")
    state = {k.removeprefix("model."): v for k, v in torch.load(tmp_path / "full.pt")["model"].items()}
    expected = AutoModelForCausalLM.from_pretrained(out)
    expected.load_state_dict(state)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("alice has a red cat . the cat is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected.eval()(ids).logits, rtol=0, atol=0)

    # bf16 export halves the bytes; the final export of the run equals a consolidation of its last checkpoint
    run_in_process("checkpoint", "consolidate", ckpt, tmp_path / "bf16", "--dtype", "bf16", check=0)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16
    assert_same_weights(out, reference / "final")


def test_accelerate_merge_weights_reads_the_model_shards(tmp_path, reference):
    shards = reference / "checkpoints" / "step-000012" / "pytorch_model_fsdp_0"
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.accelerate_cli", "merge-weights", str(shards),
                           str(tmp_path / "merged")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    merged = load_weights(tmp_path / "merged")
    ours = load_weights(reference / "final")
    for key, tensor in ours.items():
        assert torch.equal(merged[key], tensor), key


@pytest.mark.slow
def test_lora_checkpoints_hold_the_adapter_and_export_peft_and_merged(tmp_path, tiny_llama, tiny_gpt2, stories):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    recipe = tiny_recipe(tmp_path / "lora.yaml", tiny_llama, stories,
                         model={"lora": {"enabled": True, "r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}},
                         training={"max_steps": 10, "lr": 1e-2, "mixed_precision": "fp32"},
                         checkpoint={"every_steps": 5, "export_dtype": "fp32"}, logging={"every_steps": 5})
    run = tmp_path / "run"
    run_cli("recipe", "run", recipe, "--output-dir", run, check=0)
    rows = [r for r in read_metrics(run) if r["kind"] == "train"]
    assert rows[-1]["loss"] < rows[0]["loss"]
    manifest = json.loads((run / "checkpoints" / "step-000010" / "manifest.json").read_text())
    assert manifest["lora"] and manifest["trainable_parameters"] < manifest["parameters"] / 10
    import torch.distributed.checkpoint as dcp

    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        keys = dcp.FileSystemReader(str(run / "checkpoints" / "step-000010" / part)).read_metadata().state_dict_metadata
        tensor_keys = [k for k in keys if not k.startswith("optimizer.param_groups")]
        assert tensor_keys and all("lora_" in k for k in tensor_keys), part  # the adapter only

    assert (run / "final" / "adapter_config.json").exists() and (run / "final" / "adapter_model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(tiny_llama)
    adapted = PeftModel.from_pretrained(base, run / "final").eval()
    ids = torch.tensor([[5, 9, 14, 20, 31]])
    with torch.no_grad():
        adapted_logits = adapted(ids).logits
        base_logits = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()(ids).logits
    rounding = reordered(LOGIT_PATH) * float(adapted_logits.abs().max())
    assert float((adapted_logits - base_logits).abs().max()) > rounding  # the adapter learned something

    merging = run_in_process("checkpoint", "consolidate", run, tmp_path / "export", "--merge", check=0)
    said = merging.stdout + merging.stderr  # transformers' loading and writing bars stay out of a log
    assert "Loading weights" not in said and "Writing model shards" not in said and "it/s" not in said, said
    refused = run_in_process("checkpoint", "consolidate", run, tmp_path / "onto-gpt2", "--merge", "--base-model",
                             tiny_gpt2, check=2).stderr  # another model's weights: named, not blamed on the checkpoint
    assert "error: --base-model: the adapter of model.layers.0.self_attn.q_proj has no weight" in refused
    assert not (tmp_path / "onto-gpt2").exists()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "export" / "merged").eval()
    with torch.no_grad():  # the adapter's products added into the weights: the same products, associated otherwise
        torch.testing.assert_close(merged(ids).logits, adapted_logits, rtol=0, atol=rounding)


# ----------------------------------------------------------------------------------------------- faults


def test_consolidating_missing_corrupt_or_empty_input(tmp_path, reference):
    msg = run_in_process("checkpoint", "consolidate", tmp_path / "nope", tmp_path / "out", check=2).stderr
    assert "nope: no such checkpoint" in msg
    broken = tmp_path / "step-000012"
    shutil.copytree(reference / "checkpoints" / "step-000012", broken)
    shard = next((broken / "pytorch_model_fsdp_0").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    msg = run_in_process("checkpoint", "consolidate", broken, tmp_path / "out", check=2).stderr
    assert "incomplete or corrupt checkpoint: pytorch_model_fsdp_0/" in msg and "the manifest says" in msg
    # bytes the manifest vouches for (its checksum rewritten) that torch cannot read: one message, not DCP's traceback
    shutil.rmtree(broken)
    shutil.copytree(reference / "checkpoints" / "step-000012", broken)
    shard.write_bytes(os.urandom(shard.stat().st_size))
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["crc32"][f"pytorch_model_fsdp_0/{shard.name}"] = crc32_of(shard)
    (broken / "manifest.json").write_text(json.dumps(manifest))
    msg = run_in_process("checkpoint", "consolidate", broken, tmp_path / "out", check=2).stderr
    # (which error torch's unpickler meets depends on the random bytes: UnpicklingError, UnicodeDecodeError...)
    assert "a shard of pytorch_model_fsdp_0 cannot be read (" in msg and "Traceback" not in msg, msg
    (tmp_path / "empty-run").mkdir()
    msg = run_in_process("checkpoint", "consolidate", tmp_path / "empty-run", tmp_path / "out", check=2).stderr
    assert "no complete checkpoint found" in msg
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    msg = run_in_process("checkpoint", "consolidate", reference, tmp_path / "mine", check=2).stderr
    assert "exists and is not an earlier export of accel-fsdp" in msg
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    assert not (tmp_path / "out").exists()


def test_resume_with_a_changed_model_is_refused_naming_the_keys(tmp_path, reference):
    recipe = Path(reference / "recipe.yaml")
    msg = run_in_process("recipe", "run", recipe, "--output-dir", tmp_path / "x", "--resume-from",
                         reference / "checkpoints" / "step-000006", "--set", "model.config_overrides.n_layer=3",
                         "--set", "training.lr=0.1", check=2).stderr
    assert "was made by an incompatible recipe" in msg
    assert "model.config_overrides: checkpoint has" in msg
    assert "training.lr: checkpoint has 0.003, this run has 0.1" in msg
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_disk_full_during_a_save_stops_cleanly(tmp_path, tiny_gpt2, stories):
    recipe = make_recipe(tmp_path, tiny_gpt2, stories, training={"max_steps": 6})
    run = tmp_path / "run"
    proc = run_cli("recipe", "run", recipe, "--output-dir", run, env={"ACCEL_FSDP_FAULT": "enospc-in-save:6"},
                   check=2)
    assert ("saving the checkpoint failed: No space left on device; the previous checkpoint step-000003 is intact"
            in proc.stderr)
    assert "free disk space" in proc.stderr and "Traceback" not in proc.stderr
    assert not list((run / "checkpoints").glob(".tmp-*")) and not (run / "checkpoints" / "step-000006").exists()
    assert (run / "checkpoints" / "step-000003" / "manifest.json").exists()


def test_inspect_describes_every_checkpoint(reference):
    out = json.loads(run_in_process("checkpoint", "inspect", reference, "--json", check=0).stdout)
    assert [d["step"] for d in out] == [3, 6, 9, 12]
    last = out[-1]
    assert last["complete"] and last["world_size"] == 2 and last["state_dict_type"] == "SHARDED_STATE_DICT"
    assert last["parameters"] > 0 and last["bytes"] > 0 and last["recipe"]["global_batch_size"] == 8
    text = run_in_process("checkpoint", "inspect", reference / "checkpoints" / "step-000006", check=0).stdout
    assert "step 6 (epoch 0), world size 2, SHARDED_STATE_DICT, FSDP2" in text


def test_rotation_keeps_the_newest_complete_checkpoints(tmp_path):
    from accel_fsdp.checkpoint.index import latest_complete, list_checkpoints
    from accel_fsdp.checkpoint.records import FORMAT
    from accel_fsdp.checkpoint.store import rotate

    for step in (3, 6, 9, 12):
        folder = tmp_path / f"step-{step:06d}"
        folder.mkdir()
        (folder / "weights").write_bytes(b"x" * step)
        (folder / "manifest.json").write_text(json.dumps({"format": FORMAT, "step": step, "files": {"weights": step}}))
    (tmp_path / "step-000015").mkdir()  # a save that lost its manifest: never counted, never deleted by rotation
    removed = rotate(tmp_path, keep_last=2)
    assert sorted(p.name for p in removed) == ["step-000003", "step-000006"]
    assert [c.name for c in list_checkpoints(tmp_path)] == ["step-000009", "step-000012", "step-000015"]
    assert latest_complete(tmp_path).name == "step-000012"
    (tmp_path / "step-000012" / "weights").write_bytes(b"x")  # truncated after the fact: no longer complete
    assert latest_complete(tmp_path).name == "step-000009"


# ---------------------------------------------------------------- preemption, the launcher's death, damage


@pytest.mark.slow
@pytest.mark.multiprocess
def test_signals_stop_the_run_as_each_says_and_it_continues_exactly(tmp_path, reference, tiny_gpt2, stories):
    """One run stopped four times by a signal and continued each time (five starts, not three runs of two and one of
    one, each stop holding its own promise), which ends as the uninterrupted reference does:
    - SLURM's warning signal (SIGUSR1) in its start (after its imports, before its process group): the rank has
      nothing to save, and its handler could not run while the process group's rendezvous blocks, so the signal's
      default action ends it (and torchrun's agent the others). That is a preemption, 75 with one line (it was "rank 1
      was killed by SIGUSR1" and 1, which the SLURM script does not requeue); `--resume auto` then starts the run.
    - `kill -INT` after step 5: it stops at once, the others after it; the launcher says it was interrupted, 130, in
      one line (it was "rank 1 exited with status 130" and 1); `--resume auto` continues from the checkpoint before.
    - SLURM's SIGUSR1 to the launcher after step 5 reaches the ranks (not torchrun's agent's own "death signal"):
      they checkpoint the step it arrived in (5, or 6 where it came while 6 ran), 75.
    - SIGTERM within a step between checkpoints: README's promise, every rank finishes the optimizer step the signal
      arrived in, checkpoints it, and the run stops after it with 75 (preempted, resumable); `--resume` continues."""
    recipe = make_recipe(tmp_path, tiny_gpt2, stories)
    run = tmp_path / "run"
    stopped = run_cli("recipe", "run", recipe, "--output-dir", run,
                      env={**TRACE_UNITS, "ACCEL_FSDP_FAULT": "sigusr1:0@1"}, timeout=300)
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    said = stopped.stderr.rstrip().splitlines()[-1]
    assert said.startswith("preempted (") and "SIGUSR1 to rank 1" in said, stopped.stderr[-3000:]
    assert said.endswith(". Continue with the same command and --resume auto.") and "error" not in stopped.stderr
    assert "Traceback" not in stopped.stderr and not (run / "checkpoints" / "step-000001").exists()

    stopped = run_cli("recipe", "run", recipe, "--output-dir", run, "--resume", "auto",
                      env={**TRACE_UNITS, "ACCEL_FSDP_FAULT": "sigint:5@1"})
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    said = [line for line in stopped.stderr.splitlines()
            if line.strip() and "%|" not in line and not line.startswith(("accel-fsdp: launching", "note: "))]
    assert said == [("interrupted (SIGINT to rank 1): the ranks were stopped. Continue with the same command and "
                     "--resume auto (from the newest complete checkpoint, if any).")], stopped.stderr[-3000:]

    stopped = run_cli("recipe", "run", recipe, "--output-dir", run, "--resume", "auto",
                      env={**TRACE_UNITS, "ACCEL_FSDP_FAULT": "sigusr1-launcher:5"})  # after the resume from step 3
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert "preempted (SIGUSR1): the ranks stopped after step" in stopped.stderr
    assert "death signal" not in stopped.stderr  # torchrun's agent's own line for the signal it forwarded
    step = json.loads((run / "preempted.json").read_text())["step"]
    assert step in (5, 6) and (run / "checkpoints" / f"step-{step:06d}" / "manifest.json").exists()

    step = random.choice([7, 10])  # between checkpoints (every 3 steps and the preemption's)
    stopped = run_cli("recipe", "run", recipe, "--output-dir", run, "--resume", "auto",
                      env={**TRACE_UNITS, "ACCEL_FSDP_FAULT": f"sigterm:{step}@1"})  # rank 1 alone, within `step`
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert f"preempted (SIGTERM to another rank): the ranks stopped after step {step} " in stopped.stderr
    assert json.loads((run / "preempted.json").read_text())["step"] == step
    assert (run / "checkpoints" / f"step-{step:06d}" / "manifest.json").exists()
    assert not (run / "checkpoints" / f"step-{step + 1:06d}").exists()
    assert not (run / "final").exists()
    run_cli("recipe", "run", recipe, "--output-dir", run, "--resume", env=TRACE_UNITS, check=0)
    assert_same_weights(run / "final", reference / "final")
    assert units_by_step(run) == units_by_step(reference)


def rank_pids(run: Path) -> list[int]:
    """Processes whose command line runs this run folder (the ranks, after their launcher is gone)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(run) in (entry / "cmdline").read_text():
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


@pytest.mark.slow
def test_ranks_die_with_their_launcher_and_a_second_start_is_refused_meanwhile(tmp_path, reference, tiny_gpt2,
                                                                               stories):
    import os
    import signal
    import time

    from conftest import REPO

    recipe = make_recipe(tmp_path, tiny_gpt2, stories)
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONUNBUFFERED="1", ACCEL_FSDP_FAULT="hang:7", **TRACE_UNITS)  # rank 0 stuck after step 7
    launcher = subprocess.Popen([sys.executable, "-m", "accel_fsdp", "recipe", "run", str(recipe), "--output-dir",
                                 str(run)], cwd=REPO, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while not (run / "checkpoints" / "step-000006" / "manifest.json").exists():  # rank 1 waits for rank 0 then
        assert launcher.poll() is None and time.monotonic() < deadline, "the run did not reach its first checkpoint"
        time.sleep(0.1)
    second = run_cli("recipe", "run", recipe, "--output-dir", run, "--resume")
    assert second.returncode == 2 and "this run folder is in use by a live run (held by PID" in second.stderr
    os.killpg(launcher.pid, signal.SIGKILL)  # the launcher's process group only: the ranks have sessions of their own
    launcher.wait()
    killed_at = time.monotonic()
    while rank_pids(run) and time.monotonic() - killed_at < 10:
        time.sleep(0.1)
    assert not rank_pids(run), "ranks still alive 10 s after their launcher died"
    proc = run_cli("recipe", "run", recipe, "--output-dir", run, "--resume", env=TRACE_UNITS, check=0)
    assert "continuing from" in proc.stdout
    assert_same_weights(run / "final", reference / "final")
    assert units_by_step(run) == units_by_step(reference)


def test_a_shard_damaged_in_place_is_named_before_anything_reads_it(tmp_path, reference):
    broken = tmp_path / "checkpoints" / "step-000012"
    shutil.copytree(reference / "checkpoints" / "step-000012", broken)
    shard = next((broken / "pytorch_model_fsdp_0").glob("__1_0.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    shard.write_bytes(bytes(data))
    msg = run_in_process("checkpoint", "consolidate", broken, tmp_path / "out", check=2).stderr
    assert "pytorch_model_fsdp_0/__1_0.distcp changed since it was saved (CRC-32 differs" in msg
    assert ("INCOMPLETE: pytorch_model_fsdp_0/__1_0.distcp changed since it was saved"
            in run_in_process("checkpoint", "inspect", broken, check=0).stdout)
    recipe = reference / "recipe.yaml"
    proc = run_in_process("recipe", "run", recipe, "--output-dir", tmp_path / "again", "--resume-from", broken,
                          check=2)
    assert "pytorch_model_fsdp_0/__1_0.distcp changed since it was saved" in proc.stderr
    assert "Traceback" not in proc.stderr
