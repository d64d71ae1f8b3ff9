"""Runs that cannot hurt each other, and mistakes that never train: ownership of run and checkpoint folders, the
lock of a live run, duplicate keys, unknown config overrides, data that would teach nothing, and every bad input
that used to end in a traceback. Each case: exit status 2, one message naming the file or key, the value and the
fix, nothing of the user's changed. In-process through the real CLI; nothing here launches ranks."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import zlib
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import save_tiny_model, tiny_recipe, user_error, write_jsonl

from accel_fsdp.cli import main
from accel_fsdp.config.shipped import shipped_recipes


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


def fake_run(folder: Path, run_id: str, *, recipe="quickstart", overrides=(), checkpoint_dir: Path | None = None,
             checkpoint_steps=(3,)) -> Path:
    """A run folder as accel-fsdp leaves it (identity, resolved recipe, owned checkpoint folder), without training."""
    from accel_fsdp.checkpoint.records import FORMAT
    from accel_fsdp.config.recipe import load_recipe

    r = load_recipe(shipped_recipes()[recipe], list(overrides))
    folder.mkdir(parents=True)
    ckpts = checkpoint_dir or folder / "checkpoints"
    ckpts.mkdir(parents=True, exist_ok=True)
    (folder / "run.json").write_text(json.dumps({"run_id": run_id, "recipe_name": r.name,
                                                 "recipe_fingerprint": r.fingerprint(),
                                                 "checkpoint_dir": "checkpoints" if checkpoint_dir is None
                                                 else str(ckpts)}))
    (folder / "recipe.yaml").write_text(r.to_yaml())
    (ckpts / ".accel-fsdp-run").write_text(json.dumps({"run_id": run_id, "run_dir": str(folder)}))
    for step in checkpoint_steps:
        step_dir = ckpts / f"step-{step:06d}"
        step_dir.mkdir()
        (step_dir / "weights").write_bytes(b"w" * 10)
        (step_dir / "manifest.json").write_text(json.dumps({"format": FORMAT, "step": step, "run_id": run_id,
                                                            "files": {"weights": 10}}))
    return folder


# ------------------------------------------------------------------------------------------- ownership


def test_a_checkpoint_folder_of_another_run_is_refused(tmp_path):
    other = fake_run(tmp_path / "other", "aaaa", checkpoint_dir=tmp_path / "scratch")
    before = snapshot(tmp_path / "scratch")
    msg = user_error("recipe", "run", "quickstart", "--output-dir", tmp_path / "mine",
                     "--set", f"checkpoint.dir={tmp_path / 'scratch'}")
    assert f"{tmp_path / 'scratch'}: this checkpoint folder belongs to another run (run aaaa in {other})" in msg
    assert "set checkpoint.dir to a folder of this run's own" in msg
    assert snapshot(tmp_path / "scratch") == before and not (tmp_path / "mine").exists()


def test_a_non_empty_checkpoint_folder_that_no_run_owns_is_refused(tmp_path):
    (tmp_path / "scratch").mkdir()
    (tmp_path / "scratch" / "notes.txt").write_text("mine")
    msg = user_error("recipe", "run", "quickstart", "--output-dir", tmp_path / "run",
                     "--set", f"checkpoint.dir={tmp_path / 'scratch'}")
    assert "the checkpoint folder is not empty (notes.txt) and records no run that owns it" in msg
    assert (tmp_path / "scratch" / "notes.txt").read_text() == "mine"


def test_resume_from_into_a_folder_of_another_run_is_refused(tmp_path):
    theirs = fake_run(tmp_path / "theirs", "cccc")
    mine = fake_run(tmp_path / "mine", "bbbb")
    before = snapshot(mine)
    msg = user_error("recipe", "run", "quickstart", "--output-dir", mine, "--resume-from",
                     theirs / "checkpoints" / "step-000003")
    assert "holds run bbbb of recipe 'quickstart', but" in msg and "belongs to run cccc" in msg
    assert "give a new --output-dir to start a run from that checkpoint" in msg
    assert snapshot(mine) == before


def test_resume_auto_refuses_a_folder_of_another_run(tmp_path):
    run = fake_run(tmp_path / "run", "dddd", overrides=["training.lr=0.1"])
    msg = user_error("recipe", "run", "quickstart", "--output-dir", run, "--resume", "auto")
    assert "holds another run (run dddd of recipe 'quickstart')" in msg
    assert "training.lr: that run has 0.1, this one 0.003" in msg


def test_overwrite_never_deletes_a_checkpoint_folder_it_cannot_prove_is_the_replaced_runs(tmp_path):
    from accel_fsdp.config.recipe import load_recipe
    from accel_fsdp.layout import RunLayout
    from accel_fsdp.run.folder import Decision, apply_decision

    recipe = load_recipe(shipped_recipes()["quickstart"], [f"checkpoint.dir={tmp_path / 'scratch'}"])
    run = fake_run(tmp_path / "run", "eeee", checkpoint_dir=tmp_path / "scratch")
    (tmp_path / "scratch" / "notes.txt").write_text("mine")
    # The checkpoint folder the old run recorded, now owned by someone else: refused before anything is deleted.
    (tmp_path / "scratch" / ".accel-fsdp-run").write_text(json.dumps({"run_id": "ffff", "run_dir": "/elsewhere"}))
    before = snapshot(tmp_path)
    msg = user_error("recipe", "run", "quickstart", "--output-dir", run, "--overwrite",
                     "--set", f"checkpoint.dir={tmp_path / 'scratch'}")
    assert "belongs to another run (run ffff in /elsewhere)" in msg and snapshot(tmp_path) == before
    # Owned by the run being replaced: its checkpoints go, anything else stays.
    (tmp_path / "scratch" / ".accel-fsdp-run").write_text(json.dumps({"run_id": "eeee", "run_dir": str(run)}))
    layout = RunLayout.of(recipe, run)

    class Settings:
        def to_dict(self):
            return {}

    identity = apply_decision(layout, recipe, Settings(), Decision.OVERWRITE)
    assert identity.run_id != "eeee"
    assert sorted(p.name for p in (tmp_path / "scratch").iterdir()) == [".accel-fsdp-run", "notes.txt"]
    assert json.loads((tmp_path / "scratch" / ".accel-fsdp-run").read_text())["run_id"] == identity.run_id


def test_an_overwrite_killed_while_deleting_leaves_each_checkpoint_whole_or_in_the_trash(tmp_path, monkeypatch):
    """What an overwrite deletes is renamed aside first: a checkpoint elsewhere (checkpoint.dir) into the store's
    trash, which its saves sweep; the run folder's own entries to a temporary name, which the next start sweeps. A kill
    in the middle of a deletion never leaves a step folder that lost some of its files (which `--resume auto` would
    have to tell from a damaged save), nor gigabytes hidden for ever."""
    import socket

    from accel_fsdp.config.recipe import load_recipe
    from accel_fsdp.layout import TRASH_PREFIX, RunLayout
    from accel_fsdp.run import folder

    class Settings:
        def to_dict(self):
            return {}

    scratch = tmp_path / "scratch"
    recipe = load_recipe(shipped_recipes()["quickstart"], [f"checkpoint.dir={scratch}"])
    run = fake_run(tmp_path / "run", "eeee", checkpoint_dir=scratch, checkpoint_steps=(3, 6))
    before = {p.name: snapshot(p) for p in scratch.iterdir() if p.is_dir()}
    killed_after = []

    def killed_while_deleting(path):
        (path / "weights").unlink()  # the deletion had begun
        killed_after.append(path.name)
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(folder, "remove", killed_while_deleting)
        with pytest.raises(KeyboardInterrupt):
            folder.apply_decision(RunLayout.of(recipe, run), recipe, Settings(), folder.Decision.OVERWRITE)
    deleted = killed_after[0].removeprefix(TRASH_PREFIX)
    kept = next(name for name in before if name != deleted)
    left = {p.name: p for p in scratch.iterdir() if p.is_dir()}
    assert left.keys() == {TRASH_PREFIX + deleted, kept} and snapshot(left[kept]) == before[kept], left

    # A run's own entry left aside by a killed overwrite (its process gone) goes with the next start.
    aside = run / f".checkpoints.tmp-{socket.gethostname()}-999999999-00aa11bb"
    (aside / "step-000009").mkdir(parents=True)
    folder.apply_decision(RunLayout.of(recipe, run), recipe, Settings(), folder.Decision.OVERWRITE)
    assert not aside.exists()


def test_a_damaged_run_json_is_named_and_nothing_is_changed(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text('{"run_id": "abc", "recipe')
    before = snapshot(run)
    for flag in ("--resume", "--overwrite"):
        msg = user_error("recipe", "run", "quickstart", "--output-dir", run, flag)
        assert "run.json: is unreadable or corrupt (JSONDecodeError" in msg and "restore run.json" in msg
    assert snapshot(run) == before


# ------------------------------------------------------------------------------------------------- lock


def hold_lock(folder: Path) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / ".accel-fsdp.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, json.dumps({"host": socket.gethostname(), "pid": 4242, "since": "2026-11-22 10:00:00"}).encode())
    return fd


def test_a_second_start_on_a_live_run_names_the_holder(tmp_path):
    run = fake_run(tmp_path / "run", "gggg")
    fd = hold_lock(run)
    try:
        msg = user_error("recipe", "run", "quickstart", "--output-dir", run, "--resume")
        assert (f"this run folder is in use by a live run (held by PID 4242 on {socket.gethostname()} since "
                "2026-11-22 10:00:00)" in msg)
        scratch = tmp_path / "scratch"
        fd2 = hold_lock(scratch)
        msg = user_error("recipe", "run", "quickstart", "--output-dir", tmp_path / "new",
                         "--set", f"checkpoint.dir={scratch}")
        assert f"{scratch}: this checkpoint folder is in use by a live run (held by PID 4242" in msg
        os.close(fd2)
    finally:
        os.close(fd)
    # Released (the holder closed it, as the kernel does when a process dies): no longer refused for the lock.
    from accel_fsdp.run.folder import lock_holder

    assert lock_holder(run) is None


def test_the_lock_is_taken_by_the_run_and_released_when_it_ends(tmp_path):
    from accel_fsdp.errors import UserError
    from accel_fsdp.run.folder import FolderLock, lock_holder

    lock = FolderLock(tmp_path / "run").acquire("run folder")
    assert f"held by PID {os.getpid()}" in lock_holder(tmp_path / "run")
    with pytest.raises(UserError, match="in use by a live run"):
        FolderLock(tmp_path / "run").acquire("run folder")
    lock.release(remove_if_created=True)
    assert not (tmp_path / "run").exists()  # refused starts leave nothing behind


# ------------------------------------------------------------------- nothing that changes training exits 0


def test_a_key_given_twice_in_a_recipe_or_config_is_an_error(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(shipped_recipes()["quickstart"].read_text().replace("  lr: 3.0e-3", "  lr: 3.0e-3\n  lr: 1"))
    msg = user_error("recipe", "validate", recipe)
    line = next(i for i, text in enumerate(recipe.read_text().splitlines(), 1) if text == "  lr: 1")
    assert f"r.yaml:{line}: training.lr: is given twice (lines {line - 1} and {line})" in msg
    config = tmp_path / "c.yaml"
    text = (Path(__file__).parents[1] / "accelerate_configs" / "fsdp_cpu.yaml").read_text()
    config.write_text(text + "num_processes: 4\n")
    msg = user_error("recipe", "validate", "quickstart", "--accelerate-config", config)
    assert "c.yaml:" in msg and "num_processes: is given twice" in msg


@pytest.mark.parametrize("encode,expected,fix", [
    (lambda text: ("# café\n" + text).encode("latin-1"),
     ":1: {what} is not UTF-8 (byte 0xe9 at column 6); it is probably Latin-1 or Windows-1252", "iconv -f latin1 "),
    (lambda text: text.encode("utf-16"), ":1: {what} is not UTF-8 (byte 0xff at column 1); it is probably UTF-16 (it "
     "starts with a UTF-16 byte-order mark)", "iconv -f utf-16 "),
    (lambda text: "# ascii\n".encode("utf-16-le"), ":1: {what} is not UTF-8 (byte 0x00 at column 2); it is probably "
     "not text (it holds NUL bytes), or UTF-16 without a byte-order mark", "iconv -f utf-16le "),
    (lambda text: bytes(range(256)), ":1: {what} is not UTF-8 (byte 0x00 at column 1); it is probably not text",
     "iconv -f utf-16le "),
], ids=["latin-1", "utf-16", "utf-16-without-bom", "binary"])
@pytest.mark.parametrize("which", ["recipe", "accelerate config"])
def test_a_recipe_or_config_that_is_not_utf8_names_line_byte_and_encoding(tmp_path, encode, expected, fix, which):
    """An editor that saves as Latin-1 or UTF-16, or a binary file under a .yaml name, was "cannot read the recipe file
    (UnicodeDecodeError)": now the line, the byte and the likely encoding, with the command that converts it."""
    recipe = shipped_recipes()["quickstart"]
    config = Path(__file__).parents[1] / "accelerate_configs" / "fsdp_cpu.yaml"
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(encode((recipe if which == "recipe" else config).read_text()))
    msg = (user_error("recipe", "validate", bad) if which == "recipe"
           else user_error("recipe", "validate", "quickstart", "--accelerate-config", bad))
    what = "the recipe file" if which == "recipe" else "the accelerate config"
    assert msg.startswith(f"error: {bad}" + expected.format(what=what)), msg
    assert f"fix: save it as UTF-8, e.g. {fix}" in msg, msg


