"""The training loop: runs inside every rank of a distributed launch, after train/setup.py built the run.

For each optimizer step: its micro-steps accumulated, clip, a check that the gradients are finite (train/finite.py: the
device skips a step that is not, and the host reads the verdict before the model is next read or saved), step,
schedule; then the components that own a cadence look at the step (logger, evaluator, checkpointer; test hooks
first). At the end: final evaluation, checkpoint, sample, export.

Loss normalization: the loss of an optimizer step is the mean over every loss-carrying token (for preference
tuning, every pair) of the global batch, however the batch is split over ranks and micro-steps. Each micro-step's
loss is a *sum* divided by (the global batch's count) / (ranks x accumulation steps): FSDP averages gradients over
ranks and `accelerator.backward` divides by the accumulation steps, which undoes both factors. So k micro-steps of
batch b give the same update as one step of k x b (tests/test_training.py and tests/test_preference.py check it).
The objective (train/methods/) computes the loss; `run.norm` the global counts, from the data, on every rank.
"""

from __future__ import annotations

from accel_fsdp.layout import record_finished
from accel_fsdp.quiet import quiet_libraries
from accel_fsdp.train.accelerator import accumulate
from accel_fsdp.train.evaluate import generate_sample
from accel_fsdp.train.lifetime import doing
from accel_fsdp.train.profiling import CLIPPING, FORWARD_BACKWARD, OPTIMIZER
from accel_fsdp.train.setup import Components, Run, RunRequest, setup
from accel_fsdp.train.state import TrainingState


def fit(run: Run, parts: Components, state: TrainingState) -> None:
    """One optimizer step per iteration, its micro-steps accumulated."""
    acc, model, optimizer, scheduler, sampler = run.accelerator, run.model, run.optimizer, run.scheduler, run.sampler
    objective, t = run.objective, run.recipe.training
    max_norm = t.max_grad_norm if t.max_grad_norm is not None else float("inf")
    profiler = parts.profiler
    parts.logger.start(state)
    parts.finite.start(state.step + 1)
    profiler.start(state.step + 1)
    model.train()
    while state.step < run.total_steps:
        units, micro_batches = sampler.global_sequences(state.step), sampler.micro_batches(state.step)
        norm = run.norm(units)  # the global batch's counts, the same on every rank: no communication
        doing(f"optimizer step {state.step + 1} (forward, backward, gradient reduction)")
        step_loss = None
        for part in micro_batches:
            batch = run.batch(part)
            with accumulate(acc, model, run.settings):
                with profiler.region(FORWARD_BACKWARD):
                    with acc.autocast(), run.knobs.saving_activations():  # saved tensors: offloaded, or kept
                        loss, stats = objective(model, batch, norm)
                    acc.backward(loss)
                step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
                if acc.sync_gradients:  # the last micro-step: gradients are now reduced over ranks
                    with profiler.region(CLIPPING):
                        grad_norm = acc.clip_grad_norm_(model.parameters(), max_norm)
                    scale = acc.scaler.get_scale() if acc.scaler is not None else None  # fp16
                    parts.finite.guard(state.step + 1, grad_norm, step_loss)  # before the step changes a weight
                with profiler.region(OPTIMIZER):
                    optimizer.step()  # skipped by Accelerate until the last micro-step
                    optimizer.zero_grad(set_to_none=True)
            parts.logger.add_loss(loss, stats)
        lr = advance_schedule(acc, scheduler, scale)
        tokens = run.step_tokens(units)
        state.advance(tokens)
        profiler.step()
        doing(f"the logging, evaluation and checkpoint after optimizer step {state.step}")

        parts.hooks.after_step(state.step, micro_batches)
        if parts.logger.due(state.step) or parts.evaluator.due(state.step):
            parts.finite.confirm()  # a row or an evaluation reads this step: it was taken
        parts.logger.after_step(state, lr, grad_norm, tokens, units)
        parts.evaluator.after_step(state)
        parts.checkpointer.after_step(state, before_save=parts.finite.confirm)
    parts.finite.confirm()  # the last step, before the end's evaluation, checkpoint and export
    profiler.close()
    parts.logger.close()
    parts.hooks.close()


def advance_schedule(acc, scheduler, scale_before: float | None = None) -> float:
    """Step the LR schedule after an optimizer step; return the rate that step used. A step the fp16 grad scaler
    skipped (inf/nan gradients) does not advance it: the next step gets the rate this one would have had.

    Accelerate's flag says whether GradScaler called `optimizer.step` (accelerate/optimizer.py, AcceleratedOptimizer
    .step, 1.15.0), which it always does for a fused AdamW: the kernel skips the update itself (torch/amp/
    grad_scaler.py, GradScaler.step, `_step_supports_amp_scaling`; torch 2.13.0). The scaler backs its scale off
    exactly when it found inf/nan (GradScaler.update), so a lower scale after the step is a skipped step too."""
    used = scheduler.get_last_lr()[0]
    skipped = acc.optimizer_step_was_skipped or (
        scale_before is not None and acc.scaler is not None and acc.scaler.get_scale() < scale_before)
    if not skipped:
        scheduler.step()
    return used


def finish(run: Run, parts: Components, state: TrainingState) -> None:
    """Final evaluation, checkpoint, sample generation; then the main process exports the model alone."""
    acc, recipe = run.accelerator, run.recipe
    doing("the end of the run (final evaluation, checkpoint, sample)")
    if run.request.benchmark:
        acc.wait_for_everyone()
        acc.end_training()
        parts.checkpointer.wait()
        return
    parts.evaluator.at_end(state)
    run.sharding.measure_after_training(acc, run.model)  # replicas must still agree (collective)
    if acc.is_main_process:
        run.sharding.write(run.layout.sharding_file)
    parts.checkpointer.at_end(state)
    sample = None
    if recipe.logging.sample_prompt:
        sample = generate_sample(run, recipe.logging.sample_prompt, recipe.logging.sample_max_new_tokens)
    acc.wait_for_everyone()
    acc.end_training()  # closes the trackers and destroys the process group
    parts.checkpointer.wait()
    if not acc.is_main_process:
        return
    # Exported by the main process alone, after the other ranks have left: a long export of a large model
    # must not hold them at a barrier (and into a collective timeout).
    if recipe.checkpoint.export_final:
        parts.checkpointer.export_final()
    if sample is not None:
        print(f"sample: {recipe.logging.sample_prompt!r} -> {sample!r}")
    print(f"done: {run.total_steps} steps; run folder {run.request.run_dir}")
    record_finished(run.layout)


def run_training(request: RunRequest) -> None:
    """Entry point inside each rank."""
    quiet_libraries()
    run, parts, state = setup(request)
    fit(run, parts, state)
    finish(run, parts, state)
