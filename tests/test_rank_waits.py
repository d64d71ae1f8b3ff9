"""A stage whose length nobody knows (the first rank of each machine preparing the data or training a tokenizer) is
waited for in the process group's store (train/waiting.py), and a user's mistake found there by one rank ends the job
with that one message: the rank that found it says it (or records it for our launcher, which says it once), and
every other rank ends quietly with PEER_FAILED, without a traceback, a message of its own or a step past the stage.

Two real processes on a gloo process group, each calling `wait_for_every_rank` inside `run_rank` as setup does; no
model, no data, no launcher (its part, saying the records, is `ended_early`).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO

from accel_fsdp.launch.launcher import ended_early
from accel_fsdp.train.lifetime import PEER_FAILED, RANK_RECORDS_ENV, STOPPED, USER_ERROR, RankRecords

pytestmark = pytest.mark.multiprocess

MESSAGE = "data.path: stories.jsonl line 3: not JSON"
RANK = """
import os
import torch.distributed as dist
from accel_fsdp.errors import Problem, UserError
from accel_fsdp.train.lifetime import doing, run_rank
from accel_fsdp.train.waiting import wait_for_every_rank


class Ranks:  # what the wait reads of the Accelerator
    num_processes, process_index = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    is_main_process = process_index == 0


def stage():
    dist.init_process_group("gloo")
    doing("the preparation of the data")
    failed = Ranks.process_index == int(os.environ["FAILING_RANK"])
    error = UserError(Problem("data.path", "stories.jsonl line 3: not JSON", "fix the line"), rank_local=failed)
    wait_for_every_rank(Ranks, "data", "prepare the data", error if failed else None)
    print(f"rank {Ranks.process_index} went on past the stage", flush=True)


run_rank(stage)
"""


def run_ranks(tmp_path, failing_rank: int, records: bool) -> list[subprocess.CompletedProcess]:
    """Both ranks' outputs. The store is this process's, as torchrun's agent hosts it (TORCHELASTIC_USE_AGENT_STORE:
    torch/distributed/rendezvous.py `_create_c10d_store`, torch 2.13.0), so it outlives a rank that ends first."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE="2",
               LOCAL_WORLD_SIZE="2", FAILING_RANK=str(failing_rank), PYTHONUNBUFFERED="1",
               TORCHELASTIC_USE_AGENT_STORE="True")
    env.pop(RANK_RECORDS_ENV, None)
    if records:
        env[RANK_RECORDS_ENV] = str(tmp_path / "records")
        (tmp_path / "records").mkdir()
    ranks = [subprocess.Popen([sys.executable, "-c", RANK], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(2)]
    out = []
    for proc in ranks:
        stdout, stderr = proc.communicate(timeout=300)
        out.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    del store  # after both ranks ended
    return out


@pytest.mark.parametrize("failing_rank", [1, pytest.param(0, marks=pytest.mark.slow)])
def test_a_mistake_one_rank_finds_while_the_others_wait_is_one_message_and_the_others_end_quietly(
        tmp_path, capsys, failing_rank):
    ranks = run_ranks(tmp_path, failing_rank, records=True)
    peer = ranks[1 - failing_rank]
    assert [p.returncode for p in ranks][failing_rank] == 2, ranks
    assert peer.returncode == PEER_FAILED and peer.stdout == peer.stderr == "", peer  # quiet, and no further
    assert ranks[failing_rank].stdout == ranks[failing_rank].stderr == "", ranks  # our launcher says it
    records = RankRecords(tmp_path / "records").read()
    assert {r: (records[r].why, records[r].doing) for r in records} == {
        failing_rank: (USER_ERROR, "the preparation of the data"),
        1 - failing_rank: (STOPPED, "the preparation of the data")}
    assert ended_early(records, range(2), 1) == 2
    assert capsys.readouterr().err == f"error: {MESSAGE}\n    fix: fix the line\n"


@pytest.mark.slow
def test_under_a_launcher_that_is_not_ours_the_rank_that_found_it_says_it_and_the_other_one_line(tmp_path):
    ranks = run_ranks(tmp_path, failing_rank=1, records=False)
    assert [p.returncode for p in ranks] == [PEER_FAILED, 2], ranks
    assert ranks[1].stderr == f"error: {MESSAGE}\n    fix: fix the line\n" and ranks[1].stdout == ""
    assert ranks[0].stderr == ("[rank 0] stopped in the preparation of the data: another rank left (its output says "
                               "why)\n") and ranks[0].stdout == ""