def test_an_unknown_config_override_is_an_error():
    msg = user_error("recipe", "validate", "quickstart", "--set", "model.config_overrides.n_layers=4")
    assert "--set model.config_overrides.n_layers: GPT2Config has no setting 'n_layers', so it would be ignored" in msg
    assert "did you mean n_layer?" in msg
    msg = user_error("recipe", "validate", "quickstart-llama", "--set", "model.config_overrides.num_layers=4")
    assert "LlamaConfig has no setting 'num_layers'" in msg


def instruction_data(tmp_path, rows: int, long_prompts: int) -> Path:
    long = "alice has a red cat . " * 20
    return write_jsonl(tmp_path / "qa.jsonl", [{"instruction": long if i < long_prompts else "who ?",
                                                 "output": "alice ."} for i in range(rows)])


def test_data_that_keeps_no_loss_token_is_refused_before_launch(tmp_path, tiny_gpt2):
    data = instruction_data(tmp_path, 20, 20)
    recipe = tiny_recipe(tmp_path / "r.yaml", tiny_gpt2, data, data={"format": "instruction", "seq_len": 16,
                                                                     "eval_fraction": 0})
    msg = user_error("recipe", "run", recipe, "--output-dir", tmp_path / "run")
    assert ("no training example keeps a token that carries a loss (20 of 20 lost it to truncation at "
            "data.seq_len = 16" in msg and "raise data.seq_len" in msg)
    assert not (tmp_path / "run").exists()


