"""The shipped recipes at a glance (`accel-fsdp recipe list`): name, model, parameter count, description.

Parameter counts come from the model facts (config arithmetic, tests/test_model_facts.py): listing imports neither
torch nor transformers, so it answers at once. A model the facts do not know shows "?" rather than being built.
"""

from __future__ import annotations

from accel_fsdp.config.recipe import load_recipe
from accel_fsdp.config.shipped import shipped_recipes
from accel_fsdp.errors import UserError
from accel_fsdp.model.checks import human_count
from accel_fsdp.model.facts import facts_for


def parameter_count(recipe) -> int | None:
    facts = facts_for(recipe)
    if facts is None:
        return None
    lora = recipe.model.lora
    return facts.params() + (facts.lora_params(lora.target_modules, lora.r) if lora.enabled else 0)


def recipe_rows() -> list[tuple[str, str, str, str]]:
    rows = [("NAME", "MODEL", "PARAMS", "DESCRIPTION")]
    for name, path in shipped_recipes().items():
        try:
            r = load_recipe(path)
        except UserError as e:  # a broken shipped recipe is a bug, but the listing must still show the others
            rows.append((name, "?", "?", f"(invalid: {e.problems[0]})"))
            continue
        model = r.model.name_or_path or f"{r.model.architecture} (from scratch)"
        n = parameter_count(r)
        rows.append((name, model, human_count(n) if n else "?", r.description))
    return rows
