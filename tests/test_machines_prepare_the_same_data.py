"""Each machine prepares the run's data itself (its first rank, from its own cache): after a requeue onto other nodes
with a cache on each node's own disk, or with a data file copied to each machine, the ranks must still read the same
sequences. Data that differs between machines is one message before any weight is read, where it trained the ranks
on different data silently (and, with different counts, left ranks waiting at the end for ranks that had stopped)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import cli_process, cpu_config, free_port, tiny_recipe, write_jsonl

from accel_fsdp.errors import UserError

STORIES = [{"text": f"story {i}: " + "alice has a cat and the cat has a hat. " * (i % 5 + 1)} for i in range(300)]


def prepared(recipe_path: Path, cache: Path, monkeypatch):
    """The data of a recipe as a machine with this cache prepares it."""
    from accel_fsdp.config.recipe import load_recipe
    from accel_fsdp.data.prepare import prepare_data
    from accel_fsdp.model.tokenizer import build_tokenizer

    monkeypatch.setenv("ACCEL_FSDP_CACHE", str(cache))
    recipe = load_recipe(recipe_path)
    return prepare_data(recipe, build_tokenizer(recipe))


def test_the_datas_digest_is_what_training_reads_not_where_it_was_prepared(tmp_path, tiny_gpt2, monkeypatch):
    """The same rows prepared from two copies (other paths, other times) in two caches: one digest; a copy that lost
    its last row, or changed one word of it: another."""
    digests = {}
    for name, rows in (("copy-a", STORIES), ("copy-b", STORIES), ("shorter", STORIES[:-1]),
                       ("one-word", STORIES[:-1] + [{"text": STORIES[-1]["text"].replace("alice", "bob")}])):
        (tmp_path / name).mkdir()
        data = write_jsonl(tmp_path / name / "stories.jsonl", rows)
        recipe = tiny_recipe(tmp_path / name / "r.yaml", tiny_gpt2, data)
        digests[name] = prepared(recipe, tmp_path / name / "cache", monkeypatch).content_digest()
    assert digests["copy-a"] == digests["copy-b"]
    assert len(set(digests.values())) == 3
    assert all(0 < d < 1 << 63 for d in digests.values())  # an int64 for the collective


class TwoRanks:
    """A stand-in accelerator of 2 ranks whose other rank prepared `theirs` (gather: rank 0's values, then rank 1's)."""

    num_processes, device = 2, "cpu"

    def __init__(self, theirs):
        self.theirs = theirs

    def gather(self, mine):
        import torch

        return torch.cat([mine, torch.tensor([self.theirs.content_digest(), len(self.theirs)])])


def test_ranks_that_prepared_different_data_are_one_message(tmp_path, tiny_gpt2, monkeypatch):
    from accel_fsdp.train.sharding import check_same_data

    data = {}
    for name, rows in (("mine", STORIES), ("theirs", STORIES[:-20])):
        (tmp_path / name).mkdir()
        recipe = tiny_recipe(tmp_path / name / "r.yaml", tiny_gpt2, write_jsonl(tmp_path / name / "d.jsonl", rows))
        data[name] = prepared(recipe, tmp_path / name / "cache", monkeypatch)
    check_same_data(TwoRanks(data["mine"]), data["mine"])  # the same: nothing to say
    with pytest.raises(UserError, match=rf"(?s)data: the machines prepared different data \(rank 0: "
                                        rf"{len(data['mine']):,} training units; rank 1: {len(data['theirs']):,} "
                                        r"training units, differing in count or content\).*fix: give every machine "
                                        r"the same data: data.path on a filesystem every machine sees"):
        check_same_data(TwoRanks(data["theirs"]), data["mine"])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_machines_given_different_copies_of_the_data_stop_before_training(tmp_path, tiny_gpt2):
    """Two machines on loopback, each with its own copy of the data (and its own cache), the copies differing: both
    stop with the message, exit 2, before the model is loaded; nothing is trained."""
    config = cpu_config(tmp_path / "two.yaml", num_machines=2, num_processes=2, main_process_ip="127.0.0.1",
                        main_process_port=free_port(), rdzv_backend="static", same_network=True)
    run = tmp_path / "run"
    procs = []
    for machine, rows in ((1, STORIES[:-30]), (0, STORIES)):
        (tmp_path / f"machine-{machine}").mkdir()
        data = write_jsonl(tmp_path / f"machine-{machine}" / "stories.jsonl", rows)
        recipe = tiny_recipe(tmp_path / f"machine-{machine}" / "r.yaml", tiny_gpt2, data,
                             training={"max_steps": 2})
        env = {"ACCEL_FSDP_CACHE": str(tmp_path / f"machine-{machine}" / "cache")}
        procs.append(cli_process("recipe", "run", recipe, "--output-dir", run, "--accelerate-config", config,
                                 "--machine-rank", machine, env=env))
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 2, stderr[-3000:]
        assert "data: the machines prepared different data (rank 0: " in stderr and "Traceback" not in stderr
        assert stderr.count("the machines prepared different data") == 1  # each machine says it once
    assert not list(run.rglob("step-*")) and not (run / "metrics.jsonl").exists()  # nothing trained