def test_a_large_share_of_truncated_responses_is_warned_about(tmp_path, tiny_gpt2):
    data = instruction_data(tmp_path, 20, 10)
    recipe = tiny_recipe(tmp_path / "r.yaml", tiny_gpt2, data, data={"format": "instruction", "seq_len": 16,
                                                                     "eval_fraction": 0})
    result = CliRunner().invoke(main, ["recipe", "validate", str(recipe)])
    assert result.exit_code == 0, result.output
    assert ("note: 50% of the training examples (10 of 20) lost all their loss-carrying tokens to truncation at "
            "data.seq_len = 16" in result.output)


# ----------------------------------------------------------------------------- no traceback, one message


def test_a_data_file_that_is_not_utf8_names_line_and_encoding(tmp_path, tiny_gpt2):
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"text": "ok"}\n{"text": "caf\u00e9 au lait"}\n'.encode("latin-1"))
    recipe = tiny_recipe(tmp_path / "r.yaml", tiny_gpt2, latin)
    msg = user_error("recipe", "validate", recipe)
    assert "line 2 is not UTF-8 (byte 0xe9 at column 14); the file is probably Latin-1 or Windows-1252" in msg
    assert "iconv" in msg and msg.count("error") == 1
    utf16 = tmp_path / "utf16.jsonl"
    utf16.write_text('{"text": "hello"}\n', encoding="utf-16")
    msg = user_error("recipe", "validate", recipe, "--set", f"data.path={utf16}")
    assert "the file is UTF-16 (it starts with a UTF-16 byte-order mark), not UTF-8" in msg


@pytest.mark.parametrize("text,codec,expected", [
    ("café au lait", "cp1252", "latin1"), ("Größe und Maß", "cp1252", "latin1"), ("ação e coração", "latin-1", "latin1"),
    ("né", "latin-1", "latin1"), ("Python 是一种语言", "gbk", "GB18030"), ("日本語のテキスト", "shift_jis", "GB18030"),
    ("한국어 텍스트", "euc_kr", "GB18030"), ("繁體中文的文字", "big5", "GB18030"), ("日本語のテキスト", "euc_jp", "GB18030"),
])
def test_text_that_is_not_utf8_is_called_european_or_east_asian_by_its_bytes(text, codec, expected):
    """A file of Chinese, Japanese or Korean in a legacy encoding was called "probably Latin-1", and the fix (iconv -f
    latin1) would have turned it into mojibake that trains without a word."""
    from accel_fsdp.errors import encoding_guess, iconv_fix

    guess, encoding = encoding_guess(text.encode(codec))
    assert encoding == expected, guess
    assert f"iconv -f {expected} -t utf-8" in iconv_fix(encoding)


def test_a_data_file_in_an_east_asian_encoding_is_named_so(tmp_path, tiny_gpt2):
    gbk = write_jsonl(tmp_path / "gbk.jsonl", [{"text": "ok"}])
    gbk.write_bytes(gbk.read_bytes() + '{"text": "Python 是一种编程语言"}\n'.encode("gbk"))
    msg = user_error("recipe", "validate", tiny_recipe(tmp_path / "r.yaml", tiny_gpt2, gbk))
    assert ("line 2 is not UTF-8 (byte 0xca at column 18); the file is probably in an East Asian encoding (GB18030, "
            "Big5, Shift_JIS, EUC-JP or EUC-KR)") in msg, msg
    assert "iconv -f GB18030 -t utf-8 FILE > FILE.utf8 (or -f BIG5, SHIFT_JIS" in msg


def test_a_broken_data_file_gives_one_message_without_the_librarys_line(tmp_path, tiny_gpt2, capfd):
    bad = tmp_path / "bad.csv"
    bad.write_text('text,other\n"unterminated,1\nfine,2\n' + "x," * 40 + "\n")
    recipe = tiny_recipe(tmp_path / "r.yaml", tiny_gpt2, bad)
    msg = user_error("recipe", "validate", recipe)
    assert msg.startswith("error: ") and "cannot read it as csv" in msg
    assert "Failed to read file" not in capfd.readouterr().err  # datasets' own ERROR line is not printed


