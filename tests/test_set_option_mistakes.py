"""`--set` given wrong: without '=' or a key, a list or mapping cut short, a whole section set to null. Each is one
message naming the --set argument and the fix, exit status 2; none is read as
something else (a cut-short list as a string, a null section as "the defaults"). In-process, through the real CLI
for what the option itself checks. A key given twice with two values is no mistake: the later wins, said in a
note."""

from __future__ import annotations

import pytest
from conftest import cli, user_error

from accel_fsdp.config.recipe import recipe_from_text
from accel_fsdp.errors import UserError

RECIPE = """
model: {architecture: gpt2, tokenizer: "builtin:quickstart", lora: {enabled: false}}
data: {path: "builtin:quickstart"}
training: {micro_batch_size: 2, global_batch_size: 16, max_steps: 4}
"""


def problems_of(overrides: list[str]) -> str:
    with pytest.raises(UserError) as e:
        recipe_from_text(RECIPE, source="r.yaml", overrides=overrides)
    return e.value.format_message()


@pytest.mark.parametrize("item,expected", [
    ("training.lr", "--set training.lr: expected dotted.key=value (no '=')"),
    ("=3", "--set =3: expected dotted.key=value (no key)"),
    (".lr=3", "--set .lr=3: expected dotted.key=value (an empty part in '.lr')"),
    ("training.=3", "--set training.=3: expected dotted.key=value (an empty part in 'training.')"),
])
def test_an_override_without_a_whole_key_says_how_to_write_one(item, expected):
    msg = problems_of([item])
    assert expected in msg and "fix: write the dotted key, '=' and the value" in msg, msg


@pytest.mark.parametrize("item,expected", [
    ("model.lora.target_modules=[q_proj, v_proj", "--set model.lora.target_modules: '[q_proj, v_proj' is not a "
     "complete YAML list (expected ',' or ']'"),
    ("training={lr: 1e-4", "--set training: '{lr: 1e-4' is not a complete YAML mapping"),
    ("data.sources=[{path: a.jsonl", "--set data.sources: '[{path: a.jsonl' is not a complete YAML list"),
])
def test_a_list_or_mapping_cut_short_is_refused_not_read_as_text(item, expected):
    msg = problems_of([item])
    assert expected in msg and "fix: close its brackets, and quote the whole argument for the shell" in msg, msg


def test_text_that_is_not_yaml_stays_text():
    r = recipe_from_text(RECIPE, source="r.yaml", overrides=["logging.sample_prompt=Q: what is it? A:"])
    assert r.logging.sample_prompt == "Q: what is it? A:"


def test_a_section_set_to_null_is_refused_not_reset_to_its_defaults():
    msg = problems_of(["training=null"])
    assert "--set training: is a section; null would drop every key the recipe sets in it" in msg, msg
    assert "fix: set the keys you mean, e.g. --set training.KEY=VALUE" in msg
    # a mapping-valued key is not a section: null is a wrong type, and the fix shows the empty mapping
    msg = problems_of(["model.config_overrides=null"])
    assert "expected a mapping, found null" in msg and "to a mapping (`{}` for none)" in msg, msg


def test_a_key_given_twice_with_two_values_takes_the_later_and_says_so_in_every_command():
    """Flags composed from a script's base and one run's change: the later value wins, as in argparse and OmegaConf,
    and one note says so (the note is what keeps it from being silent)."""
    twice = ["--set", "training.max_steps=10", "--set", "training.max_steps=20"]
    for command in (["recipe", "validate", "quickstart"], ["data", "show", "quickstart"]):
        code, out = cli(*command, *twice)
        assert code == 0, out
        assert "note: --set training.max_steps is given 2 times ('10', '20'): the last, '20', is used" in out, out
    assert "the run's 20 optimizer steps" in cli("recipe", "validate", "quickstart", *twice)[1]


def test_a_key_given_twice_with_one_value_is_the_same_setting():
    code, out = cli("recipe", "validate", "quickstart", "--set", "training.max_steps=20",
                    "--set", "training.max_steps=20")
    assert code == 0, out


def test_preference_keys_of_another_method_name_their_defaults_as_yaml_writes_them():
    msg = problems_of(["preference.keep_dropout=true"])
    assert "--set preference.keep_dropout: true has no effect with training.method sft" in msg, msg
    assert "(or set it back to false)" in msg
    msg = problems_of(["preference.beta=0.3"])
    assert "(or set it back to null)" in msg, msg


def test_slurm_refuses_two_global_batches(tmp_path):
    msg = user_error("slurm", "quickstart", "--nodes", "2", "--gpus-per-node", "4", "--global-batch-size", "64",
                     "--set", "training.global_batch_size=32", "-o", tmp_path / "job.sbatch")
    assert "--global-batch-size: 64 and --set training.global_batch_size=32 both set the global batch" in msg
    assert not (tmp_path / "job.sbatch").exists()


def test_a_tool_composing_overrides_hands_each_key_on_once_its_own_value_last():
    """bench and verify add their own --set items after the user's; the `recipe run` they start sees each key once,
    so the note for a user's key given twice is not said for a tool's own value."""
    from accel_fsdp.config.binder import later_wins

    items = ["training.max_steps=50", "training={lr: 1e-3}", "data.max_rows=9", "training.max_steps=2", "bad"]
    assert later_wins(items) == ["training={lr: 1e-3}", "data.max_rows=9", "training.max_steps=2", "bad"]


@pytest.mark.parametrize("item,expected,unexpected", [
    ("data.sources=[{path: a.jsonl", "fix: close its brackets, and quote the whole argument for the shell: "
     "--set 'data.sources=[{path: ...}, {path: ...}]'", "no data given"),
    ("data.sources=[a.jsonl, b.jsonl]", "--set data.sources.0: expected a mapping of keys, found 'a.jsonl'\n"
     "      fix: write each entry of data.sources as a mapping of keys, e.g. {path: ...}", "are all named"),
    ("data.sources=a.jsonl", "--set data.sources: expected a list of Source entries, found 'a.jsonl'", "no data given"),
])
def test_a_mixture_written_wrong_is_one_problem_per_mistake(item, expected, unexpected):
    msg = problems_of(["data.path=", item])
    assert expected in msg and unexpected not in msg, msg
