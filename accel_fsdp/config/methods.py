"""The training methods (`training.method`): the one list of their names, and what the floors below `train/` know of
each.

A method is a component. Its loss and how it evaluates live in `accel_fsdp/train/methods/<name>.py`, which
`train/methods/__init__.py` finds by the method's name; its line in `REGISTRY` below says what the recipe checks, the
planner and the start summary need without torch: whether it trains on preference pairs, which `preference.*` keys
its loss reads, whether it compares the policy with a reference model, its default beta, and whether it trains with
the model's dropout. The config floor cannot import `train/` (the floors go down only), so the list lives here, on the
lowest floor that needs it, and `train/` reads it. Adding a method is one new file under `train/methods/` and one line
here (tests/test_methods.py holds that the two agree).

This module must never import torch or anything above the config floor.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from accel_fsdp.errors import Problem


@dataclass(frozen=True, kw_only=True)
class MethodSpec:
    """What the config floor knows of one training method."""

    name: str
    """Its `training.method` value, and its module's name under train/methods/."""
    pairs: bool
    """Trains on preference pairs (data.format: preference): a unit is two sequences, chosen and rejected."""
    keys: tuple[str, ...] = ()
    """The `preference.*` keys (YAML spelling) it reads; any other set away from its default is refused."""
    reference: bool = False
    """Its loss compares the policy with a reference model (the starting weights; train/reference.py)."""
    default_beta: float | None = None
    """`preference.beta` when the recipe leaves it null."""
    dropout: bool = True
    """Trains with the model's dropout. Preference methods do not (unless `preference.keep_dropout`): a loss that
    compares log-probabilities of two answers (and, for DPO, with a reference computed without dropout) would be
    comparing dropout noise."""
    summary: str = ""
    """What it optimizes, in a few words (`recipe keys`, messages)."""

    @property
    def sequences_per_unit(self) -> int:
        """Sequences a training unit puts through the model: a pair is two."""
        return 2 if self.pairs else 1


REGISTRY = (
    MethodSpec(name="sft", pairs=False, summary="next-token prediction on the data"),
    MethodSpec(name="dpo", pairs=True, keys=("beta", "label_smoothing", "keep_dropout"), reference=True,
               default_beta=0.1, dropout=False, summary="DPO (Rafailov et al., 2023)"),
    MethodSpec(name="simpo", pairs=True, keys=("beta", "gamma", "label_smoothing", "keep_dropout"), default_beta=2.0,
               dropout=False, summary="SimPO (Meng et al., 2024)"),
    MethodSpec(name="orpo", pairs=True, keys=("lambda", "keep_dropout"), dropout=False,
               summary="ORPO (Hong et al., 2024)"),
)
METHODS = {spec.name: spec for spec in REGISTRY}
NAMES = tuple(METHODS)
"""The values of training.method (config/recipe.py types the key with them)."""
PAIR_METHODS = tuple(spec.name for spec in REGISTRY if spec.pairs)


def method_problems(recipe) -> list[Problem]:
    """`preference.*` keys set away from their defaults that the recipe's method does not read: a setting with no
    effect is refused, never silently ignored."""
    spec = METHODS.get(recipe.training.method)
    if spec is None:  # an unknown method is reported by the type check
        return []
    preference = recipe.preference
    defaults = type(preference)()
    readers = {}
    for other in REGISTRY:
        for key in other.keys:
            readers.setdefault(key, []).append(other.name)
    problems = []
    for f in fields(preference):
        key = f.metadata.get("key", f.name)
        value = getattr(preference, f.name)
        if key in spec.keys or value == getattr(defaults, f.name):
            continue
        who = readers.get(key, [])
        fix = (f"remove preference.{key} (or set it back to {_as_yaml(getattr(defaults, f.name))}), or use "
               f"training.method: {' or '.join(who)}" if who else f"remove preference.{key}")
        problems.append(Problem(recipe.where(f"preference.{key}"),
                                f"{_as_yaml(value)} has no effect with training.method {spec.name} (only "
                                f"{', '.join(who) or 'no method'} read{'s' if len(who) == 1 else ''} it)", fix))
    return problems


def _as_yaml(value) -> str:
    """A value as the recipe writes it: null, true, 0.1."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def trains_with_dropout(recipe) -> bool:
    """The model's dropout stays on: the method trains with it, or the recipe asks for it (preference.keep_dropout)."""
    return METHODS[recipe.training.method].dropout or recipe.preference.keep_dropout
