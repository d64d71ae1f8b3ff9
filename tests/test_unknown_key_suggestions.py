"""An unknown recipe key is answered with the key the user most likely meant: one of its section spelled alike,
the same key in another section (training.seq_len is data.seq_len), or ours for the name another fine-tuning tool
uses (learning_rate is training.lr), in the file and on --set alike. In-process."""

from __future__ import annotations

import pytest

from accel_fsdp.config.recipe import recipe_from_text
from accel_fsdp.errors import UserError

RECIPE = """
model: {architecture: gpt2, tokenizer: "builtin:quickstart"}
data: {path: "builtin:quickstart"}
training: {micro_batch_size: 2, global_batch_size: 16, max_steps: 4}
"""


@pytest.mark.parametrize("key,meant", [
    ("training.lrr", "training.lr"),
    ("training.seq_len", "data.seq_len"),
    ("data.keep_last", "checkpoint.keep_last"),
    ("model.every_steps", "checkpoint.every_steps or logging.every_steps"),
    ("training.learning_rate", "training.lr"),
    ("training.num_train_epochs", "training.epochs"),
    ("data.max_seq_length", "data.seq_len"),
    ("model.lora.lora_alpha", "model.lora.alpha"),
    ("checkpoint.save_total_limit", "checkpoint.keep_last"),
    ("training.gradient_accumulation_steps", "training.global_batch_size (accumulation is derived from it)"),
])
def test_an_unknown_key_suggests_the_key_meant(key, meant):
    with pytest.raises(UserError) as e:
        recipe_from_text(RECIPE, source="r.yaml", overrides=[f"{key}=1"])
    assert f"--set {key}: unknown key\n    fix: did you mean {meant}?" in e.value.format_message()


def test_a_key_of_the_file_gets_the_same_suggestion():
    text = RECIPE.replace("max_steps: 4}", "max_steps: 4, learning_rate: 1e-3, seq_len: 64}")
    with pytest.raises(UserError) as e:
        recipe_from_text(text, source="r.yaml")
    msg = e.value.format_message()
    assert "r.yaml:4: training.learning_rate: unknown key\n      fix: did you mean training.lr?" in msg, msg
    assert "r.yaml:4: training.seq_len: unknown key\n      fix: did you mean data.seq_len?" in msg, msg
