"""Model folders a user brings or a disk damaged, read by every command that reads one (`recipe validate`, the
launch's checks, the ranks' loading, `generate`): each ends in one message naming the file, the value and the fix,
exit status 2, or works. The cases tests/test_user_mistakes.py's corpus already holds (config.json missing, not JSON,
without model_type; weights missing or cut short; no tokenizer) are not repeated. In-process; nothing launches."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import save_tiny_model, user_error

from accel_fsdp.errors import UserError


@pytest.fixture(scope="module")
def good_model(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("good") / "model", "gpt2")


def damaged_copy(good: Path, tmp_path: Path, damage: str) -> Path:
    """A copy of the tiny GPT-2 folder with one thing wrong."""
    folder = tmp_path / damage
    shutil.copytree(good, folder)
    config = json.loads((folder / "config.json").read_text())
    weights = folder / "model.safetensors"
    if damage.startswith("config:"):  # config:key=json-value
        key, value = damage.removeprefix("config:").split("=", 1)
        config[key] = json.loads(value)
        (folder / "config.json").write_text(json.dumps(config))
    elif damage.startswith("file:"):  # file:name=text
        name, text = damage.removeprefix("file:").split("=", 1)
        (folder / name).write_text(text)
    elif damage == "tokens-added":  # special tokens added to the tokenizer, the embedding not resized
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool|>", "<|call|>", "<|result|>"]})
        tokenizer.save_pretrained(folder)
    elif damage == "bin-not-torch":
        weights.unlink()
        (folder / "pytorch_model.bin").write_bytes(os.urandom(3000))
    elif damage.removesuffix("-bin") in ("tensor-missing", "tensor-shape"):
        from safetensors.torch import load_file, save_file

        tensors = load_file(weights)
        name = "transformer.h.0.mlp.c_fc.weight"
        if damage.startswith("tensor-missing"):
            del tensors[name]
        else:
            tensors[name] = tensors[name][:, :10].contiguous()
        if damage.endswith("-bin"):  # a folder of pytorch_model.bin alone, in torch.save's (zip) format
            import torch

            weights.unlink()
            torch.save(tensors, folder / "pytorch_model.bin")
        else:
            save_file(tensors, weights, metadata={"format": "pt"})
    return folder


def validate(folder: Path) -> str:
    return user_error("recipe", "validate", "quickstart", "--set", "model.architecture=null",
                      "--set", "model.tokenizer=null", "--set", "model.config_overrides={}",
                      "--set", f"model.name_or_path={folder}")


CASES = [
    # (damage, what recipe validate says); None: a case with its own test below
    ("config:n_layer=\"two\"", "config.json: n_layer is 'two', not a positive whole number"),
    ("config:n_embd=-64", "config.json: n_embd is -64, not a positive whole number"),
    ("config:model_type=\"bert\"", "'bert' is an encoder (a masked language model"),
    ("config:model_type=\"t5\"", "'t5' is an encoder-decoder model"),
    ("config:vocab_size=10", None),
    ("bin-not-torch", "damaged weights: pytorch_model.bin (not a complete file torch.save wrote"),
    # the files' headers against the model on the meta device (model/build.py `weights_fit_problems`); validate said
    # ok, and the launch's ranks refused the folder each
    ("tensor-missing", "the weights do not fit the model its config.json describes: "
                       "transformer.h.0.mlp.c_fc.weight is missing"),
    ("tensor-shape", "transformer.h.0.mlp.c_fc.weight is [64, 10] in the files but [64, 256] in the model"),
    # the same of a pytorch_model.bin folder: its pickle read onto the meta device, not its weights (below)
    ("tensor-missing-bin", "the weights do not fit the model its config.json describes: "
                           "transformer.h.0.mlp.c_fc.weight is missing"),
    ("tensor-shape-bin", "transformer.h.0.mlp.c_fc.weight is [64, 10] in the files but [64, 256] in the model"),
    ("file:generation_config.json={ not json", "generation_config.json is damaged (JSONDecodeError"),
    ('file:generation_config.json={"eos_token_id": "x"}',
     "generation_config.json: eos_token_id is 'x', not a token id from 0 to 130"),
    ('file:generation_config.json={"eos_token_id": [0, 131]}',
     "generation_config.json: eos_token_id is [0, 131], not a token id from 0 to 130"),
    ("tokens-added", "vocabulary of 131 is smaller than the tokenizer's 134 tokens (past it: '<|tool|>', '<|call|>', "
                     "'<|result|>'), so its ids"),
    # transformers then adds GPT-2's own end-of-text token: the message names it
    ("file:tokenizer_config.json={}", "vocabulary of 131 is smaller than the tokenizer's 132 tokens (past it: "
                                      "'<|endoftext|>')"),
    ('config:eos_token_id="x"', "config.json: eos_token_id is 'x', not a token id from 0 to 130"),
    ("config:bos_token_id=131", "config.json: bos_token_id is 131, not a token id from 0 to 130"),
]


@pytest.mark.parametrize("damage,expected", [c for c in CASES if c[1]], ids=[c[0] for c in CASES if c[1]])
def test_recipe_validate_names_a_damaged_model_folder(good_model, tmp_path, monkeypatch, damage, expected):
    monkeypatch.chdir(tmp_path)
    message = validate(damaged_copy(good_model, tmp_path, damage))
    assert expected in message and "model.name_or_path" in message and "fix:" in message, message


def test_recipe_validate_refuses_a_vocabulary_smaller_than_the_folders_tokenizer(good_model, tmp_path, monkeypatch):
    """The launch refused it (model/build.py `model_config`); validate said ok."""
    monkeypatch.chdir(tmp_path)
    message = validate(damaged_copy(good_model, tmp_path, "config:vocab_size=10"))
    assert "vocabulary of 10 is smaller than the tokenizer's 131 tokens (past it: " in message, message
    assert " and 118 more), so its ids would index past the embedding" in message, message


GENERATE = {
    "config:n_layer=\"two\"": "config.json: n_layer is 'two', not a positive whole number",
    "config:model_type=\"bert\"": "'bert' is an encoder (a masked language model",
    "tensor-missing": "the weights do not fit the model its config.json describes: "
                      "transformer.h.0.mlp.c_fc.weight is missing",
    "tensor-shape": "transformer.h.0.mlp.c_fc.weight is [64, 10] in the files but [64, 256] in the model",
    # transformers dropped a damaged one silently (and with it the EOS ids that stop generation); an id of the wrong
    # type stopped generate with a traceback; a tokenizer larger than the embedding, at the first added token's id
    "file:generation_config.json={ not json": "generation_config.json is damaged (JSONDecodeError",
    'file:generation_config.json={"eos_token_id": "x"}': "eos_token_id is 'x', not a token id from 0 to 130",
    "tokens-added": "its tokenizer has 134 tokens, more than the model's embedding of 131",
    # blamed on the tokenizer ("has no usable tokenizer (Validation error for field 'eos_token_id')")
    'config:eos_token_id="x"': "config.json: eos_token_id is 'x', not a token id from 0 to 130",
}


@pytest.mark.parametrize("damage", sorted(GENERATE))
def test_generate_names_a_damaged_model_folder_instead_of_sampling_from_it(good_model, tmp_path, damage):
    """A tensor the files lack was drawn at random by transformers (exit 0, a half-random model sampled); an encoder
    sampled nothing; a config size of the wrong type was blamed on the tokenizer."""
    message = user_error("generate", damaged_copy(good_model, tmp_path, damage), "--prompt", "alice has a <|call|>",
                         "--max-new-tokens", "2")
    assert GENERATE[damage] in message and "fix:" in message, message


@pytest.mark.parametrize("damage", ["tensor-missing", "tensor-shape"])
def test_the_ranks_refuse_weights_that_do_not_fit_the_config(good_model, tmp_path, damage):
    """What every rank runs when it reads the weights itself (train/setup.py -> model/build.py `build_model`): a
    UserError, which the ranks show once with exit status 2, where transformers trained a tensor it drew at random or
    stopped every rank with a traceback."""
    from accel_fsdp.config.recipe import load_recipe
    from accel_fsdp.config.shipped import shipped_recipes
    from accel_fsdp.model.build import build_model, model_config

    folder = damaged_copy(good_model, tmp_path, damage)
    recipe = load_recipe(shipped_recipes()["quickstart"], ["model.architecture=null", "model.tokenizer=null",
                                        "model.config_overrides={}", f"model.name_or_path={folder}"])
    with pytest.raises(UserError, match="transformer.h.0.mlp.c_fc.weight") as e:
        build_model(recipe, model_config(recipe))
    assert "model.name_or_path" in str(e.value) and "export the model again" in str(e.value)


# ------------------------------------------------------------------------ paths that are links to nothing

def link_loop(tmp_path: Path) -> Path:
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    return loop


@pytest.mark.parametrize("command", [
    ["checkpoint", "inspect", "{loop}"],
    ["checkpoint", "consolidate", "{loop}", "{tmp}/out"],
    ["checkpoint", "consolidate", "{tmp}/run", "{loop}"],
    ["generate", "{loop}", "--prompt", "a"],
    ["report", "{loop}"],
    ["recipe", "run", "quickstart", "--output-dir", "{loop}"],
    ["recipe", "run", "quickstart", "--output-dir", "{loop}/sub"],
    ["recipe", "run", "quickstart", "--output-dir", "{tmp}/r", "--resume-from", "{loop}"],
], ids=["inspect", "consolidate-from", "consolidate-into", "generate", "report", "run-folder", "run-folder-under",
        "resume-from"])
def test_a_symbolic_link_loop_is_named_as_one(tmp_path, monkeypatch, command):
    """A loop of links raised RuntimeError from pathlib's resolve() (consolidate's output, the run folder), or was
    said not to exist."""
    from conftest import fabricate_checkpoint

    monkeypatch.chdir(tmp_path)
    fabricate_checkpoint(tmp_path / "run" / "checkpoints", 2)
    loop = link_loop(tmp_path)
    message = user_error(*[a.format(loop=loop, tmp=tmp_path) for a in command])
    assert f"{loop}" in message and "is a symbolic link that leads nowhere" in message and "fix:" in message, message


def test_generate_of_a_run_whose_export_lost_files_names_final_and_the_export(good_model, tmp_path):
    """A run folder whose final/ lost its config.json was "not a model folder", with a fix to give a run folder."""
    run = tmp_path / "run"
    shutil.copytree(good_model, run / "final")
    (run / "final" / "config.json").unlink()
    message = user_error("generate", run, "--prompt", "a")
    assert f"{run / 'final'}: has no config.json" in message and "checkpoint consolidate RUN OUT" in message


def test_streamed_loading_of_a_folder_without_safetensors_says_so(good_model, tmp_path):
    """fsdp_cpu_ram_efficient_loading under FSDP2: rank 0 streams from safetensors files (model/streaming_load.py).
    A folder of pytorch_model.bin alone listed every tensor as "not in the model files"."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from accel_fsdp.model.build import meta_model
    from accel_fsdp.model.streaming_load import SafetensorsFiles, plan_problems

    folder = tmp_path / "bin-only"
    shutil.copytree(good_model, folder)
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    model = meta_model(AutoConfig.from_pretrained(folder))
    _, problems = plan_problems(model, SafetensorsFiles(folder), "model.name_or_path")
    assert len(problems) == 1 and "has none (it holds pytorch_model.bin)" in problems[0].message, problems
    assert "fsdp_cpu_ram_efficient_loading: false" in problems[0].fix


