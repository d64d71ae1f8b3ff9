"""The identity of the data, the tokenizer and the starting weights (accel_fsdp/data/identity.py) keys every cache:
whatever changes what a cache holds changes its key."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from accel_fsdp.config.recipe import recipe_from_text
from accel_fsdp.data import identity
from accel_fsdp.data.prepare import source_cache_key
from accel_fsdp.data.synthetic import build_tokenizer
from accel_fsdp.model.tokenizer import _bpe_cache_folder
from accel_fsdp.train.reference import starting_weights_key

FP32 = SimpleNamespace(mixed_precision=SimpleNamespace(value="fp32"))


def model_recipe(model_path, overrides: str = "{}", data: str = "builtin:quickstart-pref"):
    return recipe_from_text(f"""
model: {{name_or_path: "{model_path}", config_overrides: {overrides}}}
data: {{path: "{data}", format: preference, seq_len: 64}}
training: {{method: dpo, micro_batch_size: 2, global_batch_size: 4, max_steps: 3}}
""", source="r.yaml")


@pytest.mark.parametrize("model,override", [
    ("tiny_gpt2", "{resid_pdrop: 0.1}"),
    ("tiny_gpt2", "{attn_pdrop: 0.1, embd_pdrop: 0.1}"),
    ("tiny_llama", "{rope_scaling: {rope_type: linear, factor: 2.0}}"),
])
def test_an_override_of_dropout_or_rope_scaling_changes_the_reference_key(model, override, request):
    folder = request.getfixturevalue(model)
    plain = starting_weights_key(model_recipe(folder), FP32)
    assert starting_weights_key(model_recipe(folder), FP32) == plain
    assert starting_weights_key(model_recipe(folder, override), FP32) != plain


def test_the_versions_of_the_libraries_that_compute_a_forward_change_the_reference_key(tiny_gpt2, monkeypatch):
    plain = starting_weights_key(model_recipe(tiny_gpt2), FP32)
    real = identity.metadata.version
    monkeypatch.setattr(identity.metadata, "version", lambda name: "9.9" if name == "peft" else real(name))
    assert starting_weights_key(model_recipe(tiny_gpt2), FP32) != plain


def bpe_recipe(data="builtin:quickstart"):
    return recipe_from_text(f"""
model: {{architecture: gpt2, tokenizer: "bpe:300"}}
data: {{path: "{data}", seq_len: 64}}
training: {{micro_batch_size: 2, global_batch_size: 4, max_steps: 3}}
""", source="r.yaml")


def test_a_built_in_data_version_bump_changes_the_tokenizer_and_data_cache_keys(monkeypatch):
    tokenizer_folder = _bpe_cache_folder(bpe_recipe(), 300)
    r, tok = bpe_recipe(), build_tokenizer()
    source = r.data.resolved_sources()[0]
    data_key = source_cache_key(r, tok, 0, source)
    assert _bpe_cache_folder(bpe_recipe(), 300) == tokenizer_folder
    monkeypatch.setattr(identity, "BUILTIN_VERSION", identity.BUILTIN_VERSION + 1)
    assert _bpe_cache_folder(bpe_recipe(), 300) != tokenizer_folder
    assert source_cache_key(r, tok, 0, source) != data_key


def test_rows_appended_to_a_file_change_its_identity_and_say_what_changed(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "alice has a cat ."}\n')
    r = bpe_recipe(str(data))
    before = identity.data_identity(r)
    with data.open("a") as f:
        f.write('{"text": "bob has a dog ."}\n')
    after = identity.data_identity(r)
    assert identity.data_changes(before, after) == ["data.path (d): 30 -> 58 bytes"]
    assert identity.data_changes(before, before) == []


def test_a_hub_revision_is_read_from_the_local_hub_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert identity.hub_revision("someone/pairs", "dataset") is None
    refs = tmp_path / "datasets--someone--pairs" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text("0123abcd\n")
    assert identity.hub_revision("someone/pairs", "dataset") == "0123abcd"
    r = recipe_from_text("""
model: {architecture: gpt2, tokenizer: "builtin:quickstart"}
data: {path: "hub:someone/pairs", hub_config: default, split: train}
training: {micro_batch_size: 2, global_batch_size: 4, max_steps: 3}
""", source="r.yaml")
    source, tok = r.data.resolved_sources()[0], build_tokenizer()
    assert identity.source_identity(r, 0, source) == {"hub": "someone/pairs", "config": "default", "split": "train",
                                                      "revision": "0123abcd"}
    key = source_cache_key(r, tok, 0, source)
    (refs / "main").write_text("4567ef01\n")
    assert source_cache_key(r, tok, 0, source) != key