def test_a_seed_beyond_numpys_range_is_refused():
    msg = user_error("recipe", "validate", "quickstart", "--set", "training.seed=4294967296")
    assert "--set training.seed: 4294967296 is outside [0, 2**32 - 1]" in msg


def test_an_output_folder_that_cannot_be_written_is_found_before_launch(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    msg = user_error("recipe", "run", "quickstart", "--output-dir", tmp_path / "file" / "run")
    assert f"{tmp_path / 'file'} is a file, not a folder" in msg
    locked = tmp_path / "readonly"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == locked else real(p, mode))  # root writes
    msg = user_error("recipe", "run", "quickstart", "--output-dir", locked / "run")
    assert f"cannot be written: {locked} is not writable by this user" in msg
    assert "choose a writable --output-dir" in msg


@pytest.mark.parametrize("args,expected", [
    (["estimate", "0"], "0: is not a parameter count: it must be at least 1"),
    (["estimate", "-5"], "-5: is not a parameter count: it must be positive"),
    (["estimate", "gpt2", "--gpu-memory", "24"], "--gpu-memory: '24' has no unit (did you mean 24GB?)"),
    (["estimate", "gpt2", "--gpu-memory", "0GB"], "--gpu-memory: '0GB' is not a size"),
    (["recipe", "run", "gpt2-xl", "--dry-run", "--gpu-memory", "24"], "'24' has no unit"),
    # A size no GPU has gave a verdict that meant nothing ("462824300% used", "fits" in 10^20 TB).
    (["estimate", "gpt2", "--gpu-memory", "80MB"], "'80MB' is less than 1 GiB, which no GPU has\n    fix: give one "
                                                   "GPU's memory, between 1GB and 4TB, e.g. 80GB"),
    (["recipe", "run", "gpt2-xl", "--dry-run", "--gpu-memory", "1KB"], "--gpu-memory: '1KB' is less than 1 GiB"),
    (["estimate", "gpt2", "--gpu-memory", "99999999999999999999TB"], "is more than 4 TiB, which no GPU has"),
    (["checkpoint", "consolidate", "runs", "out", "--max-shard-size", "500"], "'500' has no unit"),
    (["generate", ".", "--prompt", "  "], "--prompt: is empty"),
])
def test_command_arguments_are_checked(args, expected):
    assert expected in user_error(*args)


def test_report_names_a_damaged_metrics_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"kind": "train", "step": s, "loss": 1.0, "lr": 1e-3, "tokens_per_s": 1.0, "tokens_per_s_per_rank": 1.0,
             "step_time_s": 1.0, "tokens_seen": s, "peak_memory_bytes": [1]} for s in (1, 2, 3)]
    lines = [json.dumps(r) for r in rows]
    lines[1] = lines[1][:20]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    msg = user_error("report", run)
    assert f"{run / 'metrics.jsonl'}:2: is not a metrics row" in msg and "delete or repair line 2" in msg
    assert "is a file, not a run folder" in user_error("report", run / "metrics.jsonl")
    assert "is a file, not a checkpoint or run folder" in user_error("checkpoint", "inspect", run / "metrics.jsonl")


def test_generate_names_a_missing_tokenizer_and_damaged_weights(tmp_path):
    folder = save_tiny_model(tmp_path / "model", "gpt2")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    msg = user_error("generate", folder, "--prompt", "alice has a")
    assert "has no tokenizer files (none of tokenizer.json" in msg and "copy tokenizer.json" in msg
    folder = save_tiny_model(tmp_path / "model2", "gpt2")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    msg = user_error("generate", folder, "--prompt", "alice has a")
    assert "damaged weights: model.safetensors (truncated" in msg and "export the model again" in msg


def test_a_shipped_slurm_config_stays_consistent_with_validate(tmp_path):
    """The SLURM script checks the recipe at job start with `recipe validate` on the allocation's numbers."""
    script = tmp_path / "job.sbatch"
    result = CliRunner().invoke(main, ["slurm", "gpt2-xl", "--nodes", "2", "--gpus-per-node", "8", "-o", str(script)])
    assert result.exit_code == 0, result.output
    text = script.read_text()
    assert "#SBATCH --signal=USR1@300" in text and "--resume auto" in text and 'scontrol requeue' in text
    assert "checkpoints/step-" not in text  # no path guessed in bash: the CLI decides
    result = CliRunner().invoke(main, ["recipe", "validate", "gpt2-xl", "--accelerate-config", "fsdp_multinode",
                                       "--num-machines", "2", "--num-processes", "16"])
    assert result.exit_code == 0 and ("batch: global 64 = micro 4 x 16 processes x 1 accumulation steps"
                                      in result.output), result.output


# ------------------------------------------------------------- a corpus of bad inputs, one class per case

def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    return path


def model_folder(tmp_path: Path, damage: str) -> Path:
    folder = save_tiny_model(tmp_path / "model", "gpt2")
    if damage == "garbage-config":
        write(folder / "config.json", "{not json")
    elif damage == "no-model-type":
        write(folder / "config.json", "{}")
    elif damage == "no-weights":
        (folder / "model.safetensors").unlink()
    elif damage == "truncated":
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
    return folder


def accelerate_config(tmp_path: Path, **changes) -> Path:
    import yaml

    config = yaml.safe_load((Path(__file__).parents[1] / "accelerate_configs" / "fsdp1_2gpu.yaml").read_text())
    for key, value in changes.items():
        if key.startswith("fsdp_") and key != "fsdp_config":
            config["fsdp_config"][key] = value
        else:
            config[key] = value
    return write(tmp_path / "acc.yaml", yaml.safe_dump(config))


def recipe_with(tmp_path: Path, tail: str) -> Path:
    return write(tmp_path / "r.yaml", shipped_recipes()["quickstart"].read_text() + tail)


THREE_ROWS = "\n".join(['{"text": "a b"}'] * 3)

