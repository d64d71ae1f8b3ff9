"""Where users wait: a CLI that answers without importing the heavy libraries, CPU precision chosen by capability,
one message for an unreachable hub, a tokenizer of the user's own text, and what the run reports (time to first step,
the rate each step used, peak memory per window). Timing itself is measured by commands (docs/PERFORMANCE.md), not
by these tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner
from conftest import REPO, read_metrics, run_cli, write_jsonl

from accel_fsdp.cli import main

HEAVY = ("torch", "transformers.models", "accelerate", "datasets")


def imported_by(*args) -> set[str]:
    """Heavy modules imported by running the CLI command in a fresh interpreter."""
    code = ("import sys; from click.testing import CliRunner; from accel_fsdp.cli import main; "
            f"r = CliRunner().invoke(main, {list(args)!r}); assert r.exit_code == 0, r.output; "
            "print('\\n'.join(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    return {m for m in out.split() if m.startswith(HEAVY)}


@pytest.mark.parametrize("args", [["--help"], ["recipe", "list"], ["recipe", "show", "gpt2-xl"], ["recipe", "keys"],
                                  ["estimate", "gpt2-xl", "--gpus", "2"], ["estimate", "llama-3.1-8b-lora"],
                                  ["recipe", "validate", "gpt2-xl", "--accelerate-config", "fsdp_2gpu"]])
def test_the_quick_commands_import_neither_torch_nor_model_code(args):
    assert imported_by(*args) == set()


def test_data_prepare_with_a_tokenizer_folder_imports_no_torch_and_loads_what_autotokenizer_loads(tmp_path):
    """A folder of tokenizer files alone (what `accel-fsdp tokenizer train` writes) is loaded by its class, as
    AutoTokenizer would load it (model/tokenizer.py `plain_tokenizer_folder`), without AutoTokenizer's import of
    torch: about a second of `data prepare`'s start."""
    from transformers import AutoTokenizer

    from accel_fsdp.config.recipe import recipe_from_text
    from accel_fsdp.data.identity import tokenizer_identity
    from accel_fsdp.data.synthetic import build_tokenizer
    from accel_fsdp.model.tokenizer import build_tokenizer as recipe_tokenizer
    from accel_fsdp.model.tokenizer import plain_tokenizer_folder

    folder = tmp_path / "tokenizer"
    build_tokenizer().save_pretrained(folder)
    rows = [{"messages": [{"role": "user", "content": "who has a cat ?"}, {"role": "assistant", "content": "alice ."}]}
            for _ in range(40)]
    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps({"model": {"architecture": "gpt2", "tokenizer": str(folder)},
                                  "data": {"path": str(write_jsonl(tmp_path / "chat.jsonl", rows)), "format": "chat",
                                           "eval_fraction": 0},
                                  "training": {"micro_batch_size": 1, "global_batch_size": 1}}))
    assert imported_by("data", "prepare", str(recipe)) == set()
    ours = recipe_tokenizer(recipe_from_text(recipe.read_text(), source="r.yaml"))
    auto = AutoTokenizer.from_pretrained(folder)
    assert plain_tokenizer_folder(folder) and type(ours) is type(auto)
    assert tokenizer_identity(ours) == tokenizer_identity(auto) and ours.special_tokens_map == auto.special_tokens_map
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))  # a model's folder: AutoTokenizer's
    assert not plain_tokenizer_folder(folder)


def test_recipe_list_counts_parameters_from_facts():
    out = CliRunner().invoke(main, ["recipe", "list"]).output
    line = next(x for x in out.splitlines() if x.startswith("llama-3.1-8b "))
    assert "8.03B" in line  # transformers' own count, held by tests/test_model_facts.py


def test_cpu_precision_follows_the_cpus_native_bf16(monkeypatch):
    def precision(*sets, bf16: str):
        monkeypatch.setenv("ACCEL_FSDP_CPU_BF16", bf16)
        out = CliRunner().invoke(main, ["recipe", "validate", "quickstart", *sets]).output
        return next(line for line in out.splitlines() if "mixed_precision" in line).split(None, 1)[1]

    slow = precision(bf16="0")
    assert slow.startswith("fp32  (detected: this CPU (ACCEL_FSDP_CPU_BF16=0) has no native bf16 matrix units")
    assert slow.endswith("set training.mixed_precision: bf16 to have it anyway)")  # what to do, not what was asked
    assert precision(bf16="1").startswith("bf16  (") and "fsdp_cpu.yaml" in precision(bf16="1")
    assert precision("--set", "training.mixed_precision=bf16", bf16="0") == "bf16  (--set)"  # asked for: kept
    # a GPU config judged for its own hardware is not affected by this CPU
    out = CliRunner().invoke(main, ["recipe", "validate", "quickstart", "--accelerate-config", "fsdp_2gpu"]).output
    assert next(x for x in out.splitlines() if "mixed_precision" in x).split()[1] == "bf16"


