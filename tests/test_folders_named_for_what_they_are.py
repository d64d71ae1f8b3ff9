"""A path given to a command that wants another kind is named for what it is: `checkpoint inspect` of an exported model
folder said "holds no checkpoints", and `generate` of a file (the weights, the data) said "has no config.json"."""

from __future__ import annotations

from conftest import user_error


def test_inspect_of_an_export_names_it_an_export(tiny_gpt2):
    out = user_error("checkpoint", "inspect", tiny_gpt2)
    assert f"{tiny_gpt2}: is an exported model folder, which holds no checkpoints" in out
    assert "give the run folder it came from" in out


def test_generate_of_a_file_names_it_a_file(tiny_gpt2):
    out = user_error("generate", tiny_gpt2 / "model.safetensors", "--prompt", "alice")
    assert f"{tiny_gpt2 / 'model.safetensors'}: is a file, not a model folder" in out
    assert "the folder that holds config.json" in out
