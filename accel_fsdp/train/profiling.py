"""`recipe run --profile K-L`: where optimizer steps K to L spend their time, on every rank, by torch's profiler.

The loop marks three regions of a step (`region`): the micro-steps' forward and backward (under FSDP2 the last
micro-step's gradient reduce-scatter runs inside backward, in its post-backward hooks, so it is counted there), the
gradient clipping (the global norm's all-reduce) and the optimizer step with its zero_grad. torch.profiler records the
steps K to L (`schedule`: the step before K is its warm-up, so the first recorded step carries no start-up cost), and
each rank writes, into `<run>/profile/`:

    rank<R>.trace.json.gz   the Chrome trace (https://ui.perfetto.dev or chrome://tracing open it); torch numbers its
                            step ranges from 0 at this run's first step (ProfilerStep#2 is step 3 of a new run)
    rank<R>.ops.txt         torch's table of the operators, by their own time on the device (CUDA) or the CPU
    rank<R>.summary.json    per step: the wall time, each region's time, the 15 most expensive operators

A step's wall time runs from the optimizer step before it to its own, so it holds the logging, evaluation and
checkpoint that follow the step before (what the regions do not cover). A region's time is its kernels' time on CUDA
(torch sums the kernels launched inside it, whatever stream ran them: communication that overlaps compute counts in
full) and its CPU time on CPU ranks. Rank 0 prints the split. Nothing is recorded outside the window, and without
`--profile` the regions are empty context managers.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import re
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from accel_fsdp.errors import Problem, UserError, first_line
from accel_fsdp.files import scratch_folder, write_atomic, write_with

FORWARD_BACKWARD, CLIPPING, OPTIMIZER = "forward and backward", "gradient clipping", "optimizer step"
REGIONS = (FORWARD_BACKWARD, CLIPPING, OPTIMIZER)
PREFIX = "accel_fsdp: "
"""How the regions are named in the trace (torch.profiler.record_function)."""
TOP_OPERATORS = 15


@dataclass(frozen=True)
class ProfileWindow:
    """Optimizer steps first..last (1-based, as the progress bar counts them), both included."""

    first: int
    last: int

    @classmethod
    def parse(cls, text: str) -> ProfileWindow:
        """"K" or "K-L"; a UserError naming --profile otherwise."""
        found = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text or "")
        first, last = (int(found.group(1)), int(found.group(2) or found.group(1))) if found else (0, 0)
        if not found or first < 1 or last < first:
            raise UserError(Problem("--profile", f"{text!r} is not a range of optimizer steps",
                                    "give K or K-L with 1 <= K <= L (e.g. --profile 5-6: steps 5 and 6)"))
        return cls(first, last)

    def __str__(self) -> str:
        return str(self.first) if self.first == self.last else f"{self.first}-{self.last}"


@dataclass
class StepSplit:
    """rank<R>.summary.json: per recorded step, seconds of wall time, of each region and of the top operators."""

    rank: int
    steps: list[int]
    device: str
    time_kind: str
    """"device" (CUDA kernels' time) or "cpu"."""
    step_wall_s: float
    regions_s: dict[str, float]
    top_operators_s: list[tuple[str, float]] = field(default_factory=list)

    @classmethod
    def read(cls, path: Path) -> StepSplit:
        return cls(**json.loads(Path(path).read_text()))

    def shares(self) -> dict[str, float]:
        """Each region's share of the step's wall time (empty where no wall time was recorded)."""
        if not self.step_wall_s:
            return {}
        return {name: seconds / self.step_wall_s for name, seconds in self.regions_s.items()}

    def line(self) -> str:
        parts = ", ".join(f"{name} {seconds:.3f} s ({seconds / self.step_wall_s:.0%})" if self.step_wall_s else
                          f"{name} {seconds:.3f} s" for name, seconds in self.regions_s.items())
        steps = f"steps {self.steps[0]}-{self.steps[-1]}" if len(self.steps) > 1 else f"step {self.steps[0]}"
        return (f"profile: {steps} on rank {self.rank}, a step {self.step_wall_s:.3f} s wall: {parts} "
                f"({'kernel' if self.time_kind == 'device' else 'CPU'} time a step)")


class StepProfiler:
    """The profiler of one rank over a ProfileWindow: `start` before the first step of this run (a resumed run starts
    later), `step()` after every optimizer step, `close()` at the end."""

    def __init__(self, window: ProfileWindow | None, *, folder: Path, rank: int, device_type: str, say):
        self.window, self.folder, self.rank, self.say = window, folder, rank, say
        self.cuda = device_type == "cuda"
        self.profiler, self.recorded, self.ready = None, [], None
        self.step_number = 1
        """The optimizer step the loop runs next (1-based)."""

    def start(self, first_step: int) -> None:
        self.step_number, window = first_step, self.window
        if window is None:
            return
        if window.last < first_step:
            self.say(f"note: --profile {window}: this run starts at optimizer step {first_step}: nothing is profiled")
            return
        import torch

        if self.rank == 0 and self.folder.is_dir():  # an earlier segment's files (other ranks write after a step)
            try:
                for stale in self.folder.glob("rank*"):
                    stale.unlink()
            except OSError as e:
                self.folder_problem(e)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        start = max(window.first, first_step)
        warmup = 1 if start > first_step else 0  # the step before the window, where there is one
        schedule = torch.profiler.schedule(wait=start - first_step - warmup, warmup=warmup,
                                           active=window.last - start + 1, repeat=1)
        self.recorded = list(range(start, window.last + 1))
        self.profiler = torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=self._write)
        self._quietly(self.profiler.start)

    def region(self, name: str):
        if self.profiler is None:
            return contextlib.nullcontext()
        import torch

        return torch.profiler.record_function(PREFIX + name)

    def step(self) -> None:
        """An optimizer step ended. Inside the window (and the step before it) the host waits for the GPU first, so
        that a recorded step's span is the step's wall time, not the time to queue its kernels."""
        self.step_number += 1
        if self.profiler is None:
            return
        if self.cuda and self.step_number >= self.recorded[0]:
            import torch

            torch.cuda.synchronize()
        self._quietly(self.profiler.step)
        if self.step_number > self.window.last:
            self.close()

    def close(self) -> None:
        """Stop recording (a run that ends inside the window writes what it recorded)."""
        if self.profiler is None:
            return
        profiler, self.profiler = self.profiler, None
        done = [s for s in self.recorded if s < self.step_number]
        if not done:
            self._quietly(profiler.stop)
            self.say(f"note: --profile {self.window}: the run ended at optimizer step {self.step_number - 1}: nothing "
                     "was profiled")
            return
        self.recorded = done
        self._quietly(profiler.stop)  # writes through on_trace_ready when it was recording

    def _write(self, profiler) -> None:
        """torch's on_trace_ready, called inside `profiler.step()` or `stop()`, which run with stderr closed
        (`kineto_quiet`): the trace is written once that call is over (`_quietly`), so that nothing another thread says
        on stderr meanwhile (a collective's watchdog) is lost while a large trace is written."""
        self.ready = profiler

    def _quietly(self, call) -> None:
        with kineto_quiet():
            call()
        ready, self.ready = self.ready, None
        if ready is not None:
            try:
                self._export(ready)
            except OSError as e:  # a full disk, a folder it may not write: the run goes on without its profile
                self.folder_problem(e)

    def folder_problem(self, error: OSError) -> None:
        print(f"warning: rank {self.rank}: the profile could not be written to {self.folder} ({first_line(error)}); "
              "training goes on", file=sys.stderr, flush=True)

    def _export(self, profiler) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with scratch_folder("accel-fsdp-profile") as scratch:
            raw = scratch / "trace.json"  # torch writes the whole trace; it is then published gzipped, whole
            profiler.export_chrome_trace(str(raw))
            write_with(self.folder / f"rank{self.rank}.trace.json.gz", lambda temporary: gzip_file(raw, temporary))
        averages = profiler.key_averages()
        sort_by = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        write_atomic(self.folder / f"rank{self.rank}.ops.txt", averages.table(sort_by=sort_by, row_limit=40) + "\n")
        split = step_split(averages, self.recorded, self.rank, "cuda" if self.cuda else "cpu")
        write_atomic(self.folder / f"rank{self.rank}.summary.json", json.dumps(asdict(split), indent=1) + "\n")
        if self.rank == 0:
            self.say(split.line())
            self.say(f"profile: traces and operator tables of every rank in {self.folder} (open a trace in "
                     "https://ui.perfetto.dev)")