def test_an_unreachable_hub_is_one_message_before_launch(tmp_path):
    msg = run_cli("recipe", "run", "gpt2", "--output-dir", tmp_path / "a", env={"HF_HUB_OFFLINE": "1"}, check=2).stderr
    assert ("model.name_or_path: 'openai-community/gpt2' is not in the local Hugging Face cache, and HF_HUB_OFFLINE=1 "
            "forbids downloading it" in msg)
    assert "(hf download openai-community/gpt2)" in msg, msg  # the installed hub CLI's command, not huggingface-cli
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", PYTHONUNBUFFERED="1")  # nothing listens on the discard port
    proc = subprocess.run([sys.executable, "-m", "accel_fsdp", "recipe", "run", "llama-3.2-1b", "--output-dir",
                           str(tmp_path / "b")], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 2
    assert ("'meta-llama/Llama-3.2-1B' is not in the local cache and the hub (http://127.0.0.1:9) cannot be "
            "reached" in proc.stderr)
    assert "Retrying" not in proc.stderr and "accel-fsdp: launching" not in proc.stderr
    assert not (tmp_path / "b").exists()


def own_text(tmp_path):
    """Text the built-in word-level tokenizer has never seen: capitals, accents, CJK, emoji, code."""
    import random

    rng = random.Random(0)
    words = "The Quick brown fox, jumped over 3 lazy dogs! Über café naïve 東京 🙂 C++ x86_64 {json: true}".split()
    return write_jsonl(tmp_path / "own.jsonl", [{"text": " ".join(rng.choice(words) for _ in range(rng.randint(5, 30)))}
                                                 for _ in range(2000)])


@pytest.mark.parametrize("kind, instead", [("model", "a local folder (a save_pretrained copy)"),
                                           ("dataset", "a local data file (.jsonl, .json, .csv, .parquet, .txt)")])
def test_an_unreachable_hub_says_what_to_give_instead_of_each_kind_of_id(monkeypatch, kind, instead):
    """data.path reads a file, never a folder: the fix for an unreachable hub dataset names a data file."""
    from huggingface_hub import HfApi

    from accel_fsdp.model.hub import _ask_hub

    def unreachable(*args, **kwargs):
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(HfApi, f"{kind}_info", unreachable)
    message, fix = _ask_hub("owner/name", kind)
    assert "cannot be reached" in message and fix.startswith(f"give {instead}, or fix the network"), fix


def test_a_tokenizer_trained_on_the_users_text(tmp_path):
    from transformers import AutoTokenizer

    data = own_text(tmp_path)
    result = CliRunner().invoke(main, ["tokenizer", "train", "quickstart", str(tmp_path / "tok"), "--vocab-size", "400",
                                       "--set", f"data.path={data}"])
    assert result.exit_code == 0, result.output
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    text = "Über 東京 🙂 {json: true}"
    assert tok.decode(tok(text)["input_ids"]) == text and tok.unk_token is None  # byte-level: nothing is unknown
    assert tok.chat_template and tok.eos_token == "<|endoftext|>"
    (tmp_path / "tok" / "notes.txt").write_text("mine")  # a tokenizer folder is replaced only if all of it is ours
    result = CliRunner().invoke(main, ["tokenizer", "train", "quickstart", str(tmp_path / "tok")])
    assert result.exit_code == 2 and "exists and is neither empty nor a tokenizer this command wrote" in result.output
    result = CliRunner().invoke(main, ["recipe", "validate", "quickstart", "--set", "model.tokenizer=bpe:12"])
    assert result.exit_code == 2 and "bpe:N needs a vocabulary size N between 300 and 1,000,000" in result.output


@pytest.mark.slow
@pytest.mark.multiprocess
def test_from_scratch_on_own_text_with_a_trained_tokenizer_reports_its_start(tmp_path):
    """bpe:N in the recipe: trained once, cached, used by both ranks. The run reports its time to first step by
    phase, the rate each step used, and peak memory per logging window and overall."""
    data = own_text(tmp_path)
    recipe = tmp_path / "own.yaml"
    recipe.write_text(f"""
model: {{architecture: gpt2, tokenizer: "bpe:400", config_overrides: {{n_layer: 2, n_embd: 64, n_head: 4,
         n_positions: 128}}}}
data: {{path: "{data}", seq_len: 64, eval_fraction: 0}}
training: {{micro_batch_size: 2, global_batch_size: 8, max_steps: 6, mixed_precision: fp32, lr: 1.0e-3,
           warmup_steps: 2, scheduler: linear, min_lr_ratio: 0.0}}
logging: {{every_steps: 1, sample_prompt: "Über", sample_max_new_tokens: 4}}
checkpoint: {{export_final: false}}
""")
    run = tmp_path / "run"
    proc = run_cli("recipe", "run", recipe, "--output-dir", run, check=0)
    assert "first optimizer step after" in proc.stdout and "sample: 'Über' -> " in proc.stdout
    rows = read_metrics(run)
    startup = next(r for r in rows if r["kind"] == "startup")
    assert set(startup["phases_s"]) == {"launch", "imports", "data", "model", "sharding", "first step"}
    # The phases and their total are each rounded to the millisecond: the total is their sum to float64 rounding.
    phases = startup["phases_s"]
    assert startup["time_to_first_step_s"] == pytest.approx(sum(phases.values()), rel=len(phases) * 2**-52)
    train = [r for r in rows if r["kind"] == "train"]
    # The lr of a row is the rate its step used: warm-up 1/3, 2/3, then linear decay from the peak to 0 (a few float64
    # operations each).
    expected = [1e-3 * f for f in (1 / 3, 2 / 3, 1.0, 0.75, 0.5, 0.25)]
    assert [r["lr"] for r in train] == pytest.approx(expected, rel=4 * 2**-52)
    for r in train:
        assert len(r["peak_memory_bytes"]) == 2 and all(p > 0 for p in r["peak_memory_bytes"])
        assert all(run_peak >= window for run_peak, window in zip(r["peak_memory_bytes_run"], r["peak_memory_bytes"]))
    assert json.loads((run / "fsdp_settings.json").read_text())["mixed_precision"]["value"] == "fp32"
