"""The data a run reads is the data that was checked: cache tables carry CRC-32s and a damaged entry is built again
(or refused with its path), preference pairs that prefer nothing are found by their tokens, a setting that would
change nothing is refused, one huge line is refused with its file and line before it reaches the encoder, a slow build
on one rank is waited for without a collective timeout, Ctrl-C leaves no half-written cache, and a resume notices a
source that changed since its checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import REPO, WallClockBound, run_cli, run_in_process, tiny_recipe, write_jsonl

from accel_fsdp.cli.main import main
from accel_fsdp.config.recipe import recipe_from_text
from accel_fsdp.data.prepare import load_data, prepare_data
from accel_fsdp.data.synthetic import build_tokenizer
from accel_fsdp.errors import UserError


@pytest.fixture()
def cache(tmp_path, monkeypatch) -> Path:
    """A cache of this test's own: its damage reaches no other test."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("ACCEL_FSDP_CACHE", str(folder))
    return folder


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def recipe(path="builtin:quickstart-instruct", fmt="instruction", **data):
    values = {"path": path, "format": fmt, "seq_len": 128, "eval_fraction": 0.1, "max_rows": 300, **data}
    return recipe_from_text(f"""
model: {{architecture: gpt2, tokenizer: "builtin:quickstart"}}
data: {json.dumps({k: v for k, v in values.items() if v is not None})}
training: {{micro_batch_size: 2, global_batch_size: 4, max_steps: 3, method: {"dpo" if fmt == "preference" else "sft"}}}
""", source="r.yaml")


def flip(path: Path) -> None:
    """Damage a file in place, its size unchanged (what a bad disk sector or a stray write does)."""
    raw = bytearray(path.read_bytes())
    middle = len(raw) // 2
    raw[middle:middle + 3] = bytes(b ^ 0xFF for b in raw[middle:middle + 3])
    path.write_bytes(bytes(raw))


# ------------------------------------------------------------------------------------------------ checksums


@pytest.mark.parametrize("split,name", [("train", "tokens.bin"), ("train", "documents.bin"),
                                        ("train", "sequences.bin"), ("train", "labels.bin"), ("train", "mask.bin"),
                                        ("eval", "tokens.bin")])
def test_a_table_damaged_in_place_is_built_again_with_a_line_saying_so(cache, tok, capfd, split, name):
    first = prepare_data(recipe(), tok)
    folder = first.sources[0].folder
    tokens = np.array(first.sources[0].train.tokens)
    flip(folder / split / name)
    again = prepare_data(recipe(), tok)
    err = capfd.readouterr().err
    assert f"the cache entry {folder} is damaged ({split}/{name} changed since it was written" in err
    assert again.sources[0].built and np.array_equal(np.array(again.sources[0].train.tokens), tokens)


@pytest.mark.parametrize("damage,expected", [
    (lambda f: (f / "stats.json").write_text('{"rows_read": "many"'), "stats.json is unreadable"),
    (lambda f: __import__("shutil").rmtree(f / "eval"), "eval/table.json is unreadable"),
])
def test_damaged_stats_or_a_missing_held_out_table_are_built_again_never_read_as_no_evaluation(cache, tok, capfd,
                                                                                              damage, expected):
    folder = prepare_data(recipe(), tok).sources[0].folder
    damage(folder)
    again = prepare_data(recipe(), tok)
    assert expected in capfd.readouterr().err
    assert again.sources[0].built and again.sources[0].units("eval") == 30


def test_a_rank_that_only_reads_the_cache_names_a_damaged_entry(cache, tok):
    folder = prepare_data(recipe(), tok).sources[0].folder
    (folder / "train" / "labels.bin").write_bytes(b"\0" * 7)
    with pytest.raises(UserError, match=r"the prepared data of quickstart-instruct is missing or damaged "
                                        r"\(train/labels.bin is 7 bytes where table.json says"):
        load_data(recipe(), tok)


def test_checking_a_100_mb_table_costs_a_fraction_of_a_second(tmp_path):
    from accel_fsdp.data.store import TableWriter, table_damage

    writer = TableWriter(tmp_path / "t", dtype=np.dtype(np.uint16), masked=False, seq_len=1024, packing="stream")
    rng = np.random.default_rng(0)
    for _ in range(50):
        writer.add([(rng.integers(0, 50000, 1 << 20), None)])
    writer.close()
    bound = WallClockBound(5)  # measured 0.05-0.1 s on 2 cores
    assert table_damage(tmp_path / "t", checksums=True) is None
    bound.check("checking a 100 MB table")


