"""Mixtures of datasets through the real CLI: the shipped quickstart-mix trains both sources by weight, a mixture
resumes exactly from 2 ranks to 1, a changed mixture is refused on resume, every mistake in a mixture is one message,
and the data can be prepared ahead of a run and looked into."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from click.testing import CliRunner
from conftest import (REPO, TRACE_UNITS, read_metrics, run_cli, run_in_process, tiny_recipe, units_by_step,
                      write_jsonl)

from accel_fsdp.cli import main
from accel_fsdp.config.shipped import shipped_recipes

MIX = {"sources": [{"name": "stories", "path": "builtin:quickstart", "weight": 0.7},
                   {"name": "questions", "path": "builtin:quickstart-instruct", "format": "instruction",
                    "weight": 0.3}],
       "path": "", "seq_len": 64, "eval_fraction": 0.02}


def mix_recipe(folder, tiny_gpt2, **sections):
    data = dict(MIX, **sections.pop("data", {}))
    return tiny_recipe(folder / "mix.yaml", tiny_gpt2, "unused", data=data, **sections)


def user_error(*args) -> str:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 2, result.output
    return result.output


# ------------------------------------------------------------------------------------------- mistakes


@pytest.mark.parametrize("change,expected", [
    ({"sources": [{"path": "builtin:quickstart", "weight": 0}]}, "data.sources.0.weight: 0.0 (source 'quickstart') "
                                                                 "must be positive"),
    ({"sources": [{"path": "builtin:quickstart"}, {"path": "builtin:quickstart", "weight": 2}]},
     "sources 0, 1 are all named 'quickstart'"),
    ({"mix_by": "bytes"}, "data.mix_by: expected one of tokens, rows, found 'bytes'"),
    ({"path": "builtin:quickstart"}, "both data.path ('builtin:quickstart') and data.sources (2 entries) are set"),
])
def test_a_mistake_in_a_mixture_is_one_message_and_writes_nothing(tmp_path, tiny_gpt2, change, expected):
    recipe = mix_recipe(tmp_path, tiny_gpt2, data=change)
    msg = user_error("recipe", "run", recipe, "--output-dir", tmp_path / "run")
    assert expected in msg and msg.count("error:") == 1
    assert not (tmp_path / "run").exists()


def test_a_source_without_rows_is_named(tmp_path, tiny_gpt2):
    empty = write_jsonl(tmp_path / "blank.jsonl", [{"text": "   "}, {"text": ""}])
    recipe = mix_recipe(tmp_path, tiny_gpt2, data={"sources": MIX["sources"] + [{"path": str(empty), "weight": 0.1}]})
    msg = user_error("recipe", "run", recipe, "--output-dir", tmp_path / "run")
    assert "data.sources.2.path: " in msg and "blank.jsonl has no non-empty training rows" in msg
    assert "remove the source from the mixture" in msg and not (tmp_path / "run").exists()


def test_a_bad_row_of_one_source_names_its_file_line_and_key(tmp_path, tiny_gpt2):
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"conversation": []}])
    recipe = mix_recipe(tmp_path, tiny_gpt2,
                        data={"sources": MIX["sources"] + [{"path": str(chat), "format": "chat", "weight": 0.1}]})
    msg = user_error("recipe", "validate", recipe)
    assert ("data.messages_field: " in msg
            and "chat.jsonl line 1: has no field 'messages' (its fields: conversation)" in msg)


# ------------------------------------------------------------------------------------ prepare and show


def test_data_prepare_builds_what_the_run_reads_once_and_show_marks_the_loss(tmp_path, tiny_gpt2, monkeypatch):
    monkeypatch.setenv("ACCEL_FSDP_CACHE", str(tmp_path / "cache"))
    recipe = mix_recipe(tmp_path, tiny_gpt2)
    first = CliRunner().invoke(main, ["data", "prepare", str(recipe)])
    assert first.exit_code == 0, first.output
    assert first.output.count("tokenized in") == 2 and "bytes per token" in first.output
    assert "stories (text, builtin:quickstart)" in first.output
    assert "weight 0.70 of the mixture by tokens" in first.output
    tables = sorted((tmp_path / "cache" / "tokenized").glob("*/stats.json"))
    stamps = [p.stat().st_mtime_ns for p in tables]
    # validate (what `recipe run` runs before launching) and a second prepare find it all in the cache
    assert CliRunner().invoke(main, ["recipe", "validate", str(recipe)]).exit_code == 0
    again = CliRunner().invoke(main, ["data", "prepare", str(recipe)])
    assert again.output.count("already in the cache") == 2
    assert [p.stat().st_mtime_ns for p in sorted((tmp_path / "cache" / "tokenized").glob("*/stats.json"))] == stamps
    shown = CliRunner().invoke(main, ["data", "show", str(recipe), "--sequences", "6", "--no-color",
                                      "--plot", str(tmp_path / "lengths.png")])
    assert shown.exit_code == 0, shown.output
    assert "step 0 slot 0: " in shown.output and "questions sequence" in shown.output
    assert "<assistant>\u00ab" in shown.output and "<end>\u00bb" in shown.output  # only the answers carry a loss
    assert (tmp_path / "lengths.png").stat().st_size > 1000


@pytest.mark.slow
def test_two_builders_of_one_shared_cache_build_it_once(tmp_path, tiny_gpt2):
    """Two machines preparing into one cache folder (a shared filesystem): one builds, the other waits and reads
    it. A folder left without its stats.json (a half-written cache) is never read: it is built again."""
    recipe = mix_recipe(tmp_path, tiny_gpt2)
    env = dict(__import__("os").environ, ACCEL_FSDP_CACHE=str(tmp_path / "shared"))
    procs = [subprocess.Popen([sys.executable, "-m", "accel_fsdp", "data", "prepare", str(recipe)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sum(o.count("tokenized in") for o in outs) == 2 and sum(o.count("already in the cache") for o in outs) == 2
    stats = next((tmp_path / "shared" / "tokenized").glob("*/stats.json"))
    stats.unlink()  # as a build killed before its last write would leave it (were it not built under a temporary name)
    rebuilt = run_in_process("data", "prepare", recipe, env={"ACCEL_FSDP_CACHE": str(tmp_path / "shared")}, check=0).stdout
    assert rebuilt.count("tokenized in") == 1 and stats.exists()


# ---------------------------------------------------------------------------------------- training


@pytest.mark.slow
@pytest.mark.multiprocess
def test_quickstart_mix_trains_both_sources_by_weight_and_evaluates_each(tmp_path):
    recipe = shipped_recipes()["quickstart-mix"]
    run = tmp_path / "run"
    proc = run_cli("recipe", "run", recipe, "--output-dir", run, "--set", "training.max_steps=24",
                   "--set", "training.warmup_steps=2", "--set", "training.eval_every_steps=12",
                   "--set", "logging.every_steps=1", "--set", "logging.sample_prompt=null",
                   "--set", "checkpoint.every_steps=null", check=0)
    assert "a mixture of 2 sources by tokens" in proc.stdout
    assert "stories          0.70 of the mixture, about" in proc.stdout and "questions        0.30" in proc.stdout
    rows = read_metrics(run)
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 24 and all(set(r["source_tokens"]) == {"stories", "questions"} for r in train)
    totals = {n: sum(r["source_tokens"][n] for r in train) for n in ("stories", "questions")}
    # 24 steps of 32 sequences: a share within two sequences' tokens (127 each at most) of the weight
    assert abs(totals["stories"] / sum(totals.values()) - 0.7) <= 2 * 127 / sum(totals.values())
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [12, 24]
    by_source = evals[-1]["eval_loss_by_source"]
    assert set(by_source) == {"stories", "questions"}
    # the mixture's held-out loss: each source's, weighted by its share (exact arithmetic on what was logged)
    assert evals[-1]["eval_loss"] == pytest.approx(0.7 * by_source["stories"] + 0.3 * by_source["questions"],
                                                   rel=1e-12)
    assert train[-1]["loss"] < train[0]["loss"] - 1.0


@pytest.mark.parametrize("mix_by", ["tokens", "rows"])
def test_eval_loss_weights_each_source_by_its_share_of_what_the_training_loss_averages(tmp_path, mix_by):
    """The training loss is a mean over the global batch's loss-carrying tokens: with mix_by tokens a source's share of
    them is its weight; with rows it is weight x mean tokens per sequence, normalized (its realized token share)."""
    import numpy as np

    from accel_fsdp.config.recipe import load_recipe
    from accel_fsdp.data.prepare import prepare_data
    from accel_fsdp.data.synthetic import build_tokenizer
    from accel_fsdp.train.evaluate import loss_shares, mixture_loss
    from accel_fsdp.train.methods.sft import NextToken
    from accel_fsdp.train.reference import NoReference

    short = write_jsonl(tmp_path / "short.jsonl", [{"text": "alice has a cat ."}] * 40)
    long = write_jsonl(tmp_path / "long.jsonl", [{"text": "bob has a dog . " * 6}] * 40)
    recipe = load_recipe(tiny_recipe(tmp_path / "r.yaml", "unused", "unused", model={"architecture": "gpt2",
                                     "name_or_path": None, "tokenizer": "builtin:quickstart"},
                                     data={"path": "", "mix_by": mix_by, "packing": False, "sources": [
                                         {"name": "short", "path": str(short), "weight": 0.75},
                                         {"name": "long", "path": str(long), "weight": 0.25}]}))
    data = prepare_data(recipe, build_tokenizer())
    tokens = {s.name: float(np.mean(s.train.labels)) for s in data.sources}
    assert tokens["long"] > 4 * tokens["short"]  # what makes rows and tokens differ
    shares = {name: share["tokens"] for name, share in loss_shares(data, NextToken(NoReference(), loss_path=None)).items()}
    if mix_by == "tokens":
        expected = {"short": 0.75, "long": 0.25}
    else:
        total = 0.75 * tokens["short"] + 0.25 * tokens["long"]
        expected = {"short": 0.75 * tokens["short"] / total, "long": 0.25 * tokens["long"] / total}
    assert shares == pytest.approx(expected, rel=1e-12)
    held = {"short": {"loss": 30.0, "tokens": 10.0}, "long": {"loss": 100.0, "tokens": 50.0}}  # 3.0 and 2.0 a token
    loss = mixture_loss(NextToken.eval_terms, held, loss_shares(data, NextToken(NoReference(), loss_path=None)))
    assert loss == pytest.approx(3.0 * expected["short"] + 2.0 * expected["long"], rel=1e-12)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_mixture_resumes_exactly_from_two_ranks_to_one_and_refuses_a_changed_mixture(tmp_path, tiny_gpt2):
    recipe = mix_recipe(tmp_path, tiny_gpt2, training={"max_steps": 8, "micro_batch_size": 2, "global_batch_size": 8,
                                                       "mixed_precision": "fp32"},
                        checkpoint={"every_steps": 4, "keep_last": None})
    two = tmp_path / "two"
    run_cli("recipe", "run", recipe, "--output-dir", two, env=TRACE_UNITS, check=0)
    state = json.loads((two / "checkpoints" / "step-000004" / "trainer_state.json").read_text())
    assert state["data"]["step"] == 4 and len(state["data"]["units"]) == 2 and sum(state["data"]["units"]) == 32
    one = tmp_path / "one"
    proc = run_cli("recipe", "run", recipe, "--output-dir", one, "--resume-from", two / "checkpoints" / "step-000004",
                   "--accelerate-config", "fsdp_1gpu", "--cpu", "--set", "training.micro_batch_size=8", env=TRACE_UNITS,
                   check=0)
    assert "at step 4" in proc.stdout
    expected = {s: units for s, units in units_by_step(two).items() if s > 4}
    assert units_by_step(one) == expected and sorted(expected) == [5, 6, 7, 8]
    tokens = {r["step"]: r["source_tokens"] for r in read_metrics(two) if r["kind"] == "train"}
    assert all(tokens[r["step"]] == r["source_tokens"] for r in read_metrics(one) if r["kind"] == "train")
    changed = run_in_process("recipe", "run", recipe, "--output-dir", tmp_path / "changed", "--resume-from",
                             two / "checkpoints" / "step-000004", "--set", "data.sources.1.weight=0.5")
    assert changed.returncode == 2, changed.stderr[-2000:]
    assert "data.sources.1.weight: checkpoint has 0.3, this run has 0.5" in changed.stderr
    assert yaml.safe_load((two / "recipe.yaml").read_text())["data"]["sources"][1]["weight"] == 0.3
