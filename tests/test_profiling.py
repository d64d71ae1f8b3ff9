"""`recipe run --profile K-L` (train/profiling.py): the window of optimizer steps torch's profiler records, what each
rank writes, and the split of a step into the loop's regions. The 2-rank run: tests/test_training.py (the tiny Llama
run profiles two of its steps)."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from click.testing import CliRunner

from accel_fsdp.cli import main
from accel_fsdp.errors import UserError
from accel_fsdp.train.profiling import CLIPPING, FORWARD_BACKWARD, OPTIMIZER, PREFIX, ProfileWindow, StepProfiler


@pytest.mark.parametrize("text,window", [("3", (3, 3)), ("2-5", (2, 5)), (" 4 - 4 ", (4, 4))])
def test_a_window_is_one_step_or_a_range(text, window):
    parsed = ProfileWindow.parse(text)
    assert (parsed.first, parsed.last) == window
    assert ProfileWindow.parse(str(parsed)) == parsed  # what the launcher passes on to the ranks


@pytest.mark.parametrize("text", ["0", "5-3", "x", "2-", "-2", "1.5", ""])
def test_a_window_that_is_not_a_range_of_steps_is_refused_naming_the_option(text):
    with pytest.raises(UserError, match=r"(?s)--profile: .* is not a range of optimizer steps.*1 <= K <= L"):
        ProfileWindow.parse(text)


def test_the_cli_refuses_a_bad_window_and_a_dry_run_profile_before_anything_starts(tmp_path):
    out = CliRunner().invoke(main, ["recipe", "run", "quickstart", "--profile", "4-2", "--output-dir", tmp_path / "r"])
    assert out.exit_code == 2 and "--profile: '4-2' is not a range of optimizer steps" in out.output
    out = CliRunner().invoke(main, ["recipe", "run", "quickstart", "--profile", "2", "--dry-run"])
    assert out.exit_code == 2 and "--profile: a dry run trains no step to profile" in out.output
    assert not (tmp_path / "r").exists()


def fake_run(profiler: StepProfiler, first: int, last: int) -> None:
    """Optimizer steps first..last of a loop that marks its regions as the training loop does."""
    layer = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(layer.parameters())
    profiler.start(first)
    for _ in range(first, last + 1):
        with profiler.region(FORWARD_BACKWARD):
            layer(torch.randn(32, 64)).square().sum().backward()
        with profiler.region(CLIPPING):
            torch.nn.utils.clip_grad_norm_(layer.parameters(), 1.0)
        with profiler.region(OPTIMIZER):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        profiler.step()
    profiler.close()


def profiler_in(folder, window: str | None, said: list) -> StepProfiler:
    return StepProfiler(ProfileWindow.parse(window) if window else None, folder=folder, rank=0, device_type="cpu",
                        say=said.append)


def test_the_window_is_recorded_and_every_file_is_written(tmp_path):
    said = []
    fake_run(profiler_in(tmp_path, "3-4", said), 1, 6)
    summary = json.loads((tmp_path / "rank0.summary.json").read_text())
    assert summary["steps"] == [3, 4] and summary["time_kind"] == "cpu"
    regions = summary["regions_s"]
    assert set(regions) == {FORWARD_BACKWARD, CLIPPING, OPTIMIZER} and all(v > 0 for v in regions.values())
    # a region is a span of the step on the host: together no longer than the step. Not "most of it": the gaps
    # between the regions (the profiler's own step bookkeeping) take the time this process waits for a core on a busy
    # machine, and these steps last a millisecond (one run under the parallel suite: 0.69 of 2.81 ms in regions).
    assert sum(regions.values()) <= summary["step_wall_s"]
    assert summary["top_operators_s"] and all(not name.startswith(PREFIX) for name, _ in summary["top_operators_s"])
    with gzip.open(tmp_path / "rank0.trace.json.gz", "rt") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert {PREFIX + r for r in (FORWARD_BACKWARD, CLIPPING, OPTIMIZER)} <= names
    # torch counts its step ranges from 0 at the run's first step: steps 3 and 4 are #2 and #3; step 2, the warm-up,
    # is not in the trace
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#1" not in names
    assert "aten::addmm" in (tmp_path / "rank0.ops.txt").read_text()
    assert not list(tmp_path.glob(".*"))  # every file published whole (files.write_with), no temporary left
    assert said[0].startswith("profile: steps 3-4 on rank 0, a step ") and "forward and backward" in said[0]
    assert str(tmp_path) in said[1]


def test_a_run_that_ends_inside_the_window_writes_what_it_recorded_and_nothing_of_an_earlier_one(tmp_path):
    (tmp_path / "rank1.summary.json").write_text("{}")  # an earlier segment of the run, on more ranks
    said = []
    fake_run(profiler_in(tmp_path, "2-9", said), 1, 3)
    assert json.loads((tmp_path / "rank0.summary.json").read_text())["steps"] == [2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.ops.txt", "rank0.summary.json",
                                                         "rank0.trace.json.gz"]


@pytest.mark.parametrize("first,last,window,note", [
    (1, 3, "5-6", "the run ended at optimizer step 3: nothing was profiled"),
    (7, 8, "2-3", "this run starts at optimizer step 7: nothing is profiled"),  # a resumed run
])
def test_a_window_the_run_never_reaches_is_said_and_writes_nothing(tmp_path, first, last, window, note):
    said = []
    fake_run(profiler_in(tmp_path / "profile", window, said), first, last)
    assert said == [f"note: --profile {window}: {note}"]
    assert not (tmp_path / "profile").exists()


def test_without_a_window_nothing_is_recorded(tmp_path):
    said = []
    profiler = profiler_in(tmp_path / "profile", None, said)
    fake_run(profiler, 1, 2)
    assert profiler.profiler is None and said == [] and not (tmp_path / "profile").exists()


# ------------------------------------------------------------------------ on a GPU: the decisions, CUDA faked


def event(key, cpu=0.0, device=0.0, self_cpu=0.0, self_device=0.0):
    """A row of torch's key averages (microseconds over the whole window)."""
    from types import SimpleNamespace

    return SimpleNamespace(key=key, cpu_time_total=cpu, device_time_total=device, self_cpu_time_total=self_cpu,
                           self_device_time_total=self_device)


