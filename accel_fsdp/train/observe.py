"""What the person at the terminal and metrics.jsonl see of the loop: the logging window, the progress bar, the
time to the first step. The logger decides its own cadence (`logging.every_steps`, and the last step).

The loop hands it each micro-step's loss tensor and each step's results; it keeps them on the device and
synchronizes ranks once per logging window (one all-reduce of the window's loss sum), never per step.
"""

from __future__ import annotations

import time

import torch

from accel_fsdp.train.metrics import StartupRow, TrainRow, device_peak_flops, peak_memory_bytes, reset_peak_memory
from accel_fsdp.train.sharding import gather_ints


class TrainLogger:
    def __init__(self, run):
        self.run = run
        acc = run.accelerator
        self.every = run.recipe.logging.every_steps
        self.peak_flops = device_peak_flops(acc.device, run.settings.mixed_precision.value)
        self.peak_memory: list[int] | None = None
        """Highest per-rank peak memory of any logging window so far."""
        self.loss = torch.zeros((), device=acc.device)
        self.norm = torch.zeros((), device=acc.device)
        # No reset here: the first window's peak includes setup (loading and sharding).
        self.tokens, self.steps, self.window_start = 0, 0, time.perf_counter()

    def _new_window(self) -> None:
        self.loss.zero_()
        self.norm.zero_()
        reset_peak_memory(self.run.accelerator.device)
        self.tokens, self.steps, self.window_start = 0, 0, time.perf_counter()

    def start(self) -> None:
        """Before the first step: the progress bar, and a window that starts now."""
        self.run.progress = _progress_bar(self.run.accelerator, self.run.total_steps, self.run.start_step)
        self.tokens, self.steps, self.window_start = 0, 0, time.perf_counter()

    def add_loss(self, loss: torch.Tensor) -> None:
        self.loss += loss.detach()

    def after_step(self, step: int, lr: float, grad_norm, seqs: list[int]) -> None:
        run = self.run
        self.norm += _full(grad_norm).detach()
        tokens = run.step_tokens(seqs)
        self.tokens += tokens
        run.tokens_seen += tokens
        self.steps += 1
        if step == run.start_step + 1:
            self._report_startup()
        if step % self.every == 0 or step == run.total_steps:
            self._log(step, lr)
        if run.progress is not None:
            run.progress.update(1)

    def _log(self, step: int, lr: float) -> None:
        """The only synchronizing point of a logging window: reduce the window's sums over ranks."""
        run, acc = self.run, self.run.accelerator
        world, k = acc.num_processes, run.sampler.accumulation_steps
        loss_sum = acc.reduce(self.loss, reduction="sum").item()
        elapsed = time.perf_counter() - self.window_start
        window_peak = gather_ints(acc, [peak_memory_bytes(acc.device)])
        self.peak_memory = [max(a, b) for a, b in zip(self.peak_memory or window_peak, window_peak)]
        per_rank = self.tokens / elapsed / world
        row = TrainRow(step=step, loss=loss_sum / (world * k * self.steps), lr=lr,
                       grad_norm=self.norm.item() / self.steps, tokens_per_s=self.tokens / elapsed,
                       tokens_per_s_per_rank=per_rank, step_time_s=elapsed / self.steps,
                       tokens_seen=run.tokens_seen, peak_memory_bytes=window_peak,
                       peak_memory_bytes_run=self.peak_memory,
                       mfu=run.flops_per_token * per_rank / self.peak_flops if self.peak_flops else None)
        run.metrics.write(row)
        if run.progress is not None:
            run.progress.set_postfix(loss=f"{row.loss:.4f}", tok_s=f"{row.tokens_per_s:,.0f}",
                                     **({"mfu": f"{row.mfu:.1%}"} if row.mfu is not None else {}))
        self._new_window()

    def _report_startup(self) -> None:
        """Time to the first optimizer step, by phase (rank 0's clock), in the metrics and on the terminal."""
        run = self.run
        run.clock.mark("first step")
        if run.accelerator.is_main_process:
            phases = run.clock.phases()
            run.metrics.write(StartupRow(step=run.start_step + 1, time_to_first_step_s=round(sum(phases.values()), 3),
                                         phases_s=phases))
            (run.progress.write if run.progress is not None else print)(run.clock.summary())

    def close(self) -> None:
        if self.run.progress is not None:
            self.run.progress.close()
            self.run.progress = None


def _full(t):
    """A DTensor's full value (clip_grad_norm_ returns one under FSDP2)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _progress_bar(acc, total: int, initial: int):
    """The main process's bar (ETA, loss, tokens/s, MFU on GPUs). Warnings and log records of the libraries are
    written above it, like our own lines, instead of being glued onto it."""
    if not acc.is_main_process:
        return None
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