# ----------------------------------------------------------------------------------- pairs without a signal


def byte_level_tokenizer():
    """A byte-level BPE tokenizer (as GPT-2's): whitespace is a token of its own, so answers that differ in it alone
    are different tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["alice has a red cat .", "bob has a dog ."] * 20, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


def pairs(n: int, silent: dict[int, tuple[str, str]]) -> list[dict]:
    rows = [{"prompt": f"who has the cat {i} ?", "chosen": "alice has a red cat .", "rejected": "bob has a dog ."}
            for i in range(n)]
    for i, (chosen, rejected) in silent.items():
        rows[i].update(chosen=chosen, rejected=rejected)
    return rows


SILENT = {3: ("alice has a red cat .", "alice has a red cat ."),    # the same
          7: ("alice has a red cat .", "alice  has a red cat . "),  # whitespace alone
          11: ("alice has a red cat .", "alice has a red cat .\n")}


@pytest.mark.parametrize("tokenizer", ["word-level", "byte-level"])
def test_a_few_pairs_without_a_preference_are_skipped_counted_and_warned(tmp_path, cache, tokenizer):
    tok = build_tokenizer() if tokenizer == "word-level" else byte_level_tokenizer()
    path = write_jsonl(tmp_path / "p.jsonl", pairs(40, SILENT))
    r = recipe(str(path), "preference", eval_fraction=0, max_rows=None)
    stats = prepare_data(r, tok).stats.sources[0]
    assert (stats.no_signal_pairs, stats.train_rows, stats.no_signal_lines) == (3, 37, [4, 8, 12])
    assert "3 pairs without a preference skipped" in stats.summary()
    (warning,) = [w for w in stats.warnings(128) if "prefer nothing" in w]
    assert warning.startswith("3 pairs (rows 4, 8, 12) have a chosen and a rejected answer that are the same")


def test_a_corpus_of_mostly_pairs_without_a_preference_is_refused_naming_the_first(tmp_path, cache):
    path = write_jsonl(tmp_path / "p.jsonl", pairs(4, {1: SILENT[7], 2: SILENT[7], 3: SILENT[3]}))
    with pytest.raises(UserError, match=r"p.jsonl line 2: the chosen and the rejected answer are the same but for "
                                        r"whitespace \(3 of 4 pairs are so: they prefer nothing\)"):
        prepare_data(recipe(str(path), "preference", eval_fraction=0, max_rows=None), byte_level_tokenizer())


# -------------------------------------------------------------------------------- settings without effect


@pytest.mark.parametrize("sets,expected", [
    (["data.split=validation"], "--set data.split: 'validation' has no effect: it chooses among a hub dataset's "
                                "splits, and the data is "),
    (["data.hub_config=wikitext-2-raw-v1"], "--set data.hub_config: 'wikitext-2-raw-v1' has no effect"),
    (["data.text_field=content"], "--set data.text_field: 'content' has no effect: no source of format text reads "
                                  "it (preference reads prompt_field, chosen_field, rejected_field)"),
])
def test_a_data_setting_that_would_change_nothing_is_refused(tmp_path, sets, expected):
    data = write_jsonl(tmp_path / "p.jsonl", pairs(40, {}))
    args = ["recipe", "validate", "quickstart-dpo", "--set", f"data.path={data}"]
    for s in sets:
        args += ["--set", s]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and expected in result.output and "Traceback" not in result.output, result.output


def test_a_sources_own_setting_of_another_format_is_refused_with_its_key(tmp_path):
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "alice has a cat ."}] * 50)
    result = CliRunner().invoke(main, ["recipe", "validate", "quickstart-mix", "--set",
                                       f"data.sources=[{{path: {text}, split: test, chosen_field: good}}, "
                                       "{path: builtin:quickstart}]"])
    assert result.exit_code == 2, result.output
    assert "data.sources.0.split: 'test' has no effect: it chooses among a hub dataset's splits" in result.output
    assert "data.sources.0.chosen_field: 'good' has no effect: no source of format preference reads it" in result.output


# ------------------------------------------------------------------------------------------ one huge line


def test_one_line_of_200_mb_is_refused_with_its_file_and_line_before_it_is_read_whole(tmp_path, cache):
    path = tmp_path / "huge.jsonl"
    with path.open("w") as f:
        f.write('{"text": "alice has a cat ."}\n' * 2)
        f.write('{"text": "' + "alice has a cat . " * 11_000_000 + '"}\n')  # ~200 MB
        f.write('{"text": "bob has a dog ."}\n')
    bound = WallClockBound(60)  # about 1 s here under the parallel suite: the line is not read whole
    result = CliRunner().invoke(main, ["data", "prepare", "quickstart", "--set", f"data.path={path}"])
    assert result.exit_code == 2, result.output
    assert f"({path}): line 3 is longer than that, more than the 8 MiB a row may hold" in result.output
    bound.check("refusing a 200 MB line")


def test_a_row_read_by_datasets_is_bounded_too(tmp_path, cache, tok, monkeypatch):
    from accel_fsdp.data import sources

    monkeypatch.setattr(sources, "MAX_ROW_BYTES", 1000)
    path = tmp_path / "t.csv"
    path.write_text("text\nalice has a cat .\n" + "bob " * 400 + "\n")
    with pytest.raises(UserError, match=r"t.csv\): row 2 holds 0 MiB of text, more than the 0 MiB a row may hold"):
        prepare_data(recipe(str(path), "text", eval_fraction=0, max_rows=None), tok)


# ----------------------------------------------------------------- a build that outlasts the collective timeout


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RANK_SCRIPT = """
import datetime, json, os, sys
from types import SimpleNamespace
import torch.distributed as dist
from accel_fsdp.config.recipe import recipe_from_text
from accel_fsdp.data.synthetic import build_tokenizer
from accel_fsdp.train.setup import prepare_run_data
from accel_fsdp.train.hooks import TestSwitches