# ---------------------------------------------------------------- checkpoint files the manifest cannot vouch for

def test_a_shard_torch_cannot_read_is_a_damaged_checkpoint_not_a_traceback(tmp_path):
    """A shard of the right size whose checksum the manifest was made to match (rewritten by hand, or written
    damaged): `checkpoint consolidate` and the ranks' resume read it through `damaged_if_unreadable` (checkpoint/
    consolidate.py, checkpoint/store.py `load_checkpoint`), where DCP's CheckpointException (a BaseException) went
    past every handler with each rank's traceback."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from accel_fsdp.checkpoint.records import DamagedRecord, damaged_if_unreadable

    shards = tmp_path / "step-000002" / "pytorch_model_fsdp_0"
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    dcp.save({"w": torch.ones(64)}, checkpoint_id=str(shards), no_dist=True)
    for shard in shards.glob("*.distcp"):
        shard.write_bytes(os.urandom(shard.stat().st_size))
    # which error torch meets (UnpicklingError, UnicodeDecodeError...) depends on the random bytes
    with pytest.raises(DamagedRecord, match=r"step-000002: incomplete or corrupt checkpoint: a shard of "
                                            r"pytorch_model_fsdp_0 cannot be read \(") as e:
        with damaged_if_unreadable(shards.parent, "a shard of pytorch_model_fsdp_0"):
            dcp.load({"w": torch.empty(64)}, checkpoint_id=str(shards), no_dist=True)
    assert "use an earlier complete checkpoint" in str(e.value)


def test_estimate_reads_a_model_folder_as_validate_does(good_model, tmp_path):
    """A model folder was "not a parameter count, a known model or a recipe", good or damaged alike."""
    from conftest import cli

    code, out = cli("estimate", good_model)
    assert code == 0 and "model (gpt2): 116,672 parameters" in out, out
    message = user_error("estimate", damaged_copy(good_model, tmp_path, "tensor-shape").parent / "nope")
    assert "is not a parameter count" in message
    folder = damaged_copy(good_model, tmp_path, "config:n_layer=\"two\"")
    assert "config.json: n_layer is 'two', not a positive whole number" in user_error("estimate", folder)
    folder = damaged_copy(good_model, tmp_path, "config:model_type=\"bert\"")
    assert "estimate reads GPT-2 and Llama model folders" in user_error("estimate", folder)
    (tmp_path / "empty").mkdir()
    message = user_error("estimate", tmp_path / "empty")  # the folder is the message's subject: named once
    assert message.count("empty") == 1 and "has no config.json" in message, message


@pytest.mark.parametrize("damage,expected", [
    ("file:tokenizer_config.json={garbage", "has a damaged tokenizer_config.json (JSONDecodeError"),
    ("file:tokenizer.json=", "has a damaged tokenizer.json (empty)"),
    ("file:tokenizer.json={garbage", "has a damaged tokenizer.json (JSONDecodeError"),
], ids=["config-garbage", "json-empty", "json-garbage"])
def test_a_damaged_tokenizer_file_is_named(good_model, tmp_path, monkeypatch, damage, expected):
    """The loader's "Expecting value: line 1 column 1 (char 0)" named no file."""
    monkeypatch.chdir(tmp_path)
    folder = damaged_copy(good_model, tmp_path, damage)
    for message in (validate(folder), user_error("generate", folder, "--prompt", "a")):
        assert expected in message and "fix:" in message, message


