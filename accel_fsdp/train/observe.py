"""What the person at the terminal and metrics.jsonl see of the loop: the logging window, the progress bar, the
time to the first step. The logger decides its own cadence (`logging.every_steps`, and the last step).

The loop hands it each micro-step's loss tensor and each step's results; it keeps them on the device and
synchronizes ranks once per logging window (one all-reduce of the window's loss sum), never per step.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

from accel_fsdp.checkpoint.records import LogWindow
from accel_fsdp.config.precision import is_half
from accel_fsdp.hardware import device_peak_flops, peak_memory_bytes, reset_peak_memory
from accel_fsdp.quiet import live_terminal
from accel_fsdp.train.finite import full_value
from accel_fsdp.train.metrics import MetricsWriter, StartupClock, StartupRow, TrainRow
from accel_fsdp.train.sharding import gather_ints
from accel_fsdp.train.state import TrainingState


class Terminal:
    """The person at the terminal: the main process's lines, written above its progress bar while the bar is open.
    The only owner of the bar. Where stderr is no live terminal (a log file, a pipe, TERM=dumb) there is no bar: each
    logged step is a line of its own instead ("step 20/100: loss 3.1416, tok_s 12,345")."""

    def __init__(self, accelerator):
        self.main = accelerator.is_main_process
        self.bar = None
        self.live = live_terminal(sys.stderr)
        self.step, self.total = 0, 0

    def say(self, text: str) -> None:
        if not self.main:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def open_bar(self, total: int, initial: int) -> None:
        self.step, self.total = initial, total
        if self.main and self.live:
            self.bar = _progress_bar(total, initial)

    def advance(self, **postfix) -> None:
        self.step += 1
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix(**postfix, refresh=False)
            self.bar.update(1)
        elif postfix:
            self.say(f"step {self.step}/{self.total}: " + ", ".join(f"{k} {v}" for k, v in postfix.items()))

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class TrainLogger:
    """The train rows of metrics.jsonl and the progress bar's numbers, every `every_steps` optimizer steps and at the
    last; the time to the first step. Owns the logging window (saved with a checkpoint, see `state_dict`)."""

    def __init__(self, accelerator, terminal: Terminal, metrics: MetricsWriter, clock: StartupClock, *,
                 every_steps: int, total_steps: int, accumulation_steps: int, precision: str, flops_per_token: float,
                 tokens_by_source: Callable[[list[int]], dict], statistics: Callable[[dict[str, float]], object]):
        self.accelerator, self.terminal, self.metrics, self.clock = accelerator, terminal, metrics, clock
        self.every, self.total_steps, self.accumulation_steps = every_steps, total_steps, accumulation_steps
        self.flops_per_token = flops_per_token
        self.tokens_by_source = tokens_by_source
        """The training tokens of each source in a global batch (its unit ids)."""
        self.statistics = statistics
        """The objective's row statistics from the window's sums (train/methods: `Objective.statistics`)."""
        acc = accelerator
        self.peak_flops = device_peak_flops(acc.device, is_half(precision))
        self.peak_memory: list[int] | None = None
        """Highest per-rank peak memory of any logging window so far."""
        self.loss = torch.zeros((), device=acc.device)
        self.norm = torch.zeros((), device=acc.device)
        self.sums: dict[str, torch.Tensor] = {}
        """The window's sums of what the objective logs (a preference run's rewards and log-probs over its pairs)."""
        self.carried = LogWindow()
        """The part of the window before a resume (its steps ran in the interrupted attempt), from the checkpoint."""
        # No reset here: the first window's peak includes setup (loading and sharding).
        self.tokens, self.steps, self.window_start = 0, 0, time.perf_counter()
        self.first_step: int | None = None

    def _new_window(self) -> None:
        self.loss.zero_()
        self.norm.zero_()
        self.sums = {}
        self.carried = LogWindow()
        reset_peak_memory(self.accelerator.device)
        self.tokens, self.steps, self.window_start = 0, 0, time.perf_counter()

    def start(self, state: TrainingState) -> None:
        """Before the first step: the progress bar, and a window that starts now."""
        self.terminal.open_bar(self.total_steps, state.step)
        self.first_step = state.step + 1
        self.tokens, self.steps, self.window_start = 0, 0, time.perf_counter()

    def add_loss(self, loss: torch.Tensor, stats: dict | None = None) -> None:
        """A micro-step's loss, and what else its objective measured (sums over its pairs; none for sft)."""
        self.loss += loss.detach()
        for name, value in (stats or {}).items():
            self.sums[name] = self.sums[name] + value if name in self.sums else value.clone()

    def after_step(self, state: TrainingState, lr: float, grad_norm, tokens: int, units: list[int]) -> None:
        """`state` has advanced over this step, whose global batch (`units`) held `tokens` tokens."""
        self.norm += full_value(grad_norm).detach()
        self.tokens += tokens
        self.steps += 1
        if state.step == self.first_step:
            self._report_startup()
        postfix = {}
        if self.writes_row(state.step):
            row = self._log(state, lr, units)
            postfix = dict(loss=f"{row.loss:.4f}", tok_s=f"{row.tokens_per_s:,.0f}",
                           **({"mfu": f"{row.mfu:.1%}"} if row.mfu is not None else {}))
        self.terminal.advance(**postfix)

    def writes_row(self, step: int) -> bool:
        """Optimizer step `step` ends with a train row."""
        return step % self.every == 0 or step == self.total_steps

    def due(self, step: int) -> bool:
        """Optimizer step `step` ends with a train row or the time to the first step: what the device computed for
        it must be done (train/finite.py `confirm`)."""
        return self.writes_row(step) or step == self.first_step

    def window(self) -> LogWindow:
        """The open window's sums over all ranks, the part before a resume included. Collective: the only
        synchronizing point of a logging window (one all-reduce)."""
        acc = self.accelerator
        world, k = acc.num_processes, self.accumulation_steps
        names = sorted(self.sums)
        sums = acc.reduce(torch.stack([self.loss] + [self.sums[n].float() for n in names]), reduction="sum").tolist()
        # Each micro-step's loss is its share of the step's mean (train/loop.py): a step's world x k shares add up
        # to its loss.
        logged = dict(self.carried.sums)
        for name, value in zip(names, sums[1:]):
            logged[name] = logged.get(name, 0.0) + value
        return LogWindow(steps=self.carried.steps + self.steps, loss=self.carried.loss + sums[0] / (world * k),
                         grad_norm=self.carried.grad_norm + self.norm.item(), sums=logged)

    def state_dict(self) -> LogWindow | None:
        """The open window, for a checkpoint (collective: every rank saves); None when none is open."""
        window = self.window()
        return window if window.steps else None

    def load_state_dict(self, window: LogWindow | None) -> None:
        """A resumed run's window goes on from the checkpoint's: its first row averages the steps an uninterrupted
        run's row does (the steps' throughput is this attempt's alone)."""
        self.carried = window or LogWindow()

    def _log(self, state: TrainingState, lr: float, units: list[int]) -> TrainRow:
        acc = self.accelerator
        world = acc.num_processes
        window = self.window()
        elapsed = time.perf_counter() - self.window_start
        window_peak = gather_ints(acc, [peak_memory_bytes(acc.device)])
        self.peak_memory = [max(a, b) for a, b in zip(self.peak_memory or window_peak, window_peak)]
        per_rank = self.tokens / elapsed / world
        row = TrainRow(step=state.step, loss=window.loss / window.steps, lr=lr,
                       grad_norm=window.grad_norm / window.steps, tokens_per_s=self.tokens / elapsed,
                       tokens_per_s_per_rank=per_rank, step_time_s=elapsed / self.steps,
                       tokens_seen=state.tokens_seen, peak_memory_bytes=window_peak,
                       peak_memory_bytes_run=self.peak_memory,
                       mfu=self.flops_per_token * per_rank / self.peak_flops if self.peak_flops else None,
                       source_tokens=self.tokens_by_source(units), preference=self.statistics(window.sums))
        self.metrics.write(row)
        self._new_window()
        return row

    def _report_startup(self) -> None:
        """Time to the first optimizer step, by phase (rank 0's clock), in the metrics and on the terminal."""
        self.clock.mark("first step")
        if self.accelerator.is_main_process:
            phases = self.clock.phases()
            self.metrics.write(StartupRow(step=self.first_step, time_to_first_step_s=round(sum(phases.values()), 3),
                                          phases_s=phases))
            self.terminal.say(self.clock.summary())

    def close(self) -> None:
        self.terminal.close_bar()


def _progress_bar(total: int, initial: int):
    """The main process's bar (ETA, loss, tokens/s, MFU on GPUs). Warnings and log records of the libraries are
    written above it, like our own lines, instead of being glued onto it."""
    import logging
    import warnings

    from tqdm.auto import tqdm

    bar = tqdm(total=total, initial=initial, desc="training", unit="step", dynamic_ncols=True, mininterval=1.0)
    warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: tqdm.write(
        warnings.formatwarning(message, category, filename, lineno, line).rstrip())

    class _AboveTheBar(logging.Handler):
        def emit(self, record):
            tqdm.write(self.format(record))

    handler = _AboveTheBar()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger().handlers = [handler]
    return bar
