"""Waiting for every rank to finish a stage whose length nobody knows (the first rank of each machine tokenizing a
large dataset, or training a tokenizer on it), without a collective that the stage could outlast.

A collective (a barrier, `gather_object`) ends in a gloo or NCCL timeout after `fsdp.collective_timeout_minutes`,
with a traceback that names no stage. Here each rank says it is done (or failed) in the process group's key-value
store, which every launcher creates (torch.distributed's default store: c10d `_get_default_store`, checked with torch
2.13.0), and polls it, so the wait outlasts any collective timeout. It has a limit of its own, `WAIT_LIMIT_S`; past
it, one message says which stage was waited for and how many ranks had not finished it. The main process, when it
waits on other machines, says so every `NOTE_EVERY_S`.
"""

from __future__ import annotations

import time

from accel_fsdp.errors import Problem, UserError
from accel_fsdp.train.lifetime import STOPPED, RankRecords, end_after_collective_failure

WAIT_LIMIT_S = 24 * 3600
"""How long a rank waits for the others to finish a stage: longer than any tokenization of a dataset (a builder that
fails or dies ends the job at once: its error is shared here, its death ends the launcher)."""
NOTE_EVERY_S = 600
"""How often the main process, waiting on other machines, says what it waits for."""
POLL_LATE_FRACTION = 0.05
"""A waiting rank looks at the store again after this fraction of the time it has waited (at least `POLL_MIN_S`, at
most `POLL_MAX_S`): it learns that the others are done at most 5% late. A wait of seconds (the first rank loading a
tokenizer while the others wait) ends within a few tenths; a fixed growth to 2 s between looks made a rank that
waited 4 s up to 2 s late, and the rank ahead then waited for it at the next collective. A look is one round trip to
the store."""
POLL_MIN_S, POLL_MAX_S = 0.02, 2.0


def poll_pause(waited_s: float) -> float:
    """Seconds until the next look at the store, after `waited_s` of waiting."""
    return min(POLL_MAX_S, max(POLL_MIN_S, waited_s * POLL_LATE_FRACTION))


def wait_for_every_rank(accelerator, stage: str, what: str, error: UserError | None, *,
                        limit_s: float = WAIT_LIMIT_S, say=print) -> None:
    """Collective in effect: every rank calls it once per `stage` (a key of the store), after its part of the work,
    with the UserError it met or None. Returns when every rank got there and none failed; raises this rank's own
    error; when another rank failed, this one ends quietly with PEER_FAILED (lifetime.py: the failing rank, or our
    launcher, says why). `what` names the work for the messages ("prepare the data")."""
    if accelerator.num_processes == 1:
        if error is not None:
            raise error
        return
    from torch.distributed.distributed_c10d import _get_default_store

    store, world = _get_default_store(), accelerator.num_processes
    failed, arrived, everyone = (f"accel-fsdp/{stage}/failed", f"accel-fsdp/{stage}/arrived",
                                 f"accel-fsdp/{stage}/everyone")
    if error is not None:
        store.add(failed, 1)  # before arriving: once everyone has arrived, every failure is counted
    if store.add(arrived, 1) == world:
        store.set(everyone, "1")
    start, noted = time.monotonic(), 0.0
    while not store.check([everyone]):  # polled: a blocking wait on the store logs a line at each timeout
        waited = time.monotonic() - start
        if waited > limit_s:
            missing = world - store.add(arrived, 0)
            raise UserError(Problem(f"rank {accelerator.process_index}", f"waited {waited / 60:.0f} min for the "
                                    f"other ranks to {what}, and {missing} of {world} have not finished",
                                    "look at what the first rank of each machine is doing (its log), or prepare "
                                    "it ahead of the run (accel-fsdp data prepare) and start again"), rank_local=True)
        if accelerator.is_main_process and waited - noted >= NOTE_EVERY_S:
            noted = waited
            say(f"waiting for the other ranks to {what}: {store.add(arrived, 0)} of {world} done after "
                f"{waited / 60:.0f} min")
        time.sleep(poll_pause(waited))
    if error is not None:
        raise error
    if store.add(failed, 0):  # the rank that failed says why (lifetime.py): this one ends quietly, as a peer's
        end_after_collective_failure(STOPPED, None, RankRecords.from_env())