@pytest.mark.parametrize("damage,expected", [
    ("config:n_layer=\"two\"", "--base-model: {folder}/config.json: n_layer is 'two'"),
    ("bin-not-torch", "--base-model: damaged weights: pytorch_model.bin"),
    ("tensor-missing", "--base-model {folder}: the weights do not fit the model its config.json describes"),
    ("config:model_type=\"bert\"", "--base-model {folder}: 'bert' is an encoder"),
    ("not-there", "--base-model: '{folder}' does not exist"),
])
def test_consolidate_merge_names_a_damaged_base_model(good_model, tmp_path, damage, expected):
    """`checkpoint consolidate --merge --base-model PATH` read the base with transformers alone: a traceback for each
    of these (a missing tensor merged into a random one). The merge of a LoRA checkpoint (checkpoint/consolidate.py
    `_merge_lora`), called with the adapter folder it would write: the base is read first."""
    from accel_fsdp.checkpoint.consolidate import _merge_lora

    folder = tmp_path / "not-there" if damage == "not-there" else damaged_copy(good_model, tmp_path, damage)
    with pytest.raises(UserError) as e:
        _merge_lora(tmp_path / "adapter", tmp_path / "merged", "fp32", str(folder))
    assert expected.format(folder=folder) in str(e.value) and "fix:" in str(e.value), str(e.value)