CORPUS = [
    # recipe values that would train something else, or nothing
    ("yaml-recursive-alias", lambda t: ["recipe", "validate", recipe_with(t, "x: &a [*a]\n")],
     "YAML anchors refer to themselves"),
    ("lr-infinite", lambda t: ["recipe", "validate", "quickstart", "--set", "training.lr=.inf"],
     "training.lr: expected a finite number, found inf"),
    ("epochs-infinite", lambda t: ["recipe", "validate", "quickstart", "--set", "training.max_steps=null",
                                   "--set", "training.epochs=.inf"], "training.epochs: expected a finite number"),
    ("timeout-beyond-a-week", lambda t: ["recipe", "validate", "quickstart",
                                         "--set", "fsdp.collective_timeout_minutes=100000000"],
     "100000000 is outside [0.1, 10080]: 6 seconds to a week"),
    ("sample-beyond-context", lambda t: ["recipe", "validate", "quickstart",
                                         "--set", "logging.sample_max_new_tokens=500"],
     "500 new tokens do not fit in the model's context of 128 tokens"),
    ("set-into-a-value", lambda t: ["recipe", "validate", "quickstart", "--set", "training.lr.value=1"],
     "training.lr is a value, not a section with keys"),
    # model sizes and names that transformers would truncate, divide by, or not know
    ("layers-not-whole", lambda t: ["recipe", "validate", "quickstart", "--set", "model.config_overrides.n_layer=2.5"],
     "model.config_overrides.n_layer: 2.5 is not a whole number"),
    ("heads-zero", lambda t: ["recipe", "validate", "quickstart", "--set", "model.config_overrides.n_head=0"],
     "model.config_overrides.n_head: 0 is not above zero"),
    ("width-beyond-any-machine", lambda t: ["recipe", "validate", "quickstart",
                                            "--set", "model.config_overrides.n_embd=100000000"],
     "model.config_overrides.n_embd: the model would have"),
    ("activation-unknown", lambda t: ["recipe", "validate", "quickstart",
                                      "--set", "model.config_overrides.activation_function=gelux"],
     "'gelux' is not an activation transformers knows"),
    ("estimate-of-a-recipe-that-cannot-build", lambda t: [
        "estimate", write(t / "r.yaml", shipped_recipes()["quickstart"].read_text().replace(
            "n_head: 4", "n_head: 3"))], "width 128 is not divisible by 3 attention heads"),
    # where the model comes from
    ("model-folder-missing", lambda t: ["recipe", "validate", "quickstart", "--set", "model.architecture=null",
                                        "--set", "model.name_or_path=./no-such-model"],
     "folder './no-such-model' does not exist"),
    ("model-path-ending-like-a-known-model", lambda t: ["recipe", "validate", "quickstart",
                                                        "--set", "model.architecture=null",
                                                        "--set", "model.name_or_path=./models/gpt2"],
     "folder './models/gpt2' does not exist"),
    ("model-garbage-config", lambda t: ["recipe", "validate", "quickstart", "--set", "model.architecture=null",
                                        "--set", f"model.name_or_path={model_folder(t, 'garbage-config')}"],
     "config.json is not valid JSON"),
    ("model-without-model-type", lambda t: ["recipe", "validate", "quickstart", "--set", "model.architecture=null",
                                            "--set", f"model.name_or_path={model_folder(t, 'no-model-type')}"],
     "config.json names no model_type"),
    ("model-without-weights", lambda t: ["recipe", "validate", "quickstart", "--set", "model.architecture=null",
                                         "--set", f"model.name_or_path={model_folder(t, 'no-weights')}"],
     "has no weights (none of model.safetensors"),
    ("model-truncated-weights", lambda t: ["recipe", "validate", "quickstart", "--set", "model.architecture=null",
                                           "--set", f"model.name_or_path={model_folder(t, 'truncated')}"],
     "damaged weights: model.safetensors (truncated"),
    ("tokenizer-missing-folder", lambda t: ["recipe", "validate", "quickstart", "--set", "model.tokenizer=./tok"],
     "folder './tok' does not exist"),
    ("tokenizer-unknown-builtin", lambda t: ["recipe", "validate", "quickstart",
                                             "--set", "model.tokenizer=builtin:other"], "unknown built-in"),
    ("tokenizer-is-a-file", lambda t: ["recipe", "validate", "quickstart",
                                       "--set", f"model.tokenizer={write(t / 'tok.json', '{}')}"], "is a file"),
    # config overrides
    ("override-wrong-type", lambda t: ["recipe", "validate", "quickstart",
                                       "--set", "model.config_overrides.n_layer=two"],
     "expected int, got str"),
    ("override-heads-do-not-divide", lambda t: ["recipe", "validate", "quickstart",
                                                "--set", "model.config_overrides.n_head=3"],
     "width 128 is not divisible by 3 attention heads"),
    ("override-no-layers", lambda t: ["recipe", "validate", "quickstart", "--set", "model.config_overrides.n_layer=-2"],
     "model.config_overrides.n_layer: -2 is not above zero"),
    ("override-vocab-below-tokenizer", lambda t: ["recipe", "validate", "quickstart",
                                                  "--set", "model.config_overrides.vocab_size=10"],
     "vocabulary of 10 is smaller than the tokenizer's"),
    ("override-alias-and-name", lambda t: ["recipe", "validate", "quickstart",
                                           "--set", "model.config_overrides.num_hidden_layers=3"],
     "num_hidden_layers and n_layer are the same setting of GPT2Config, given twice"),
    # data
    ("data-smaller-than-a-batch", lambda t: ["recipe", "validate", "quickstart", "--set",
                                             f"data.path={write(t / 'd.jsonl', THREE_ROWS)}"],
     "32 sequences per optimizer step, but the data has only"),
    ("attention-kernel-typo", lambda t: ["recipe", "validate", "quickstart",
                                         "--set", "model.attn_implementation=flash_attention_9"],
     "'flash_attention_9' is not an attention kernel"),
    ("flash-attention-on-cpu", lambda t: ["recipe", "validate", "quickstart",
                                          "--set", "model.attn_implementation=flash_attention_2"],
     "flash_attention_2 needs a CUDA GPU, and this run is on CPU"),
    # accelerate configs
    ("config-infinite-processes", lambda t: ["recipe", "validate", "quickstart", "--accelerate-config",
                                             accelerate_config(t, num_processes=float("inf"))],
     "num_processes: inf must be a whole number"),
    ("config-fsdp-config-a-list", lambda t: ["recipe", "validate", "quickstart", "--accelerate-config",
                                             accelerate_config(t, fsdp_config=[1, 2])],
     "fsdp_config: must be a mapping of keys, found list"),
    ("config-strategy-number-out-of-range", lambda t: ["recipe", "validate", "quickstart", "--accelerate-config",
                                                       accelerate_config(t, fsdp_sharding_strategy=9)],
     "'9' is not an FSDP1 strategy"),
    ("config-precision-named-by-its-own-key", lambda t: ["recipe", "validate", "quickstart", "--accelerate-config",
                                                         accelerate_config(t, mixed_precision="fp8")],
     "acc.yaml: mixed_precision: 'fp8' is not supported"),
    # other commands
    ("slurm-partition-with-a-newline", lambda t: ["slurm", "quickstart", "--nodes", "2", "--gpus-per-node", "4",
                                                  "--partition", "gpu\n#SBATCH --nodes=99", "-o", t / "j.sbatch"],
     "is not a partition name"),
    ("slurm-time-shorter-than-the-warning", lambda t: ["slurm", "quickstart", "--nodes", "2", "--gpus-per-node", "4",
                                                       "--time", "00:04:00", "-o", t / "j.sbatch"],
     "leaves no time to train before the warning signal"),
    ("slurm-time-out-of-range", lambda t: ["slurm", "quickstart", "--nodes", "2", "--gpus-per-node", "4",
                                           "--time", "12:99:99", "-o", t / "j.sbatch"], "is not a SLURM time"),
    ("slurm-onto-a-users-file", lambda t: ["slurm", "quickstart", "--nodes", "2", "--gpus-per-node", "4",
                                           "-o", write(t / "notes.txt", "mine")],
     "exists and was not written by `accel-fsdp slurm`"),
    ("copy-onto-itself", lambda t: ["recipe", "copy", write(t / "r.yaml", "name: r\n"), t / "r.yaml", "--force"],
     "is the recipe being copied"),
    ("copy-under-a-file", lambda t: ["recipe", "copy", "quickstart", write(t / "f", "x") / "my.yaml"],
     "is a file"),
    ("show-a-binary-file", lambda t: ["recipe", "show", write(t / "b.yaml", bytes(range(256)))],
     "not a UTF-8 text file"),
    ("estimate-negative-option", lambda t: ["estimate", "gpt2", "--gpus", "-2"],
     "--gpus / --gpus-per-node: -2 is not in the range"),
    ("estimate-negative-exponent", lambda t: ["estimate", "-1e-5"], "-1e-5: is not a parameter count"),
    ("estimate-beyond-context", lambda t: ["estimate", "gpt2", "--seq-len", "100000"],
     "100000 exceeds gpt2's context of 1024 tokens"),
    ("click-usage-errors-read-the-same", lambda t: ["estimate", "gpt2", "--gpus", "0"],
     "--gpus / --gpus-per-node: 0 is not in the range 1<=x<=4096"),
    ("generate-nan-temperature", lambda t: ["generate", t, "--prompt", "a", "--temperature", "nan"],
     "--temperature: nan is not a finite number"),
    ("gpu-memory-without-dry-run", lambda t: ["recipe", "run", "quickstart", "--gpu-memory", "24GB"],
     "--gpu-memory: only applies to --dry-run"),
    ("shard-size-of-no-bytes", lambda t: ["checkpoint", "consolidate", t, t / "out", "--max-shard-size", "0.0001KB"],
     "'0.0001KB' is not a size"),
    # paths a command cannot write: permission bits do not tell root (a pseudo filesystem, a read-only mount)
    ("output-dir-where-no-folder-can-be-made", lambda t: ["recipe", "run", "quickstart", "--output-dir",
                                                          "/proc/accel-fsdp-run"],
     "/proc/accel-fsdp-run: cannot be written: creating a folder in /proc fails"),
    ("checkpoint-dir-where-no-folder-can-be-made", lambda t: ["recipe", "run", "quickstart", "--output-dir", t / "r",
                                                              "--set", "checkpoint.dir=/proc/accel-fsdp-ckpt"],
     "choose another checkpoint.dir"),
    ("checkpoint-dir-in-the-export", lambda t: ["recipe", "run", "quickstart", "--output-dir", t / "r",
                                                "--set", "checkpoint.dir=final/ckpt"],
     "is the exported model's folder (final/) or inside it"),
    ("copy-to-a-path-that-cannot-be-made", lambda t: ["recipe", "copy", "gpt2", "/proc/accel-fsdp.yaml"],
     "/proc/accel-fsdp.yaml: No such file or directory"),
    ("cache-is-a-file", lambda t: ["data", "prepare", "quickstart", "--set", "data.path=" + str(
        write(t / "d.jsonl", THREE_ROWS))], "accel-fsdp-cache-file' is a file, not a folder"),  # named: ACCEL_FSDP_CACHE
    ("plot-in-no-image-format", lambda t: ["data", "show", "quickstart", "--plot", t / "lengths.yaml"],
     "lengths.yaml: the suffix does not name an image format"),
    ("plot-a-folder", lambda t: ["data", "show", "quickstart", "--plot", t], "is a folder"),
    ("name-with-a-slash", lambda t: ["recipe", "validate", "quickstart", "--set", "name=../../elsewhere"],
     "'../../elsewhere' cannot be a folder name"),
    ("max-steps-beyond-any-machine", lambda t: ["recipe", "validate", "quickstart", "--set",
                                                "training.max_steps=99999999999999999999999"],
     "steps would outlast any machine"),
    ("invalid-json-says-its-column", lambda t: ["data", "prepare", "quickstart", "--set", "data.path=" + str(
        write(t / "d.jsonl", '{"text": "a\tb"}'))], "line 1: invalid JSON (Invalid control character at column 12)"),
]


