"""Checks of the recipe against its model that need the model's structure but not its weights, on a `ModelView`:
built from the model facts (GPT-2, Llama: no torch, no transformers) or from the model built on the meta device
(everything else). The same checks run in `recipe validate`, before `recipe run` launches, and in every rank."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from accel_fsdp.errors import Problem, UserError


@dataclass(frozen=True)
class ModelView:
    """What the checks, `recipe list` and the reports need to know of a model."""

    class_name: str
    no_split_modules: list[str]
    """The model's own block class(es): the default FSDP unit."""
    module_classes: frozenset[str]
    linear_names: frozenset[str]
    """Leaf names of its Linear/Conv1D modules: what LoRA can target."""
    context: int | None
    params: int
    """All parameters, LoRA adapters included when the recipe enables them."""
    trainable: int


def view_from_facts(facts, recipe) -> ModelView:
    lora = recipe.model.lora
    adapters = facts.lora_params(lora.target_modules, lora.r) if lora.enabled else 0
    params = facts.params() + adapters
    return ModelView(facts.class_name, facts.no_split_modules, facts.module_classes, facts.linear_names,
                     facts.context, params, adapters if lora.enabled else params)


def context_problems(recipe, context: int | None) -> list[Problem]:
    """data.seq_len must fit in the model's context (position embeddings / rotary range)."""
    if context is not None and recipe.data.seq_len > context:
        return [Problem(recipe.where("data.seq_len"), f"{recipe.data.seq_len} exceeds the model's context length "
                        f"of {context} tokens", f"use at most {context}")]
    return []


def override_problems(recipe, config_class: str, known: frozenset[str] | set[str], overrides: dict) -> list[Problem]:
    """Every model.config_overrides key must be a setting of the model's config class: transformers would keep an
    unknown one as an inert attribute, so a typo (n_layers for n_layer) would silently train another model."""
    problems = []
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            problems.append(Problem(recipe.where(f"model.config_overrides.{key}"),
                                    f"{config_class} has no setting {key!r}, so it would be ignored",
                                    f"did you mean {close[0]}?" if close else
                                    f"use a key of {config_class} (see its documentation)"))
    return problems


def wrap_class_problems(settings, view: ModelView, recipe) -> list[Problem]:
    """A wrap class the model does not have would make FSDP wrap nothing (or Accelerate fail later)."""
    from accel_fsdp.launch_config import MODEL_DEFAULT

    classes = settings.wrap_classes.value
    if settings.wrap_policy.value != "TRANSFORMER_BASED_WRAP":
        return []
    if classes in ([MODEL_DEFAULT], []):  # nothing named: the model's own blocks, if it names them
        if view.no_split_modules:
            return []
        return [Problem(settings.wrap_classes.source, f"{view.class_name} does not name its transformer "
                        "block (_no_split_modules is empty), so there is no default wrap class",
                        "set fsdp.wrap_class in the recipe to the model's block class")]
    missing = [c for c in classes if c not in view.module_classes]
    if not missing:
        return []
    blocks = view.no_split_modules or sorted(c for c in view.module_classes if "Block" in c or "Layer" in c)
    source = settings.wrap_classes.source
    where = recipe.where("fsdp.wrap_class") if source.startswith("recipe") or source == "--set" else \
        f"{source}: fsdp_transformer_layer_cls_to_wrap"
    suggestion = blocks[0] if blocks else "the model's block class"
    return [Problem(where, f"wrap class {', '.join(missing)} is not in the model {view.class_name} "
                    f"(its transformer block is {', '.join(blocks) or 'unknown'})",
                    f"--set fsdp.wrap_class={suggestion} (or in the recipe: fsdp.wrap_class: {suggestion}), "
                    "or use an accelerate config that names no class (fsdp_cpu.yaml, fsdp_1gpu.yaml, fsdp_8gpu.yaml) "
                    "so the model's own _no_split_modules is used")]


def lora_target_problems(view: ModelView, recipe) -> list[Problem]:
    lora = recipe.model.lora
    missing = [t for t in lora.target_modules if t not in view.linear_names] if lora.enabled else []
    if not missing:
        return []
    return [Problem(recipe.where("model.lora.target_modules"), f"{', '.join(missing)} not found in {view.class_name}",
                    f"use some of its linear layers: {', '.join(sorted(view.linear_names))}")]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt", "tiktoken.model")


def tokenizer_files_problem(folder: Path) -> str | None:
    """A local folder without any vocabulary file: transformers 5 would build an empty tokenizer from it silently
    (one token, every text encoded as nothing; checked with 5.23.0)."""
    if Path(folder).is_dir() and not any((Path(folder) / name).exists() for name in TOKENIZER_FILES):
        return f"has no tokenizer files (none of {', '.join(TOKENIZER_FILES)})"
    return None


def raise_problems(problems: list[Problem]) -> None:
    if problems:
        raise UserError(problems)


def human_count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}" if n < 10 * div else f"{n / div:.1f}{unit}"
    return str(n)
