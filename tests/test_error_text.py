"""What an exception says reaches a message as its first line that says something, through one helper
(errors.first_line); an exception whose text is empty or blank gives its type's name, never an IndexError."""

from __future__ import annotations

import pytest
import torch

from accel_fsdp.errors import first_line


@pytest.mark.parametrize("error,plain,named", [
    (OSError(), "OSError", "OSError"),
    (RuntimeError(" \n\t"), "RuntimeError", "RuntimeError"),
    (ValueError("\n  second line says it\nthird"), "second line says it", "ValueError: second line says it"),
    (KeyError("k"), "'k'", "KeyError: 'k'"),
])
def test_the_first_line_that_says_something_else_the_type(error, plain, named):
    assert first_line(error) == plain
    assert first_line(error, named=True) == named


def test_the_first_line_is_cut_to_its_limit():
    assert first_line(RuntimeError("x" * 500)) == "x" * 200
    assert first_line(RuntimeError("x" * 500), 10, named=True) == "RuntimeError: " + "x" * 10


@pytest.mark.parametrize("text", ["", "   "])
def test_cuda_failing_to_initialize_without_a_word_is_named_by_its_type(monkeypatch, tmp_path, text):
    from accel_fsdp import hardware

    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(hardware, "_NVIDIA_NODES", (str(tmp_path),))

    def init():
        raise RuntimeError(text)

    monkeypatch.setattr(torch.cuda, "init", init)
    assert hardware.cuda_unavailable_reason() == "CUDA failed to initialize: RuntimeError"


def test_a_hub_config_that_fails_to_load_without_a_word_is_one_message(monkeypatch):
    import transformers

    from accel_fsdp.config.recipe import recipe_from_text
    from accel_fsdp.errors import UserError
    from accel_fsdp.model.build import model_config

    recipe = recipe_from_text("model: {name_or_path: someone/model}\ndata: {path: 'builtin:quickstart'}\n",
                              source="r.yaml")

    def from_pretrained(*args, **kwargs):
        raise OSError()

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", from_pretrained)
    with pytest.raises(UserError, match=r"model.name_or_path: cannot load 'someone/model': OSError"):
        model_config(recipe)
