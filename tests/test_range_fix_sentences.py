"""A value out of its range is one problem whose fix is a whole sentence saying what to set the key to
("set training.max_steps to at least 1, or null"), never a fragment ("or null") that only reads with the message
above it. The recipe's range checks build their fix in one place (config/recipe_checks.py `range_fix`); this table
holds every kind of them, on a file key and on --set alike. In-process: nothing here builds a model."""

from __future__ import annotations

import re

import pytest

from accel_fsdp.config.recipe import recipe_from_text
from accel_fsdp.errors import UserError

RECIPE = """
model: {architecture: gpt2, tokenizer: "builtin:quickstart"}
data: {path: "builtin:quickstart"}
training: {micro_batch_size: 2, global_batch_size: 16, max_steps: 4}
"""

CASES = [
    ("training.max_steps=-3", "-3 must be at least 1",
     "set training.max_steps to at least 1, or null"),
    ("training.max_steps=0", "0 must be at least 1", "set training.max_steps to at least 1, or null"),
    ("checkpoint.keep_last=0", "0 must be at least 1",
     "set checkpoint.keep_last to at least 1, or null to keep every checkpoint"),
    ("checkpoint.every_steps=0", "0 must be at least 1",
     "set checkpoint.every_steps to at least 1, or null to save at the end only"),
    ("training.eval_every_steps=0", "0 must be at least 1",
     "set training.eval_every_steps to at least 1, or null to evaluate at the end only"),
    ("training.eval_max_batches=0", "0 must be at least 1", "set training.eval_max_batches to at least 1, or null"),
    ("training.loss_chunk_tokens=0", "0 must be at least 1", "set training.loss_chunk_tokens to at least 1, e.g. 512"),
    ("data.max_rows=0", "0 must be positive", "set data.max_rows to at least 1, or null to read every row"),
    ("data.num_proc=0", "0 must be at least 1", "set data.num_proc to at least 1, or null"),
    ("data.seq_len=0", "0 is too short", "set data.seq_len to at least 8"),
    ("data.eval_fraction=0.7", "0.7 is outside [0, 0.5)", "set data.eval_fraction to a small share such as 0.05"),
    ("training.micro_batch_size=0", "0 must be at least 1", "set training.micro_batch_size to at least 1"),
    ("training.global_batch_size=-8", "-8 must be at least 1", "set training.global_batch_size to at least 1"),
    ("training.lr=0", "0.0 must be positive", "set training.lr to a positive number, typically 1e-5 to 3e-4"),
    ("training.lr=3e3", "3000 is above 1: AdamW moves every weight", "set training.lr to at most 1"),
    ("training.min_lr_ratio=2", "2.0 is outside [0, 1]", "set training.min_lr_ratio to a share between 0 and 1"),
    ("training.warmup_steps=-1", "-1 must be 0 or more", "set training.warmup_steps to 0 or more, e.g. 100"),
    ("training.weight_decay=-0.1", "-0.1 must be 0 or more", "set training.weight_decay to 0 or more"),
    ("training.adam_beta2=1", "1.0 is outside [0, 1)", "set training.adam_beta2 to at least 0 and below 1"),
    ("training.adam_eps=0", "0 is outside (0, 1)", "set training.adam_eps to a positive number below 1"),
    ("training.adam_eps=10", "10 is outside (0, 1): AdamW divides each update", "set training.adam_eps to a positive "
     "number below 1, e.g. 1e-8"),
    ("training.weight_decay=1000", "1000 x training.lr 2e-05 is 0.02", None),
    ("training.weight_decay=100000", "100000 x training.lr 2e-05 is 2: AdamW multiplies every weight by 1 minus that",
     "set training.weight_decay to below 1 / training.lr = 50000"),
    ("model.lora.r=-1", "-1 must be at least 1", "set model.lora.r to at least 1, e.g. 8 or 16"),
    ("model.lora.dropout=1", "1.0 is outside [0, 1)", "set model.lora.dropout to at least 0 and below 1"),
    ("training.max_grad_norm=0", "0.0 must be positive", "set training.max_grad_norm to a positive number"),
    ("training.seed=-1", "-1 is outside [0, 2**32 - 1]", "set training.seed to a non-negative integer below"),
    ("checkpoint.dir=", "is empty", "set checkpoint.dir to a folder name, e.g. checkpoints"),
    ("logging.every_steps=0", "0 must be at least 1", "set logging.every_steps to at least 1, e.g. 10"),
    ("logging.sample_max_new_tokens=0", "0 is outside [1, 4096]",
     "set logging.sample_max_new_tokens to between 1 and 4096"),
    ("fsdp.collective_timeout_minutes=0", "0 is outside [0.1, 10080]",
     "set fsdp.collective_timeout_minutes to minutes between 0.1 and 10080"),
    ("training.epochs=0", "0.0 must be positive", "set training.epochs to a positive number"),
]


def problems_of(overrides: list[str], text: str = RECIPE) -> str:
    with pytest.raises(UserError) as e:
        recipe_from_text(text, source="r.yaml", overrides=overrides)
    return e.value.format_message()


@pytest.mark.parametrize("override,message,fix", CASES, ids=[c[0] for c in CASES])
def test_a_value_out_of_range_says_what_to_set_the_key_to(override, message, fix):
    """(LoRA's values are judged with LoRA off too: the recipe may be switched with --set model.lora.enabled.)"""
    extra = ["training.max_steps=null"] if override.startswith("training.epochs") else []
    if fix is None:  # within the range: accepted
        recipe_from_text(RECIPE, source="r.yaml", overrides=[*extra, override])
        return
    msg = problems_of([*extra, override])
    key = override.split("=")[0]
    assert f"--set {key}: {message}" in msg, msg
    assert f"\n    fix: {fix}" in msg, msg


def test_the_same_fix_is_given_for_a_key_of_the_file():
    msg = problems_of([], RECIPE.replace("max_steps: 4", "max_steps: -3"))
    assert ("r.yaml:4: training.max_steps: -3 must be at least 1\n    fix: set training.max_steps to at least 1, "
            "or null") in msg


def test_no_fix_of_a_recipe_check_is_a_fragment():
    """Every problem the recipe checks can find at once, each fix a sentence of its own."""
    skipped = ("training.epochs", "training.lr=3e3")  # need max_steps null; one problem that hides another
    overrides = [case[0] for case in CASES if case[2] and not case[0].startswith(skipped)]
    msg = problems_of(overrides + ["model.lora.enabled=true", "model.lora.r=0", "model.lora.alpha=0",
                                   "model.lora.dropout=1", "model.lora.target_modules=[]"])
    fixes = re.findall(r"fix: (.*)", msg)
    assert len(fixes) >= 25, msg
    fragments = [f for f in fixes if re.match(r"(or |e\.g\.|typical|commonly|\d)", f)]
    assert not fragments, fragments