def gzip_file(source: Path, target: Path) -> None:
    with open(source, "rb") as raw, gzip.open(target, "wb") as packed:
        shutil.copyfileobj(raw, packed)


@contextlib.contextmanager
def kineto_quiet():
    """The profiler's C++ side (libkineto) writes a line to stderr at every start and stop of a trace ("USDT: ...
    profiler_start"), whatever KINETO_LOG_LEVEL says (torch 2.13): nothing a user can act on, so the process's
    stderr is closed to it for the length of those calls."""
    import os

    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def step_split(averages, steps: list[int], rank: int, device: str) -> StepSplit:
    """The per-step seconds of the regions, of the whole step (torch's ProfilerStep#N ranges, wall on the CPU side)
    and of the most expensive operators, from the profiler's key averages."""
    on_device = device == "cuda"
    n = max(1, len(steps))

    def seconds(event, own: bool = False) -> float:
        if on_device:
            total = event.self_device_time_total if own else event.device_time_total
        else:
            total = event.self_cpu_time_total if own else event.cpu_time_total
        return total / 1e6 / n  # microseconds over the run -> seconds a step

    by_name = {e.key: e for e in averages}
    # torch names every step's range ProfilerStep#N and averages them under one key (torch/autograd/profiler_util.py)
    wall = sum(e.cpu_time_total for e in averages if e.key.startswith("ProfilerStep")) / 1e6 / n
    regions = {name: round(seconds(by_name[PREFIX + name]), 6) if PREFIX + name in by_name else 0.0
               for name in REGIONS}
    operators = sorted((e for e in averages if not e.key.startswith((PREFIX, "ProfilerStep"))),
                       key=lambda e: seconds(e, own=True), reverse=True)[:TOP_OPERATORS]
    return StepSplit(rank=rank, steps=steps, device=device, time_kind="device" if on_device else "cpu",
                     step_wall_s=round(wall, 6), regions_s=regions,
                     top_operators_s=[(e.key, round(seconds(e, own=True), 6)) for e in operators])
