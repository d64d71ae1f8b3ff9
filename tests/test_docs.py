"""README.md is the contract: its commands name real recipes, configs and options, and CI runs its test command."""

from __future__ import annotations

import re
import shlex

import click
from click.testing import CliRunner
from conftest import REPO
from test_help_examples_parse import leaf_context

from accel_fsdp.cli import main
from accel_fsdp.config.shipped import shipped_accelerate_configs, shipped_recipes

README = (REPO / "README.md").read_text()


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    return [line.split("#")[0].strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_ci_runs_the_readme_test_command():
    test_command = next(c for c in readme_commands() if "pytest" in c)
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == test_command
    assert "torch==2.13.0" in (REPO / ".ci" / "run").read_text()
    install = next(c for c in readme_commands() if c.startswith("pip install"))
    assert "torch==2.13.0" in install and '-e ".[dev]"' in install


def assert_parses_and_names_shipped_files(where: str, words: list[str]) -> None:
    """`accel-fsdp WORDS...` parses as written (every option and value, as the CLI reads them) and names shipped
    recipes and configs where it names one."""
    try:
        params = leaf_context(words[1:]).params
    except click.UsageError as e:
        raise AssertionError(f"{where}: {shlex.join(words)}: {e.format_message()}") from None
    for key in ("name_or_path", "name"):
        if params.get(key) and not params[key].endswith(".yaml"):
            assert params[key] in shipped_recipes(), (where, words)
    if params.get("accelerate_config"):
        assert params["accelerate_config"] in shipped_accelerate_configs(), (where, words)


def test_readme_accel_fsdp_commands_parse_and_name_shipped_files():
    found = 0
    for command in readme_commands():
        if not command.startswith(("accel-fsdp", "accelerate launch")):
            continue
        found += 1
        words = shlex.split(command)
        if words[0] == "accelerate":
            config = words[words.index("--config_file") + 1]
            assert (REPO / config).exists(), command
            words = ["accel-fsdp"] + words[words.index("accel_fsdp") + 1:]
        assert_parses_and_names_shipped_files("README.md", words)
    assert found >= 20, found


def test_every_docs_command_parses_and_names_shipped_files():
    """docs/*.md's `accel-fsdp` lines, as README's ($BATCH and $SMALL: PERFORMANCE.md's own abbreviations, spelled out
    there)."""
    performance = (REPO / "docs" / "PERFORMANCE.md").read_text()
    batch = re.search(r"`\$BATCH` = `(.*?)`", performance, re.S).group(1)
    small = re.search(r"\*\*small\*\* = the same with `(.*?)`", performance, re.S).group(1)
    found = 0
    for doc in sorted((REPO / "docs").glob("*.md")):
        for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), re.S):
            for line in block.splitlines():
                line = re.sub(r"^(\w+=\S+\s+)+", "", line.split("#")[0].strip())  # VAR=value accel-fsdp ...
                if line.startswith("accel-fsdp "):
                    found += 1
                    assert_parses_and_names_shipped_files(
                        doc.name, shlex.split(line.replace("$SMALL", f"{small} $BATCH").replace("$BATCH", batch)))
    assert found >= 20, found


def test_readme_lists_every_shipped_config():
    for name in shipped_accelerate_configs():
        assert f"`{name}`" in README, name


def test_recipe_key_table_is_current():
    table = CliRunner().invoke(main, ["recipe", "keys", "--markdown"]).output
    assert table.strip() in (REPO / "docs" / "RECIPES.md").read_text(), "regenerate: accel-fsdp recipe keys --markdown"


