"""`checkpoint inspect` says what a checkpoint holds and the recipe that made it, a mixture's sources included. In
process, on checkpoints made without training (their manifest and recipe are what inspect reads)."""

from __future__ import annotations

import json

from click.testing import CliRunner
from conftest import fabricate_checkpoint

from accel_fsdp.cli import main
from accel_fsdp.config.recipe import recipe_from_text

MIXTURE = """
name: mix
model: {architecture: gpt2, tokenizer: builtin:quickstart}
data:
  sources:
    - {path: data/stories.jsonl, weight: 3}
    - {name: chat, path: HuggingFaceH4/ultrachat_200k, weight: 1, format: chat}
training: {global_batch_size: 8, max_steps: 10}
"""


def inspect(*args) -> str:
    result = CliRunner().invoke(main, ["checkpoint", "inspect", *map(str, args)])
    assert result.exit_code == 0, result.output
    return result.output


def test_inspect_of_a_mixture_run_shows_its_sources(tmp_path):
    step_dir = fabricate_checkpoint(tmp_path / "checkpoints", 4)
    (step_dir / "recipe.yaml").write_text(recipe_from_text(MIXTURE, source="mix.yaml").to_yaml())
    text = inspect(step_dir)
    assert "recipe mix: model gpt2, data a mixture of 2 sources, global batch 8" in text
    assert "stories          0.75 of the mixture: data/stories.jsonl" in text
    assert "chat             0.25 of the mixture: HuggingFaceH4/ultrachat_200k" in text
    recipe = json.loads(inspect(step_dir, "--json"))["recipe"]
    assert recipe["data"] is None
    assert recipe["sources"] == [{"name": "stories", "path": "data/stories.jsonl", "share": 0.75},
                                 {"name": "chat", "path": "HuggingFaceH4/ultrachat_200k", "share": 0.25}]


def test_inspect_of_a_one_source_run_shows_its_data_path(tmp_path):
    step_dir = fabricate_checkpoint(tmp_path / "checkpoints", 4)
    one = MIXTURE.split("data:")[0] + "data: {path: data/stories.jsonl}\ntraining: {max_steps: 10}\n"
    (step_dir / "recipe.yaml").write_text(recipe_from_text(one, source="one.yaml").to_yaml())
    assert "data data/stories.jsonl, global batch 8" in inspect(step_dir)
    described = json.loads(inspect(step_dir, "--json"))
    assert described["recipe"]["data"] == "data/stories.jsonl" and described["complete"]
    assert "problem" not in described
    (step_dir / "recipe.yaml").write_text("[unreadable")
    assert "recipe (recipe.yaml unreadable)" in inspect(step_dir)
