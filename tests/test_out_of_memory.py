"""A rank out of memory: on a GPU torch raises, and the rank says it once, as a user's message naming the knobs that
lower its memory (exit status 2); on the host Linux's overcommit usually sends the OOM killer's SIGKILL instead, which
the launcher tells from a `kill -9` by the machine's count of OOM kills. The rank's end is run in this process (its
exit replaced by an exception), the launcher's words from a function: both mechanisms need memory this machine should
not give up."""

from __future__ import annotations

import pytest
from conftest import user_error

from accel_fsdp.train.lifetime import USER_ERROR


CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which 1.23 GiB "
            "is free. Including non-PyTorch memory, this process has 77.86 GiB memory in use. Of the allocated memory "
            "75.20 GiB is allocated by PyTorch, and 1.10 GiB is reserved by PyTorch but unallocated. If reserved but "
            "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
"""torch's text for a CUDA allocation that failed (c10/cuda/CUDACachingAllocator.cpp, torch 2.13.0)."""


def test_the_allocators_advice_is_left_out_of_a_short_message():
    """torch's own advice on its allocator's settings follows the figures; a message short enough kept it whole."""
    from accel_fsdp.errors import allocation_figures

    short = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which 1.23 "
             "GiB is free. If reserved but unallocated memory is large try setting "
             "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True. See documentation for Memory Management")
    assert allocation_figures(RuntimeError(short)) == ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
                                                       "total capacity of 79.10 GiB of which 1.23 GiB is free")


def cuda_failure() -> RuntimeError:
    import torch

    return torch.OutOfMemoryError(CUDA_OOM)


def host_allocation_failure() -> RuntimeError:
    import torch

    try:
        torch.empty(1 << 60, dtype=torch.uint8)  # more than any machine has: the CPU allocator refuses it
    except RuntimeError as e:
        return e
    raise AssertionError("an exabyte was allocated")


@pytest.mark.parametrize("error,kind,said", [
    (cuda_failure, "GPU",
     "out of GPU memory in optimizer step 7 (forward, backward, gradient reduction) (CUDA out of memory. Tried to "
     "allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which 1.23 GiB is free. Including non-PyTorch "
     "memory, this process has 77.86 GiB memory in use)"),
    (host_allocation_failure, "host", "out of host memory in optimizer step 7"),
    (MemoryError, "host", "out of host memory in optimizer step 7"),
], ids=["cuda", "cpu-allocator", "python"])
def test_a_rank_out_of_memory_ends_with_one_message_naming_the_knobs(tmp_path, monkeypatch, error, kind, said):
    """A CUDA out-of-memory error was a traceback from the rank (and its peers' gloo errors), exit status 1. Now it is
    a user's message, recorded for the launcher as any other (which says it once, exit status 2), with torch's
    figures and the knobs that lower a rank's memory; its advice on the allocator is left out."""
    import accel_fsdp.train.lifetime as lifetime

    monkeypatch.setenv(lifetime.RANK_RECORDS_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(lifetime, "leave", lambda status: (_ for _ in ()).throw(SystemExit(status)))
    monkeypatch.setattr(lifetime, "outlive_closed_output", lambda: None)
    lifetime.doing("optimizer step 7 (forward, backward, gradient reduction)")

    def train():
        raise error()

    with pytest.raises(SystemExit) as ended:
        lifetime.run_rank(train)
    assert ended.value.code == 2
    recorded = lifetime.RankRecords(tmp_path).read()[1]
    assert recorded.why == USER_ERROR and recorded.message.startswith(f"rank 1: {said}"), recorded.message
    assert "PYTORCH_CUDA_ALLOC_CONF" not in recorded.message
    assert ("training.micro_batch_size" in recorded.message
            and ("model.activation_checkpointing" if kind == "GPU" else "fsdp_cpu_ram_efficient_loading")
            in recorded.message), recorded.message


def test_a_rank_the_oom_killer_ended_is_told_from_one_killed_by_hand():
    """SIGKILL is what Linux's overcommit gives a rank out of host memory; the launcher said "rank 1 was killed by
    SIGKILL" and no more. The machine's count of OOM kills, read before and after the launch, tells the two apart."""
    import signal

    from accel_fsdp.launch.launcher import killed_rank_message

    said, oom = killed_rank_message(1, signal.SIGKILL, 3, 4)
    assert oom and "the kernel's out-of-memory killer ended a process of this machine" in said, said
    assert "went from 3 to 4" in said and "fix: lower training.micro_batch_size" in said and "--resume auto" in said
    said, oom = killed_rank_message(1, signal.SIGKILL, 3, 3)
    assert not oom and "not by the out-of-memory killer" in said and "--resume auto" in said, said
    said, oom = killed_rank_message(1, signal.SIGKILL, None, None)  # no /proc/vmstat: any of the three
    assert not oom and "or the out-of-memory killer" in said, said
    said, oom = killed_rank_message(0, signal.SIGSEGV, 3, 3)
    assert not oom and said == "error: rank 0 was killed by SIGSEGV (a crash in native code: torch, a compiled " \
                               "kernel, or the hardware)"


def test_the_oom_kill_count_is_read_where_linux_says_it():
    from pathlib import Path

    from accel_fsdp.hardware import oom_kills

    count = oom_kills()
    if Path("/proc/vmstat").is_file() and "oom_kill " in Path("/proc/vmstat").read_text():
        assert isinstance(count, int) and count >= 0
    else:
        assert count is None


@pytest.mark.parametrize("command,error,said,own", [
    ("generate", cuda_failure, " generate: out of GPU memory (CUDA out of memory. Tried to allocate 2.00 GiB",
     "--device cpu"),
    ("generate", host_allocation_failure, " generate: out of host memory ([enforce fail at", None),
    ("consolidate", host_allocation_failure, " checkpoint consolidate: out of host memory ([enforce fail at",
     "--max-shard-size"),
], ids=["generate-cuda", "generate-host", "consolidate-host"])
def test_a_command_of_one_process_out_of_memory_says_so_once(tmp_path, tiny_gpt2, monkeypatch, command, error, said,
                                                             own):
    """`generate` (or consolidate, data prepare) out of memory was torch's traceback, exit status 1. The fix names a
    command's own knob only for that command: generate out of host memory was told to write smaller shards
    (consolidate's --max-shard-size, which generate does not take)."""
    import accel_fsdp.checkpoint.store as checkpoint_store
    import accel_fsdp.tools.generate as generate

    def fails(*args, **kwargs):
        raise error()

    if command == "generate":
        monkeypatch.setattr(generate, "generate", fails)
        message = user_error("generate", tiny_gpt2, "--prompt", "alice has a", "--max-new-tokens", "2")
    else:
        monkeypatch.setattr(checkpoint_store, "reading", fails)
        message = user_error("checkpoint", "consolidate", str(tmp_path), str(tmp_path / "out"))
    assert message.startswith("error: ") and said in message.splitlines()[0], message
    for knob in ("--device cpu", "--max-shard-size"):
        assert (knob in message) == (knob == own), message
