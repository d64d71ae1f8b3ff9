"""The reference of DPO as one object: what its cache key covers, where its log-probabilities go when the cache cannot
take them, and ranks that agree whether to read or compute them (a cache per machine, on loopback)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import (cli_process, cpu_config, free_port, read_metrics, run_cli, run_in_process,
                      save_tiny_model)

from accel_fsdp.config.recipe import recipe_from_text
from accel_fsdp.data import identity
from accel_fsdp.errors import UserError
from accel_fsdp.train import reference as reference_lib

SETTINGS = SimpleNamespace(mixed_precision=SimpleNamespace(value="bf16"))
SMALL = ["--set", "data.max_rows=400", "--set", "training.max_steps=3", "--set", "training.warmup_steps=0",
         "--set", "training.eval_every_steps=null", "--set", "checkpoint.every_steps=null",
         "--set", "checkpoint.export_final=false", "--set", "training.mixed_precision=fp32"]
"""quickstart-dpo, small: 400 rows (392 training pairs), 3 steps, no evaluation before the end, no export."""


def test_the_cache_key_covers_config_overrides_and_the_libraries_of_the_forward(tmp_path, monkeypatch):
    folder = save_tiny_model(tmp_path / "m", "gpt2")

    def key(overrides="{}"):
        recipe = recipe_from_text(f"model: {{name_or_path: '{folder}', config_overrides: {overrides}}}\n"
                                  "data: {path: x.jsonl, format: preference}\ntraining: {method: dpo}\n", source="r")
        return reference_lib.starting_weights_key(recipe, SETTINGS)

    plain = key()
    assert key() == plain
    assert key("{attn_pdrop: 0.1}") != plain  # an override of a pretrained model's config changes its forward
    real = identity.metadata.version
    for library in ("torch", "transformers", "peft"):
        monkeypatch.setattr(identity.metadata, "version", lambda name, lib=library: "0.0" if name == lib
                            else real(name))
        assert key() != plain, library
    monkeypatch.setattr(identity.metadata, "version", real)
    assert key() == plain


def arrays() -> dict[str, np.ndarray]:
    return {"train": np.arange(8, dtype=np.float32) - 40, "eval": np.arange(4, dtype=np.float32) - 20}


def test_a_cache_that_cannot_be_written_sends_the_reference_to_the_run_folder(tmp_path, monkeypatch):
    cache, run_folder = tmp_path / "cache" / "reference" / "k", tmp_path / "run" / "reference" / "source" / "k"
    real = reference_lib._write_reference

    def read_only(folder, values, seconds):  # what a read-only cache does for a user other than root
        if folder == cache:
            raise PermissionError(13, "Permission denied")
        real(folder, values, seconds)

    monkeypatch.setattr(reference_lib, "_write_reference", read_only)
    where, note = reference_lib._store((cache, run_folder), arrays(), 1.5)
    assert where == run_folder and "cannot be written (Permission denied): kept under the run folder" in note
    source = SimpleNamespace(units=lambda split: {"train": 4, "eval": 2}[split])
    assert reference_lib._complete(run_folder, source) and not cache.exists()
    data = SimpleNamespace(sources=[source])
    assert reference_lib._load(data, [run_folder])[0]["train"].tolist() == arrays()["train"].tolist()

    monkeypatch.setattr(reference_lib, "_write_reference", lambda *a: (_ for _ in ()).throw(OSError(30, "Read-only")))
    with pytest.raises(UserError, match=r"cannot be written \(Read-only\), and neither can .*: the reference "
                       r"log-probabilities have nowhere to go"):
        reference_lib._store((cache, run_folder), arrays(), 1.5)


def test_a_damaged_or_cut_reference_table_is_not_read(tmp_path):
    folder = tmp_path / "k"
    reference_lib._write_reference(folder, arrays(), 1.0)
    source = SimpleNamespace(units=lambda split: {"train": 4, "eval": 2}[split])
    assert reference_lib._complete(folder, source)
    table = bytearray((folder / "train.bin").read_bytes())
    table[5] ^= 1  # same size, one bit flipped
    (folder / "train.bin").write_bytes(bytes(table))
    assert not reference_lib._complete(folder, source)
    (folder / "train.bin").write_bytes(bytes(table[:-4]))
    assert not reference_lib._complete(folder, source)
    assert not list(folder.glob(".*tmp*"))  # no temporary file left behind


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_prepared_cache_that_cannot_be_written_does_not_stop_a_dpo_run(tmp_path):
    """`data prepare` on one machine, then the run where the cache cannot be written. As root, chmod stops nothing:
    a file where the reference's folder must go makes the cache refuse it the same way."""
    env = {"ACCEL_FSDP_CACHE": str(tmp_path / "cache")}
    run_in_process("data", "prepare", "quickstart-dpo", *SMALL, env=env, check=0)
    [entry] = [p for p in (tmp_path / "cache" / "tokenized").iterdir() if p.is_dir() and not p.name.startswith(".")]
    (entry / "reference").write_text("not a folder")
    run = tmp_path / "run"
    first = run_cli("recipe", "run", "quickstart-dpo", "--output-dir", run, *SMALL, env=env, check=0)
    assert f"the cache {entry / 'reference'} cannot be written" in first.stdout, first.stdout
    assert "kept under the run folder instead" in first.stdout
    assert list((run / "reference" / "quickstart-pref").glob("*/done.json"))
    # A resumed run reads them back from the run folder, and no library warning about read-only arrays reaches it.
    again = run_cli("recipe", "run", "quickstart-dpo", "--output-dir", run, "--resume", *SMALL,
                    "--set", "training.max_steps=4", env=env, check=0)
    assert "read from the run folder" in again.stdout, again.stdout
    assert "not writable" not in again.stdout + again.stderr
    assert [r["step"] for r in read_metrics(run) if r["kind"] == "train"] == [1, 2, 3, 4]