rank = int(os.environ["RANK"])
# The ranks meet with time to spare (their imports above end seconds apart on a busy machine), then the store and every
# collective get the short timeout, as a launcher's init_process_group gives both the collective timeout.
store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 2, rank == 0,
                      timeout=datetime.timedelta(seconds=300))
store.set_timeout(datetime.timedelta(seconds=2))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=2))
r = recipe_from_text(sys.argv[1], source="r.yaml")
import torch


def gather(tensor):  # Accelerator.gather: every rank's tensor, concatenated in rank order
    out = [torch.zeros_like(tensor) for _ in range(2)]
    dist.all_gather(out, tensor)
    return torch.cat(out)


acc = SimpleNamespace(num_processes=2, process_index=rank, is_main_process=rank == 0,
                      is_local_main_process=rank == 0, device=torch.device("cpu"), gather=gather)
terminal = SimpleNamespace(say=lambda text: print(text, flush=True))
data = prepare_run_data(r, build_tokenizer(), acc, terminal, TestSwitches(slow_data=6.0))
dist.barrier()  # the ranks' next collective: both are here
print(json.dumps({"rank": rank, "units": len(data)}), flush=True)
"""


@pytest.mark.slow
def test_a_build_longer_than_the_collective_timeout_is_waited_for_in_the_store(tmp_path, cache):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               PYTHONPATH=str(REPO))
    text = """