@pytest.mark.parametrize("name,make_args,expected", CORPUS, ids=[c[0] for c in CORPUS])
def test_bad_input_corpus(tmp_path, monkeypatch, name, make_args, expected):
    monkeypatch.chdir(tmp_path)
    if name == "cache-is-a-file":
        monkeypatch.setenv("ACCEL_FSDP_CACHE", str(write(tmp_path / "accel-fsdp-cache-file", "x")))
    msg = user_error(*make_args(tmp_path))
    assert expected in msg, msg
    assert "fix:" in msg


def test_a_moved_run_folder_uses_its_own_checkpoints(tmp_path):
    """run.json records the checkpoint folder relative to the run folder: a copy inspects its own checkpoints."""
    import shutil

    original = fake_run(tmp_path / "original", "hhhh")
    data = json.loads((original / "run.json").read_text())
    data["checkpoint_dir"] = "checkpoints"
    (original / "run.json").write_text(json.dumps(data))
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    shutil.rmtree(copy / "checkpoints" / "step-000003")
    msg = user_error("checkpoint", "consolidate", copy, tmp_path / "out")
    assert str(original) not in msg and "no complete checkpoint found" in msg


def test_a_newer_damaged_checkpoint_passed_over_is_named(tmp_path):
    """Given a run folder, consolidate and --resume take the newest complete checkpoint; a newer one that is damaged
    is said, not skipped in silence."""
    from accel_fsdp.checkpoint.index import resolve_checkpoint

    run = fake_run(tmp_path / "run", "hhhh", checkpoint_steps=(3, 6))
    manifest = run / "checkpoints" / "step-000006" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"step": 6', '"step": "six"'))
    point = resolve_checkpoint(run)
    assert point.checkpoint.name == "step-000003"
    assert [(c.name, "step 'six' is not a step number" in c.reason) for c in point.passed_over] == [
        ("step-000006", True)]


