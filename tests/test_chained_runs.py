"""What one command writes, the next one reads: an SFT run's folders given to a DPO recipe as its model, and a run
resumed after the model it started from changed. The 2-rank chains themselves run in tests/test_preference.py and
tests/test_checkpoint.py; here, in one process, what each step of a chain decides."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import fabricate_checkpoint, run_in_process, tiny_recipe, user_error


def dpo_recipe(tmp_path: Path, model: Path, **model_keys) -> Path:
    return tiny_recipe(tmp_path / "dpo.yaml", model, "builtin:quickstart-pref", model=model_keys,
                       data={"format": "preference"}, training={"method": "dpo"})


def fake_run(folder: Path, model: Path | None, *, adapter: bool = False) -> Path:
    """A run folder as an SFT run leaves it: run.json, a checkpoint, final/ (a model, or an adapter)."""
    step = fabricate_checkpoint(folder / "checkpoints", 2)
    (folder / "run.json").write_text(json.dumps({"run_id": "a" * 16}))
    final = folder / "final"
    if adapter:
        final.mkdir()
        (final / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(model)}))
        (final / "accel_fsdp_export.json").write_text(json.dumps({"checkpoint": str(step), "adapter": True}))
    elif model is not None:
        shutil.copytree(model, final)
    return folder


def test_a_run_folder_a_checkpoint_or_an_adapter_as_the_model_names_what_to_give(tmp_path, tiny_gpt2):
    """Each was "has no config.json, so it is not a Hugging Face model folder", fix: "`accel-fsdp checkpoint
    consolidate`", which for a LoRA run writes another adapter folder."""
    run = fake_run(tmp_path / "sft", tiny_gpt2)
    message = user_error("recipe", "validate", dpo_recipe(tmp_path, run))
    assert "is a run folder, not a model folder" in message and f"use its exported model, '{run / 'final'}'" in message

    step = run / "checkpoints" / "step-000002"
    message = user_error("recipe", "validate", dpo_recipe(tmp_path, step))
    assert "is a training checkpoint" in message and f"accel-fsdp checkpoint consolidate {step} OUT" in message
    assert "is a training checkpoint" in user_error("generate", step, "--prompt", "a")  # the same words
    shutil.copytree(tiny_gpt2, step / "hf", ignore=shutil.ignore_patterns("*.safetensors"))  # config, no weights
    message = user_error("recipe", "validate", dpo_recipe(tmp_path, step / "hf"))
    assert f"folder '{step}' is a training checkpoint" in message, message

    lora = fake_run(tmp_path / "lora", tiny_gpt2, adapter=True)
    message = user_error("recipe", "validate", dpo_recipe(tmp_path, lora / "final"))
    assert "holds a LoRA adapter (adapter_config.json), not a whole model" in message
    assert (f"`accel-fsdp checkpoint consolidate {lora / 'checkpoints' / 'step-000002'} OUT --merge` and use "
            "OUT/merged") in message, message
    shutil.copytree(tiny_gpt2, lora / "final" / "merged")  # what consolidate --merge leaves beside the adapter
    message = user_error("recipe", "validate", dpo_recipe(tmp_path, lora / "final"))
    assert f"use '{lora / 'final' / 'merged'}'" in message

    unfinished = fake_run(tmp_path / "unfinished", None)  # stopped before its export
    message = user_error("recipe", "validate", dpo_recipe(tmp_path, unfinished))
    assert f"accel-fsdp checkpoint consolidate {unfinished} OUT" in message


def test_the_starting_weights_fingerprint_follows_their_content_not_their_times(tmp_path, tiny_gpt2):
    """A copy (new modification times) is the same model; the same shapes trained again are not."""
    import torch
    from safetensors.torch import load_file, save_file

    from accel_fsdp.config.recipe import load_recipe
    from accel_fsdp.data.identity import weights_fingerprint

    first = shutil.copytree(tiny_gpt2, tmp_path / "first", copy_function=shutil.copyfile)
    second = shutil.copytree(tiny_gpt2, tmp_path / "second", copy_function=shutil.copyfile)

    def fingerprint(folder):
        return weights_fingerprint(load_recipe(str(dpo_recipe(tmp_path, folder)), ()))

    assert fingerprint(first) == fingerprint(second) is not None
    weights = load_file(second / "model.safetensors")
    name = sorted(weights)[-1]  # the last tensor of the file: a change far from the start is seen too
    weights[name] = weights[name].clone()
    weights[name].view(-1)[-1] += 1.0
    save_file(weights, second / "model.safetensors", metadata={"format": "pt"})
    assert fingerprint(second) != fingerprint(first)
    assert torch.equal(load_file(first / "model.safetensors")[name], load_file(tiny_gpt2 / "model.safetensors")[name])


@pytest.mark.parametrize("method,lora", [("dpo", False), ("sft", True)], ids=["dpo-reference", "lora-base"])
def test_a_resume_after_the_starting_model_changed_is_refused_when_the_checkpoint_needs_it(tmp_path, tiny_gpt2,
                                                                                            method, lora):
    """The SFT run a DPO run started from was resumed (a new final/): the DPO run, resumed, computed its reference
    again from the new weights and went on against it; a LoRA run went on over another base. Both said nothing."""
    from safetensors.torch import load_file, save_file

    from accel_fsdp.checkpoint.records import Manifest
    from accel_fsdp.config.recipe import load_recipe
    from accel_fsdp.data.identity import starting_weights_record

    model = shutil.copytree(tiny_gpt2, tmp_path / "sft-final")
    data = {"path": "builtin:quickstart-pref", "format": "preference"} if method == "dpo" else {}
    recipe_file = tiny_recipe(tmp_path / "r.yaml", model, "builtin:quickstart", data=data,
                              training={"method": method}, model={"lora": {"enabled": lora}})
    recipe = load_recipe(str(recipe_file), ())
    step = fabricate_checkpoint(tmp_path / "run" / "checkpoints", 2)
    manifest = Manifest.from_dict(json.loads((step / "manifest.json").read_text()))
    manifest.starting_weights = starting_weights_record(recipe)
    assert manifest.starting_weights is not None
    (step / "manifest.json").write_text(manifest.to_json())
    (step / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict()))

    weights = load_file(model / "model.safetensors")
    for tensor in weights.values():
        tensor.mul_(0.5)  # trained further: every tensor changed, shapes the same
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    before = sorted(p.name for p in step.iterdir())
    message = user_error("recipe", "run", recipe_file, "--output-dir", tmp_path / "again", "--resume-from", step)
    assert f"the model '{model}' changed since the checkpoint {step} was saved" in message, message
    assert ("LoRA adapters were trained over" if lora else "dpo reference was computed from") in message
    assert "resume with the model files the run started from" in message
    assert sorted(p.name for p in step.iterdir()) == before and not (tmp_path / "again").exists()


def test_a_full_fine_tune_records_no_starting_weights(tmp_path, tiny_gpt2):
    """Its checkpoint holds every weight: the model it started from may change freely."""
    from accel_fsdp.config.recipe import load_recipe
    from accel_fsdp.data.identity import starting_weights_record

    recipe = load_recipe(str(tiny_recipe(tmp_path / "sft.yaml", tiny_gpt2, "builtin:quickstart")), ())
    assert starting_weights_record(recipe) is None


def test_a_merge_into_a_base_that_changed_since_the_adapters_were_trained_is_refused(tmp_path, tiny_gpt2):
    """`checkpoint consolidate --merge` merged the adapters into whatever the base folder held by then (the SFT run
    they started from, resumed since): another model, without a word. --base-model says which base to use."""
    from safetensors.torch import load_file, save_file

    from accel_fsdp.checkpoint.records import Manifest
    from accel_fsdp.config.recipe import load_recipe
    from accel_fsdp.data.identity import starting_weights_record

    model = shutil.copytree(tiny_gpt2, tmp_path / "sft-final")
    recipe = load_recipe(str(tiny_recipe(tmp_path / "r.yaml", model, "builtin:quickstart",
                                         model={"lora": {"enabled": True}})), ())
    step = fabricate_checkpoint(tmp_path / "run" / "checkpoints", 2)
    manifest = Manifest.from_dict(json.loads((step / "manifest.json").read_text()))
    manifest.lora, manifest.starting_weights = True, starting_weights_record(recipe)
    (step / "manifest.json").write_text(manifest.to_json())
    (step / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict()))
    weights = load_file(model / "model.safetensors")
    for tensor in weights.values():
        tensor.mul_(0.5)
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    proc = run_in_process("checkpoint", "consolidate", step, tmp_path / "out", "--merge", check=2)
    message = proc.stderr
    assert "Traceback" not in message and message.count("error: ") == 1
    assert f"its LoRA adapters were trained over '{model}' as it was then" in message, message
    assert "--base-model PATH" in message and not (tmp_path / "out").exists()


def test_generate_from_an_adapter_export_whose_base_changed_is_refused(tmp_path, tiny_gpt2):
    """An adapter export loads over the base its adapter_config.json names, as the folder is now: after the SFT run
    it started from was resumed, `generate` sampled from adapters over other weights."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from accel_fsdp.data.identity import folder_fingerprint

    base = shutil.copytree(tiny_gpt2, tmp_path / "sft-final")
    export = tmp_path / "lora-final"
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=2, target_modules=["c_attn"]))
    model.save_pretrained(export)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / name, export / name)
    record = {"adapter": True, "base": {"path": str(base), "fingerprint": folder_fingerprint(base)}}
    (export / "accel_fsdp_export.json").write_text(json.dumps(record))
    assert run_in_process("generate", export, "--prompt", "a", "--max-new-tokens", "2", check=0)
    weights = load_file(base / "model.safetensors")
    for tensor in weights.values():
        tensor.mul_(0.5)
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    message = user_error("generate", export, "--prompt", "a", "--max-new-tokens", "2")
    assert f"its LoRA adapters were trained over '{base}' as it was then" in message, message
    assert "--merge --base-model PATH" in message


def test_a_resume_that_moves_the_end_of_a_decaying_schedule_says_so(tmp_path, tiny_gpt2):
    """training.max_steps may change on resume (a longer run); a cosine or linear schedule then decays towards the
    new end from the checkpoint on, and the next step's lr differs from what the checkpoint's run would have used."""
    from accel_fsdp.checkpoint.index import _schedule_notes
    from accel_fsdp.config.recipe import load_recipe

    saved = {"training": {"max_steps": 8, "epochs": None}}
    longer = load_recipe(str(tiny_recipe(tmp_path / "r.yaml", tiny_gpt2, "builtin:quickstart")),
                         ["training.max_steps=20"])
    assert _schedule_notes(saved, longer) == ["training.max_steps: 8 then, 20 now; the cosine lr schedule decays "
                                              "towards the new end from here on"]
    constant = load_recipe(str(tmp_path / "r.yaml"), ["training.max_steps=20", "training.scheduler=constant"])
    assert _schedule_notes(saved, constant) == [] and _schedule_notes({"training": {"max_steps": 20}}, longer) == []


def test_fsdp1_full_state_dict_checkpoints_on_cpu_ranks_are_refused_before_the_launch(tmp_path, tiny_gpt2):
    """torch's FSDP1 full state dict ended rank 0 with SIGSEGV at the first save on CPU ranks: "rank 0 was killed by
    SIGSEGV", status 1, after the run had started (a resume switching to FULL_STATE_DICT under fsdp1_2gpu --cpu)."""
    recipe = tiny_recipe(tmp_path / "r.yaml", tiny_gpt2, "builtin:quickstart")
    message = user_error("recipe", "run", recipe, "--output-dir", tmp_path / "run", "--accelerate-config", "fsdp1_2gpu",
                         "--cpu", "--set", "checkpoint.state_dict_type=FULL_STATE_DICT")
    assert "FSDP1 cannot gather a FULL_STATE_DICT checkpoint on CPU ranks" in message
    assert "use SHARDED_STATE_DICT" in message and not (tmp_path / "run").exists()


@pytest.mark.parametrize("resume", ["auto", "latest"])
def test_a_run_folder_moved_away_from_its_absolute_checkpoint_dir_is_not_started_again(tmp_path, tiny_gpt2, resume):
    """checkpoint.dir inside the run folder, given absolute; the run folder moved: --resume auto took the run for one
    that saved no checkpoint and trained it again from step 0 over its metrics and final/ (into the old path);
    --resume said "no complete checkpoint", fix: --overwrite."""
    old, moved = tmp_path / "run", tmp_path / "run moved"
    recipe = tiny_recipe(tmp_path / "r.yaml", tiny_gpt2, "builtin:quickstart", checkpoint={"dir": str(old / "ck")})
    fabricate_checkpoint(moved / "ck", 2)
    (moved / "ck" / ".accel-fsdp-run").write_text(json.dumps({"run_id": "a" * 16, "run_dir": str(old)}))
    record = {"run_id": "a" * 16, "recipe_name": "r", "checkpoint_dir": str(old / "ck")}
    (moved / "run.json").write_text(json.dumps(record | {"created": "2026-01-01T00:00:00+0000"}))
    (moved / "metrics.jsonl").write_text("")
    before = sorted(p.name for p in moved.rglob("*"))
    message = user_error("recipe", "run", recipe, "--output-dir", moved, "--resume", resume)
    assert f"{old / 'ck'}: this run's checkpoint folder does not exist" in message, message
    assert f"resume with --set checkpoint.dir='{moved / 'ck'}'" in message
    assert sorted(p.name for p in moved.rglob("*")) == before and not old.exists()
