"""The shipped recipes at a glance (`accel-fsdp recipe list`): name, model, parameter count, description.

Parameter counts come from the known architectures table or a meta-device model: no download, no memory.
"""

from __future__ import annotations

from accel_fsdp import architectures
from accel_fsdp.errors import UserError
from accel_fsdp.model import count_parameters, human_count, meta_model, model_config
from accel_fsdp.paths import shipped_recipes
from accel_fsdp.recipe import load_recipe


def parameter_count(recipe) -> int | None:
    m = recipe.model
    arch = architectures.lookup(m.architecture or m.name_or_path)
    if arch is not None and not m.config_overrides:
        return arch.param_count()
    from accel_fsdp.preflight import offline_tokenizer

    config = model_config(recipe, tokenizer=offline_tokenizer(recipe), offline=True)
    return count_parameters(meta_model(config)) if config is not None else None


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