# ------------------------------------------------------------------------------- found by a second probe


def story_rows(n: int) -> str:
    return "\n".join(json.dumps({"text": f"row {i}: mia has a pink horse . the horse is sleepy ."}) for i in range(n))


def ok(*args) -> str:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, f"exit status {result.exit_code}, output:\n{result.output}"
    return result.output


def test_a_section_given_as_a_mapping_changes_only_the_keys_it_names():
    from accel_fsdp.config.recipe import load_recipe

    shipped = load_recipe(shipped_recipes()["quickstart"])
    r = load_recipe(shipped_recipes()["quickstart"], ["training={lr: 0.5, warmup_steps: 3}"])
    assert (r.training.lr, r.training.warmup_steps) == (0.5, 3)
    assert r.training.global_batch_size == shipped.training.global_batch_size != 8
    assert r.training.max_steps == shipped.training.max_steps


def test_a_value_that_cannot_be_read_is_not_judged_again():
    msg = user_error("recipe", "validate", "quickstart-dpo", "--set", "training.method=dpoo")
    assert "found 'dpoo'" in msg and "training.method is sft" not in msg
    assert user_error("recipe", "validate", "quickstart", "--set", "data.max_rows=0").count("must be positive") == 1


def test_a_relative_data_path_naming_two_files_is_refused(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    write(tmp_path / "d.jsonl", story_rows(3000))
    write(tmp_path / "sub" / "d.jsonl", story_rows(4000))
    r = recipe_with(tmp_path / "sub", "").read_text().replace("path: builtin:quickstart", "path: d.jsonl")
    write(tmp_path / "sub" / "r.yaml", r)
    monkeypatch.chdir(tmp_path)
    msg = user_error("data", "prepare", tmp_path / "sub" / "r.yaml")
    assert "d.jsonl names two different files" in msg and "write ./d.jsonl for the first" in msg
    assert "3,000 rows read" in ok("data", "prepare", tmp_path / "sub" / "r.yaml", "--set", "data.path=./d.jsonl")


def test_preference_answers_that_differ_only_beyond_seq_len_are_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    long = " ".join(["mia has a pink horse ."] * 40)
    rows = [{"prompt": f"q {i}", "chosen": long + " yes", "rejected": long + " no"} for i in range(50)]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    msg = user_error("data", "prepare", "quickstart-dpo", "--set", f"data.path={path}")
    assert "p.jsonl line 1: the chosen and the rejected answer are the same once cut to data.seq_len" in msg


def test_data_show_decodes_both_answers_of_a_pair():
    out = ok("data", "show", "quickstart-dpo", "--sequences", "2")
    assert "chosen (" in out and "rejected (" in out


def test_a_damaged_cache_entry_is_built_again(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = write(tmp_path / "d.jsonl", story_rows(3000))
    first = ok("data", "prepare", "quickstart", "--set", f"data.path={data}")
    folder = Path(first.split("; ")[-1].strip().splitlines()[0])
    tokens = folder / "train" / "tokens.bin"
    whole = tokens.read_bytes()
    tokens.write_bytes(whole[:10])
    result = CliRunner().invoke(main, ["data", "prepare", "quickstart", "--set", f"data.path={data}"])
    assert result.exit_code == 0 and "is damaged (train/tokens.bin is 10 bytes" in result.output, result.output
    assert tokens.read_bytes() == whole


def test_a_tokenizer_learns_from_preference_pairs(tmp_path):
    out = ok("tokenizer", "train", "quickstart-dpo", tmp_path / "tok", "--vocab-size", "1000")
    learned = int(out.split(" tokens ")[0].split()[-1].replace(",", ""))
    assert learned > 262 + 100, out  # 262: the bytes and special tokens alone, what nothing to learn from gives


def test_lora_targets_are_found_on_a_model_built_from_its_code(tmp_path):
    ok("recipe", "validate", "quickstart-llama", "--set", "model.trust_remote_code=true",
       "--set", "model.lora.enabled=true")


def test_resuming_past_the_last_step_is_refused_before_launch(tmp_path):
    run = fake_run(tmp_path / "run", "a" * 16, checkpoint_steps=(6,), overrides=["training.warmup_steps=1"])
    (run / "checkpoints" / "step-000006" / "recipe.yaml").write_text((run / "recipe.yaml").read_text())
    before = snapshot(run)
    msg = user_error("recipe", "run", "quickstart", "--output-dir", run, "--resume", "--set", "training.max_steps=4",
                     "--set", "training.warmup_steps=1")
    assert "this run would end at step 4, before its checkpoint step-000006 (step 6)" in msg
    assert snapshot(run) == before


def test_resume_from_an_older_checkpoint_sets_the_abandoned_ones_aside(tmp_path):
    from accel_fsdp.layout import RunLayout
    from accel_fsdp.run.folder import set_aside_newer

    run = fake_run(tmp_path / "run", "a" * 16, checkpoint_steps=(2, 4, 6, 8))
    layout = RunLayout.at(run)
    assert set_aside_newer(layout, run / "checkpoints" / "step-000004") == ["step-000006", "step-000008"]
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-000002", "step-000004"]
    (aside,) = (run / "checkpoints").glob("abandoned-*")
    assert sorted(p.name for p in aside.iterdir()) == ["step-000006", "step-000008"]
    assert set_aside_newer(layout, run / "checkpoints" / "step-000004") == []


@pytest.mark.parametrize("how", ["changed", "truncated"])
def test_resume_auto_with_every_checkpoint_damaged_stops_naming_each_and_changes_nothing(tmp_path, how):
    """A checkpoint cut short and one whose bytes changed end alike (it started the run again over the first, deleting
    it, and stopped at the second); a run that never saved a checkpoint starts again."""
    from accel_fsdp.config.recipe import load_recipe
    from accel_fsdp.layout import RunLayout
    from accel_fsdp.run.folder import Decision, decide

    run = fake_run(tmp_path / "run", "a" * 16, checkpoint_steps=(3, 6))
    for step in (3, 6):
        weights = run / "checkpoints" / f"step-{step:06d}" / "weights"
        weights.write_bytes(b"w" * 9 + b"x" if how == "changed" else b"cut")
        if how == "changed":  # fake_run's manifests have no CRC-32s: give them the original bytes'
            manifest = json.loads((weights.parent / "manifest.json").read_text())
            manifest["crc32"] = {"weights": format(zlib.crc32(b"w" * 10), "08x")}
            (weights.parent / "manifest.json").write_text(json.dumps(manifest))
    before = snapshot(run)
    msg = user_error("recipe", "run", "quickstart", "--output-dir", run, "--resume", "auto")
    reason = "changed since it was saved" if how == "changed" else "weights has 3 bytes, the manifest says 10"
    assert "--resume found no complete checkpoint; not usable: step-000003 (weights" in msg and reason in msg, msg
    assert "step-000006 (weights" in msg
    assert snapshot(run) == before
    for step in (3, 6):
        shutil.rmtree(run / "checkpoints" / f"step-{step:06d}")
    (run / "checkpoints" / ".tmp-step-000009").mkdir()  # a save that never finished: not a checkpoint saved
    assert decide(RunLayout.at(run), load_recipe(shipped_recipes()["quickstart"]), resume="auto") == Decision.RESTART


def test_step_folders_set_aside_twice_within_a_second_are_both_kept(tmp_path):
    from accel_fsdp.run.folder import DAMAGED, move_aside

    kept = []
    for content in (b"first", b"second"):
        (tmp_path / "step-000004").mkdir()
        (tmp_path / "step-000004" / "weights").write_bytes(content)
        kept.append(move_aside(tmp_path, [tmp_path / "step-000004"], DAMAGED))
    assert kept[0] != kept[1]
    assert [(k / "step-000004" / "weights").read_bytes() for k in kept] == [b"first", b"second"]


def test_a_preemption_signal_after_the_run_finished_ends_it_with_0(tmp_path, capsys):
    import time

    from accel_fsdp.launch.launcher import _preempted
    from accel_fsdp.layout import RunLayout, record_finished
    from accel_fsdp.train.lifetime import PREEMPTED

    run = fake_run(tmp_path / "run", "a" * 16)
    started = time.time()
    assert _preempted("SIGTERM", run, started) == PREEMPTED
    assert "--resume auto" in capsys.readouterr().err
    record_finished(RunLayout.at(run))
    assert _preempted("SIGTERM", run, started) == 0
    assert _preempted("SIGTERM", run, time.time() + 60) == PREEMPTED  # finished by an earlier launch


def test_a_failed_save_says_why(tmp_path, monkeypatch):
    import errno

    from accel_fsdp.checkpoint import store

    cause, fix = store._save_error_cause(PermissionError(errno.EACCES, "Permission denied", "/x/ckpt"), tmp_path)
    assert cause == "Permission denied (/x/ckpt)" and "writable" in fix
    cause, fix = store._save_error_cause(OSError(errno.ENOSPC, "No space left on device"), tmp_path)
    assert cause == "No space left on device" and "free disk space" in fix
    monkeypatch.setattr(store, "_free_bytes", lambda folder: 3 * 2**20)
    cause, _ = store._save_error_cause(RuntimeError("[enforce fail at inline_container.cc] unexpected pos"), tmp_path)
    assert cause.startswith("the disk is full (3.0 MiB free there")


def test_an_export_killed_half_way_is_swept_and_exports_are_readable_by_the_group(tmp_path):
    import socket as sockets
    import stat

    from accel_fsdp.checkpoint.consolidate import _readable_as_umask_says
    from accel_fsdp.files import remove_dead_temporaries

    out = tmp_path / "out"
    host = sockets.gethostname()
    dead, alive = tmp_path / f".out.tmp-{host}-999999999-0a1b2c3d", tmp_path / f".out.tmp-{host}-{os.getppid()}-00ff"
    other = tmp_path / ".out.tmp-another-machine-1-0a1b2c3d"
    for folder in (dead, alive, other):
        folder.mkdir()
    remove_dead_temporaries(out)
    assert not dead.exists() and alive.exists() and other.exists()
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"x")
    weights.chmod(0o600)
    old = os.umask(0o022)
    try:
        _readable_as_umask_says(tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(weights.stat().st_mode) == 0o644


def test_a_csv_of_a_header_alone_and_a_base_model_without_merge_are_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    msg = user_error("data", "prepare", "quickstart", "--set", f"data.path={write(tmp_path / 'h.csv', 'text,label')}")
    assert "h.csv): has a header line and no rows" in msg and "add rows below the header" in msg
    msg = user_error("checkpoint", "consolidate", fake_run(tmp_path / "run", "a" * 16), tmp_path / "out",
                     "--base-model", "gpt2")
    assert "--base-model: only applies to --merge" in msg


def test_an_export_of_another_run_is_not_replaced(tmp_path):
    from accel_fsdp.checkpoint.consolidate import _check_destination
    from accel_fsdp.layout import EXPORT_RECORD

    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"w")
    (out / EXPORT_RECORD).write_text(json.dumps({"files": ["model.safetensors"], "run_id": "b" * 16}))
    _check_destination(out, "b" * 16)  # its own run's export: replaced
    with pytest.raises(Exception, match=r"holds an export of another run \(run b{16}; this checkpoint is of run a{16}"):
        _check_destination(out, "a" * 16)


def test_text_the_tokenizer_does_not_know_is_warned_about(tmp_path, monkeypatch):
    """The built-in word-level tokenizer knows the built-in stories' words only: on other English text most tokens
    are <unk>, and a run would learn nothing from them."""
    monkeypatch.chdir(tmp_path)
    words = "the quick brown fox jumps over a lazy dog while zebras quietly graze".split()
    rows = [{"text": " ".join(words[(i + k) % len(words)] for k in range(30))} for i in range(3000)]
    out = ok("data", "prepare", "quickstart", "--set", f"data.path={write_jsonl(tmp_path / 'eng.jsonl', rows)}")
    assert "of the tokens" in out and "are the tokenizer's unknown token" in out and "bpe:8192" in out
    assert "unknown token" not in ok("data", "prepare", "quickstart")  # the stories it was made for