def test_on_a_gpu_a_region_is_its_kernels_time_and_the_operators_are_ranked_by_their_own():
    from accel_fsdp.train.profiling import step_split

    averages = [event("ProfilerStep*", cpu=2_000_000),  # two steps of 1 s on the host
                event(PREFIX + FORWARD_BACKWARD, cpu=300_000, device=1_600_000),  # queued fast, ran long
                event(PREFIX + OPTIMIZER, cpu=100_000, device=200_000),
                event("aten::mm", self_cpu=50_000, self_device=1_200_000),
                event("nccl:all_gather", self_cpu=900_000, self_device=100_000)]
    split = step_split(averages, [5, 6], rank=0, device="cuda")
    assert split.step_wall_s == 1.0 and split.time_kind == "device"
    assert split.regions_s == {FORWARD_BACKWARD: 0.8, CLIPPING: 0.0, OPTIMIZER: 0.1}
    assert [name for name, _ in split.top_operators_s] == ["aten::mm", "nccl:all_gather"]
    assert "(kernel time a step)" in split.line()


def test_on_a_gpu_the_profiler_records_cuda_and_the_host_waits_for_the_gpu_at_the_windows_steps(tmp_path,
                                                                                                monkeypatch):
    made, synchronized = [], []

    class FakeProfile:
        def __init__(self, activities, schedule, on_trace_ready):
            made.append(set(activities))
            self.schedule, self.steps = schedule, 0

        def start(self):
            pass

        def step(self):
            self.steps += 1

        def stop(self):
            pass

    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: synchronized.append(profiler.step_number))
    profiler = StepProfiler(ProfileWindow.parse("3-4"), folder=tmp_path, rank=0, device_type="cuda",
                            say=lambda text: None)
    profiler.start(1)
    for _ in range(6):
        profiler.step()
    assert made == [{torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA}]
    assert synchronized == [3, 4, 5]  # the window's start, and the end of each recorded step; nothing after it


def test_a_profile_that_cannot_be_written_is_a_warning_and_the_run_goes_on(tmp_path, monkeypatch):
    """The warning reaches the real stderr: the profiler's calls run with file descriptor 2 closed to kineto's lines,
    so a line written during them would be lost."""
    import io
    import os

    written = []

    class Stderr(io.StringIO):
        def write(self, text):
            written.append((text, os.readlink("/proc/self/fd/2") == os.devnull))
            return len(text)

    monkeypatch.setattr("sys.stderr", Stderr())
    blocked = tmp_path / "profile"
    blocked.write_text("a file where the profile folder would go")
    said = []
    fake_run(profiler_in(blocked, "2-3", said), 1, 4)  # returns: the loop was not stopped
    warnings = [(text, closed) for text, closed in written if "warning:" in text]
    assert len(warnings) == 1, written
    (text, fd_closed), = warnings
    assert f"warning: rank 0: the profile could not be written to {blocked} (" in text and "training goes on" in text
    assert not fd_closed  # written once stderr was open again
    assert blocked.read_text().startswith("a file where") and said == []
