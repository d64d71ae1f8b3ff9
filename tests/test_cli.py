"""The CLI in-process (click's CliRunner): listing, copying, validating every shipped file, and every bad input a
user can make, each with its message pinned, exit status 2, no traceback, nothing of theirs changed."""

from __future__ import annotations

import hashlib
import json
import re

import pytest
from conftest import cli, tiny_recipe, user_error, write_jsonl

from accel_fsdp.config.shipped import shipped_accelerate_configs, shipped_recipes


def paired_config(recipe_name: str) -> str:
    header = shipped_recipes()[recipe_name].read_text()
    return re.search(r"Pair with:\s+accelerate_configs/(\w+)\.yaml", header).group(1)


def test_recipe_list_shows_name_model_parameters_description():
    code, out = cli("recipe", "list")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "MODEL", "PARAMS", "DESCRIPTION"]
    for name in shipped_recipes():
        assert any(line.startswith(name + " ") for line in lines), name
    gpt2xl = next(line for line in lines if line.startswith("gpt2-xl "))
    assert "openai-community/gpt2-xl" in gpt2xl and "1.56B" in gpt2xl


def test_recipe_show_and_copy(tmp_path):
    code, out = cli("recipe", "show", "quickstart")
    assert code == 0 and out == shipped_recipes()["quickstart"].read_text()
    code, out = cli("recipe", "copy", "quickstart", tmp_path)
    assert code == 0 and "copied quickstart.yaml" in out
    assert (tmp_path / "quickstart.yaml").read_text() == shipped_recipes()["quickstart"].read_text()
    msg = user_error("recipe", "copy", "quickstart", tmp_path / "quickstart.yaml")
    assert "quickstart.yaml: already exists" in msg and "--force" in msg
    assert cli("recipe", "copy", "quickstart", tmp_path / "quickstart.yaml", "--force")[0] == 0


@pytest.mark.parametrize("name", sorted(shipped_recipes()))
def test_every_shipped_recipe_validates_offline_with_its_config(name):
    config = paired_config(name)
    code, out = cli("recipe", "validate", name, "--accelerate-config", config)
    assert code == 0, out
    assert out.startswith(f"ok: recipes/{name}.yaml with accelerate_configs/{config}.yaml"), out


@pytest.mark.parametrize("config", sorted(shipped_accelerate_configs()))
def test_every_shipped_config_validates(config):
    recipe = "quickstart-llama" if "llama" in config else "quickstart"
    code, out = cli("recipe", "validate", recipe, "--accelerate-config", config,
                    "--set", "training.micro_batch_size=1", "--set", "training.global_batch_size=64")
    assert code == 0, out


# ----------------------------------------------------------------------------------------------- bad input


def test_recipe_file_missing():
    msg = user_error("recipe", "validate", "no-such-recipe.yaml")
    assert "no-such-recipe.yaml: no such recipe file, and no shipped recipe by that name" in msg
    assert "accel-fsdp recipe list" in msg
    assert "did you mean quickstart" in user_error("recipe", "run", "quickstrat")


def test_yaml_syntax_error_with_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  architecture: gpt2\n  tokenizer: [builtin\ndata:\n  path: x\n")
    msg = user_error("recipe", "validate", bad)
    assert re.search(r"bad\.yaml:4:\d+: YAML syntax error", msg), msg


def test_unknown_key_wrong_type_and_range_together(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(shipped_recipes()["quickstart"].read_text().replace("  lr: 3.0e-3", "  lr: fast\n  lrr: 1"))
    msg = user_error("recipe", "validate", path, "--set", "training.max_steps=0")
    assert "recipe " in msg and "has 3 problems" in msg
    assert "training.lrr: unknown key" in msg and "did you mean training.lr?" in msg
    assert "training.lr: expected a finite number, found 'fast'" in msg
    assert "--set training.max_steps: 0 must be at least 1" in msg


def test_global_batch_not_divisible():
    msg = user_error("recipe", "validate", "quickstart", "--set", "training.global_batch_size=20")
    assert ("--set training.global_batch_size: 20 is not divisible by micro_batch_size x processes = 4 x 2 = 8"
            in msg)
    assert "use a multiple of 8 (e.g. 16 or 24)" in msg


def test_wrap_class_not_in_model_fails_before_training(tmp_path):
    msg = user_error("recipe", "run", "quickstart-llama", "--accelerate-config", "fsdp_2gpu",
                     "--output-dir", tmp_path / "run")
    assert ("accelerate_configs/fsdp_2gpu.yaml: fsdp_transformer_layer_cls_to_wrap: wrap class GPT2Block is not in "
            "the model LlamaForCausalLM (its transformer block is LlamaDecoderLayer)") in msg
    assert "--set fsdp.wrap_class=LlamaDecoderLayer" in msg
    assert not (tmp_path / "run").exists()
    msg = user_error("recipe", "validate", "quickstart", "--set", "fsdp.wrap_class=LlamaDecoderLayer")
    assert "--set fsdp.wrap_class: wrap class LlamaDecoderLayer is not in the model GPT2LMHeadModel" in msg


def test_data_file_missing_empty_or_without_the_field(tmp_path, tiny_gpt2):
    recipe = tiny_recipe(tmp_path / "r.yaml", tiny_gpt2, tmp_path / "missing.jsonl")
    msg = user_error("recipe", "validate", recipe)
    assert "data.path: data file" in msg and "missing.jsonl' not found" in msg
    (tmp_path / "empty.jsonl").write_text("")
    msg = user_error("recipe", "validate", recipe, "--set", f"data.path={tmp_path / 'empty.jsonl'}")
    assert "empty.jsonl' is empty" in msg
    write_jsonl(tmp_path / "rows.jsonl", [{"body": "a story"}] * 5)
    msg = user_error("recipe", "validate", recipe, "--set", f"data.path={tmp_path / 'rows.jsonl'}")
    assert "data.text_field: " in msg and "has no field 'text' (its fields: body)" in msg
    assert "set data.text_field to one of them" in msg
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\n{"text": "b"\n')
    msg = user_error("recipe", "validate", recipe, "--set", f"data.path={tmp_path / 'broken.jsonl'}")
    assert "line 2: invalid JSON" in msg


def test_seq_len_above_the_model_context():
    msg = user_error("recipe", "validate", "quickstart", "--set", "data.seq_len=4096")
    assert "--set data.seq_len: 4096 exceeds the model's context length of 128 tokens" in msg
    assert "use at most 128" in msg


def test_accelerate_config_missing():
    msg = user_error("recipe", "validate", "quickstart", "--accelerate-config", "configs/nope.yaml")
    assert "configs/nope.yaml: no such accelerate config file" in msg


def test_output_folder_holding_a_different_run_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"run_id": "0123456789abcdef", "recipe_name": "other",
                                              "recipe_fingerprint": "0123"}))
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in run.iterdir()}
    msg = user_error("recipe", "run", "quickstart", "--output-dir", run)
    assert "already holds a different run (recipe 'other'" in msg
    assert "--resume to continue it, --overwrite to replace it" in msg
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in run.iterdir()} == before
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    msg = user_error("recipe", "run", "quickstart", "--output-dir", tmp_path / "notes")
    assert "is not empty and does not hold an accel-fsdp run" in msg
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"


def test_conflicting_flags():
    assert "cannot be combined with --resume" in user_error("recipe", "run", "quickstart", "--resume", "--overwrite")