model: {architecture: gpt2, tokenizer: "builtin:quickstart"}
data: {path: "builtin:quickstart", seq_len: 128, eval_fraction: 0.1, max_rows: 200}
training: {micro_batch_size: 2, global_batch_size: 4, max_steps: 3}
"""
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, text], env=dict(env, RANK=str(k)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for k in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outputs
    results = [json.loads(o.strip().splitlines()[-1]) for o in outputs]
    assert results[0]["units"] == results[1]["units"] > 0
    assert "data: preparing quickstart" in outputs[0]


# ------------------------------------------------------------------------------------------------- Ctrl-C


@pytest.mark.slow
def test_ctrl_c_during_data_prepare_exits_130_with_one_line_and_leaves_no_half_written_cache(tmp_path, cache):
    import random

    from accel_fsdp.data.synthetic import story

    rng = random.Random(0)
    path = write_jsonl(tmp_path / "big.jsonl", [{"text": " ".join(story(rng)[0] for _ in range(8))}
                                               for _ in range(60_000)])
    proc = subprocess.Popen([sys.executable, "-m", "accel_fsdp", "data", "prepare", "quickstart", "--set",
                             f"data.path={path}"], cwd=REPO, env=dict(os.environ, ACCEL_FSDP_CACHE=str(cache)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tokenized = cache / "tokenized"
    deadline = time.monotonic() + 240
    while not (tokenized.is_dir() and any(".tmp-" in p.name for p in tokenized.iterdir())):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    time.sleep(0.5)  # inside the build
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    assert err.strip().splitlines() == ["data prepare: interrupted (Ctrl-C); the cache holds no half-written data"]
    assert [p.name for p in tokenized.iterdir() if not p.name.endswith(".lock")] == []


def test_a_ctrl_c_that_python_dropped_still_stops_the_build_and_exits_130(cache, tok, capsys):
    from accel_fsdp.cli.data import interruptible

    with pytest.raises(SystemExit) as ended, interruptible("data prepare"):
        try:  # what a __del__ does with the KeyboardInterrupt the handler raises in it: drops it
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            pass
        prepare_data(recipe(), tok)
    assert ended.value.code == 130
    assert capsys.readouterr().err.strip() == "data prepare: interrupted (Ctrl-C); the cache holds no half-written data"
    assert [p.name for p in (cache / "tokenized").iterdir() if not p.name.endswith(".lock")] == []


# ------------------------------------------------------------------------------------- resume on changed data


def test_a_resume_refuses_a_source_that_changed_since_its_checkpoint_unless_told(tmp_path, cache, tok):
    from accel_fsdp.checkpoint.records import Manifest
    from accel_fsdp.checkpoint.index import CheckpointInfo, check_resume
    from accel_fsdp.data.identity import data_identity

    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "alice has a cat ."}] * 30)
    r = recipe(str(data), "text", max_rows=None)
    checkpoint = tmp_path / "step-000004"
    checkpoint.mkdir()
    (checkpoint / "recipe.yaml").write_text(r.to_yaml())
    info = CheckpointInfo(checkpoint, 4, True, manifest=Manifest(step=4, data=data_identity(r), world_size=2,
                                                                 fsdp_version=2))
    settings = SimpleNamespace(fsdp_version=SimpleNamespace(value=2), num_processes=SimpleNamespace(value=2))
    assert check_resume(info, r, settings) == []
    with data.open("a") as f:
        f.write('{"text": "bob has a dog ."}\n')
    with pytest.raises(UserError, match=r"step-000004: the data changed since this checkpoint was saved:\n *"
                                        r"data.path \(d\): \d+ -> \d+ bytes\n.*--accept-data-change"):
        check_resume(info, r, settings)
    (note,) = check_resume(info, r, settings, accept_data_change=True)
    assert note.startswith("the data changed since the checkpoint; going on with it as it is now")


@pytest.mark.slow
def test_a_run_resumed_after_rows_were_appended_is_refused_then_goes_on_when_told(tmp_path, tiny_gpt2, stories):
    data = tmp_path / "d.jsonl"
    data.write_text(stories.read_text())
    r = tiny_recipe(tmp_path / "r.yaml", tiny_gpt2, data, training={"max_steps": 4})
    run = tmp_path / "run"
    run_cli("recipe", "run", r, "--output-dir", run, "--num-processes", "1", check=0)
    with data.open("a") as f:
        f.write('{"text": "alice has a red cat ."}\n' * 10)
    r2 = tiny_recipe(tmp_path / "r.yaml", tiny_gpt2, data, training={"max_steps": 6})
    refused = run_in_process("recipe", "run", r2, "--output-dir", run, "--resume", "--num-processes", "1", check=2)
    assert "the data changed since this checkpoint was saved" in refused.stderr and "data.path (d)" in refused.stderr
    assert "Traceback" not in refused.stderr
    went_on = run_cli("recipe", "run", r2, "--output-dir", run, "--resume", "--num-processes", "1",
                      "--accept-data-change", check=0)
    assert "going on with it as it is now (--accept-data-change)" in went_on.stdout + went_on.stderr


# --------------------------------------------------------------------------- too little data, before the model


@pytest.mark.slow
def test_a_rank_refuses_too_little_data_before_it_reads_any_weight(tmp_path):
    """Started by a stock launcher (no check before the launch): the data is prepared and found too small for one
    global batch before the model's weights (here unreadable) are touched."""
    from conftest import save_tiny_model

    model = save_tiny_model(tmp_path / "model", "gpt2")
    (model / "model.safetensors").write_bytes(b"not weights" * 100)
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "alice has a cat ."}] * 3)
    r = tiny_recipe(tmp_path / "r.yaml", model, data)
    rank = dict(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()))
    result = run_cli("recipe", "run", r, "--output-dir", tmp_path / "run", env=rank, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "training.global_batch_size: 8 sequences per optimizer step, but the data has only 1" in result.stderr
    assert "safetensors" not in result.stdout + result.stderr and "Traceback" not in result.stderr