def test_architecture_names_every_module_of_the_tree():
    """docs/ARCHITECTURE.md draws the package tree: every module is in it, under its folder, and nothing else is."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    tree = text[text.index("```\naccel_fsdp/"):text.index("```", text.index("```\naccel_fsdp/") + 4)]
    named, folder = set(), ""
    for line in tree.splitlines()[2:]:
        m = re.match(r"  ([a-z0-9_]+/|[a-z0-9_]+\.py)", line)
        if m and m.group(1).endswith("/"):
            folder = m.group(1)
        elif m:
            folder = ""
            named.add(m.group(1))
        named |= {folder + name for name in re.findall(r"\b((?:[a-z0-9_]+/)*[a-z0-9_]+\.py)\b", line)
                  if not line.startswith(f"  {name}")}  # a module of a subfolder is named with it: methods/dpo.py
    modules = {str(p.relative_to(REPO / "accel_fsdp")) for p in (REPO / "accel_fsdp").rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py")}
    assert modules - named == set(), "modules the architecture drawing leaves out"
    assert named - modules == set(), "names in the drawing that are not modules"


def test_memory_doc_qlora_table_is_what_estimate_answers():
    """docs/MEMORY.md's QLoRA table says what `accel-fsdp estimate` answers for each shipped recipe: every figure of
    each row is the row of that strategy in the estimate's own table (it went stale once when the chunked loss
    changed the activations)."""
    text = (REPO / "docs" / "MEMORY.md").read_text()
    rows = re.findall(r"^\| (llama-\S+)(?: \(bf16 base\))?, (\d) x (\d+) GB(?: \((\w+)\))? +\| ([\d.]+) +\| ([\d.]+) +\| "
                      r"([\d.]+) +\| ([\d.]+) +\| (yes|no)(?:; with CPU offload ([\d.]+))?", text, re.M)
    assert len(rows) == 4, rows
    for recipe, gpus, memory, strategy, params, gathered, activations, total, fits, offloaded in rows:
        out = CliRunner().invoke(main, ["estimate", recipe, "--gpus", gpus, "--gpu-memory", f"{memory}GB"]).output
        table = {line[:27].strip(): line[27:].split() for line in out.splitlines() if line[:1].isupper()}
        # strategy: params grads optim gathered activ. GPU-total CPU fits
        row = table[strategy or "FULL_SHARD"]
        assert [row[0], row[3], row[4], row[5], row[7]] == [params, gathered, activations, total, fits], (recipe, out)
        if offloaded:
            assert table[f"{strategy or 'FULL_SHARD'} + offload"][5] == offloaded, (recipe, out)


def test_readme_metrics_table_names_every_key_a_row_has():
    """README's `metrics.jsonl` table says "each key, exactly": the keys of its first column, with the startup row's
    named after it, are the fields of the rows the loop writes (train/metrics.py), `kind` included; docs/PREFERENCE.md's
    table, the pair statistics a preference run adds."""
    from dataclasses import fields

    from accel_fsdp.train.metrics import ROW_TYPES, PairStatistics

    section = README[README.index("## What a run logs"):README.index("## Plan, measure, scale out")]
    table = {key for line in section.splitlines() if line.startswith("| `")
             for key in re.findall(r"`(\w+)`", line.split(" | ")[0])}
    startup = set(re.findall(r"`(\w+_s)`", section[section.index("A `startup` row"):]))
    written = {f.name for row in ROW_TYPES.values() for f in fields(row)} - {"preference"}  # PREFERENCE.md's keys
    assert table | startup == written
    preference = (REPO / "docs" / "PREFERENCE.md").read_text()
    section = preference[preference.index("## What a run reports"):preference.index("## In the code")]
    table = {key for line in section.splitlines() if line.startswith("| `")
             for key in re.findall(r"`(\w+)`", line.split(" | ")[0])}
    assert table == {"loss", *PairStatistics.names()}


def test_verify_doc_states_quickstarts_equivalence_tolerance():
    """docs/VERIFY.md's fp32 equivalence tolerance for quickstart: a step's, and the 2 steps' that verify prints."""
    from accel_fsdp.config.recipe import load_recipe
    from accel_fsdp.config.shipped import resolve_recipe
    from accel_fsdp.tools.noise import equivalence_tolerance

    text = (REPO / "docs" / "VERIFY.md").read_text()
    step, both = re.search(r"\(([\d.e-]+) for quickstart; ([\d.e-]+) over its 2 steps", text).groups()
    t = (recipe := load_recipe(resolve_recipe("quickstart"))).training
    tokens = t.global_batch_size * recipe.data.seq_len
    assert round(equivalence_tolerance("fp32", tokens, 1, 1)["loss"], 6) == float(step)  # as written: 2 digits
    assert round(equivalence_tolerance("fp32", tokens, 1, 2)["loss"], 5) == float(both)