def two_machines(tmp_path: Path, name: str, caches: dict[int, Path]) -> list[tuple[int, str, str]]:
    """quickstart-dpo (small) as a job of two machines of one rank each on loopback, each with its own cache folder."""

    config = cpu_config(tmp_path / f"{name}.yaml", num_machines=2, num_processes=2, main_process_ip="127.0.0.1",
                        main_process_port=free_port(), rdzv_backend="static", same_network=True)
    procs = [cli_process("recipe", "run", "quickstart-dpo", "--output-dir", tmp_path / name, *SMALL,
                         "--set", "fsdp.collective_timeout_minutes=1", "--accelerate-config", config,
                         "--machine-rank", rank, env={"ACCEL_FSDP_CACHE": str(caches[rank])}) for rank in (1, 0)]
    outputs = [p.communicate(timeout=600) for p in procs]
    return [(p.returncode, *output) for p, output in zip(procs, outputs)]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_machines_with_caches_of_their_own_agree_to_compute_the_reference(tmp_path):
    """Machine 0's cache holds the reference (from an earlier run), machine 1's is empty: every rank computes it
    (the forwards are collective), and the losses are those of a run on one shared cache. Deciding per rank, machine 0
    trained while machine 1 ran reference forwards, until the collective timeout (1 minute here)."""
    shared, empty = tmp_path / "cache0", tmp_path / "cache1"
    for code, _, stderr in two_machines(tmp_path, "shared", {0: shared, 1: shared}):
        assert code == 0, stderr[-3000:]
    results = two_machines(tmp_path, "split", {0: shared, 1: empty})
    for code, _, stderr in results:
        assert code == 0, stderr[-3000:]
    assert "reference: log-probabilities of the starting weights" in results[1][1]  # machine 0 computed them too
    assert list((empty / "tokenized").glob("*/reference/*/done.json"))  # machine 1 stored them in its own cache

    def losses(name):
        return [r["loss"] for r in read_metrics(tmp_path / name) if r["kind"] == "train"]

    assert losses("split") == losses("shared") and len(losses("split")) == 3


def test_a_batch_of_a_cached_reference_is_copied_out_of_the_read_only_arrays(tmp_path, monkeypatch):
    """A tensor over a read-only NumPy array (the cache, memory-mapped) is what torch warns about on every rank; torch
    warns once per process, so the test looks at what reaches it."""
    import torch

    reference_lib._write_reference(tmp_path / "k", arrays(), 1.0)
    read_only = [{split: np.memmap(tmp_path / "k" / f"{split}.bin", dtype=np.float32, mode="r")
                  for split in ("train", "eval")}]
    real = torch.from_numpy

    def strict(array):
        assert array.flags.writeable, "a tensor over a read-only array"
        return real(array)

    monkeypatch.setattr(torch, "from_numpy", strict)
    batch = {"labels": torch.zeros(4, 3, dtype=torch.long)}
    reference_lib.Precomputed(read_only, "the cache", 0.0, 6).attach(batch, [(0, 1), (0, 3)], "train")
    assert batch["reference_logps"].tolist() == [-38.0, -37.0, -34.0, -33.0]
