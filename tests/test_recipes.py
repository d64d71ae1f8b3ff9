"""Shipped recipes and architectures: every recipe plans offline, the architecture table matches transformers,
and instruction and chat fine-tunes train end to end on 2 CPU ranks."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner
from conftest import read_metrics, run_cli, tiny_recipe

from accel_fsdp.cli import main
from accel_fsdp.config.shipped import shipped_recipes
from accel_fsdp.model.architectures import KNOWN, lookup


def paired_config(name: str) -> str:
    return re.search(r"Pair with:\s+accelerate_configs/(\w+)\.yaml", shipped_recipes()[name].read_text()).group(1)


@pytest.mark.parametrize("name", sorted(shipped_recipes()))
def test_every_shipped_recipe_dry_runs_offline(name):
    result = CliRunner().invoke(main, ["recipe", "run", name, "--dry-run", "--accelerate-config", paired_config(name),
                                       "--gpu-memory", "80GB"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "built on the meta device (no weights loaded)" in out
    assert re.search(r"FSDP units: \d+", out) and "per-rank memory (GiB)" in out
    assert re.search(r"^(fits|does NOT fit) in 80\.00 GiB per GPU", out, re.M), out  # a verdict, either way
    header = shipped_recipes()[name].read_text().split("\nname:")[0]
    for field in ("Hardware:", "Pair with:", "Run:", "Memory:"):
        assert field in header, f"{name}: header lacks {field}"


def test_gpt2_xl_dry_run_shows_48_gpt2block_units():
    out = CliRunner().invoke(main, ["recipe", "run", "gpt2-xl", "--dry-run", "--accelerate-config", "fsdp_2gpu",
                                    "--gpu-memory", "24GB"]).output
    assert re.search(r"^\s+48 x GPT2Block\s+30,740,800 params each", out, re.M), out
    assert "1,557,611,200 parameters" in out and "fits in 24.00 GiB" in out


def test_dry_run_says_when_it_does_not_fit():
    out = CliRunner().invoke(main, ["recipe", "run", "llama-3.1-8b", "--dry-run", "--accelerate-config", "fsdp_1gpu",
                                    "--gpu-memory", "80GB"]).output
    assert "does NOT fit in 80.00 GiB" in out and "try: " in out


def test_dry_run_names_a_local_data_file_this_machine_lacks_and_still_plans(tmp_path):
    args = ["recipe", "run", "quickstart", "--dry-run", "--set", f"data.path={tmp_path / 'elsewhere.jsonl'}"]
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 0, out.output
    assert "per-rank memory (GiB)" in out.output
    assert re.search(r"note: --set data.path: \S+elsewhere.jsonl is not on this machine", out.output), out.output
    assert "not on this machine" not in CliRunner().invoke(main, ["recipe", "run", "quickstart", "--dry-run"]).output


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_architecture_facts_match_transformers(name):
    from transformers import AutoConfig

    from accel_fsdp.model.build import count_parameters, meta_model
    from accel_fsdp.model.facts import facts_of

    arch = KNOWN[name]
    model = meta_model(AutoConfig.for_model(arch.model_type, **arch.config_kwargs()))
    assert count_parameters(model) == facts_of(arch).params()
    blocks = [m for m in model.modules() if type(m).__name__ == arch.block_class]
    assert len(blocks) == arch.layers
    assert sum(p.numel() for p in blocks[0].parameters()) == facts_of(arch).block_params()
    assert lookup(arch.hub_id) is arch and lookup(arch.hub_id + "-Instruct") is arch


def test_unknown_architecture_is_one_clear_message():
    result = CliRunner().invoke(main, ["recipe", "validate", "quickstart", "--set", "model.architecture=gpt5"])
    assert result.exit_code == 2
    assert "--set model.architecture: unknown architecture 'gpt5'" in result.output
    assert "llama-3.1-8b" in result.output


@pytest.mark.parametrize("suffix", [".csv", ".parquet", ".json", ".txt"])
def test_every_local_file_format_is_read(tmp_path, suffix):
    from accel_fsdp.config.recipe import recipe_from_text
    from accel_fsdp.data.sources import SourceReader

    texts = ["alice has a red cat .", "bob has a blue dog .", "the cat is happy ."]
    path = tmp_path / f"data{suffix}"
    if suffix == ".csv":
        path.write_text("text,other\n" + "".join(f"{t},1\n" for t in texts))
    elif suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": texts}), path)
    elif suffix == ".json":
        path.write_text(json.dumps([{"text": t} for t in texts]))
    else:
        path.write_text("\n\n".join(texts) + "\n")  # a .txt file: one document per paragraph
    r = recipe_from_text(f'model: {{architecture: gpt2}}\ndata: {{path: "{path}"}}\n', source="r.yaml")
    reader = SourceReader(r, r.data.resolved_sources()[0], 0).open()
    assert reader.count() == 3
    assert [row["text"].strip() for _, rows in reader.batches(2) for row in rows] == texts


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("fmt", ["instruction", "chat"])
def test_instruction_and_chat_fine_tunes_learn(tmp_path, tiny_gpt2, fmt):
    builtin = {"instruction": "quickstart-instruct", "chat": "quickstart-chat"}[fmt]
    recipe = tiny_recipe(tmp_path / f"{fmt}.yaml", tiny_gpt2, f"builtin:{builtin}",
                         data={"format": fmt, "seq_len": 128, "max_rows": 3000},
                         training={"max_steps": 40, "lr": 5e-3}, logging={"every_steps": 10})
    run = tmp_path / "run"
    proc = run_cli("recipe", "run", recipe, "--output-dir", run, check=0)
    losses = [r["loss"] for r in read_metrics(run) if r["kind"] == "train"]
    assert losses[-1] < 0.6 * losses[0], losses
    stats = re.search(r"^  data +builtin:quickstart-.*$", proc.stdout, re.M).group(0)
    assert "with loss" in stats
    # Only responses carry a loss: far fewer loss tokens than tokens.
    tokens, with_loss = map(lambda s: int(s.replace(",", "")), re.search(r"([\d,]+) tokens \(([\d,]+) with loss\)",
                                                                          stats).groups())
    assert with_loss < 0.5 * tokens
