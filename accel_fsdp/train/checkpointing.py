"""When the loop's state is saved, and how a run continues from it. The checkpointer decides its own cadence
(`checkpoint.every_steps`, the end of the run, and a preemption every rank agreed on); checkpoint/store.py
writes and reads the files."""

from __future__ import annotations

import json
from pathlib import Path

from accel_fsdp.checkpoint import store as ckpt
from accel_fsdp.checkpoint.records import TrainerState
from accel_fsdp.errors import UserError
from accel_fsdp.train.faults import Faults, broken
from accel_fsdp.train.lifetime import Preempted


class Checkpointer:
    def __init__(self, run, faults: Faults | None = None):
        self.run = run
        self.every = run.recipe.checkpoint.every_steps
        self.last_saved_step: int | None = None
        self.faults = faults  # crash injection inside a save (tests), from train/hooks.py

    def after_step(self, step: int) -> None:
        run = self.run
        if self.every and step % self.every == 0 and step != run.total_steps:
            self.save(step)
        if run.preemption.agreed():
            self.stop_preempted(step)

    def at_end(self) -> None:
        if self.last_saved_step != self.run.total_steps:
            self.save(self.run.total_steps)

    def save(self, step: int) -> Path:
        run = self.run
        recipe = run.recipe
        state = TrainerState(step=step, **run.sampler.position(step), tokens_seen=run.tokens_seen,
                             total_steps=run.total_steps, parameters=run.parameters,
                             trainable_parameters=run.trainable_parameters)
        path = ckpt.save_checkpoint(run.accelerator, run.model, run.optimizer, run.scheduler,
                                    root=run.layout.checkpoints, step=step, trainer_state=state, recipe=recipe,
                                    settings=run.settings, tokenizer=run.tokenizer, lora=recipe.model.lora.enabled,
                                    keep_last=recipe.checkpoint.keep_last, faults=self.faults, run_id=self._run_id())
        self.last_saved_step = step
        run.say(f"checkpoint: {path}")
        return path

    def resume(self) -> None:
        """Load the checkpoint the start decision chose: weights, optimizer, schedule, RNG, data position."""
        run = self.run
        request, recipe, acc = run.request, run.recipe, run.accelerator
        info = ckpt.checkpoint_to_resume(run.layout.checkpoints, request.resume_from)
        ckpt.verify_files(info, acc)  # a file damaged since it was saved is named before anything reads it
        if not request.resume_from:
            for newer in ckpt.skipped_newer(info):
                run.say(f"resume: {newer.name} is newer but not usable ({newer.reason})")
        for note in ckpt.check_resume(info, recipe, run.settings):
            run.say(f"resume: {note}")
        state = ckpt.load_checkpoint(acc, run.model, run.optimizer, run.scheduler, info,
                                     lora=recipe.model.lora.enabled)
        run.start_step = self.last_saved_step = state.step + broken("skip-batch")
        run.tokens_seen = state.tokens_seen or 0
        run.say(f"resume: continuing from {info.path} at step {run.start_step} of {run.total_steps} "
                f"(epoch {state.epoch}, {state.rows_consumed or 0:,} rows consumed)")

    def stop_preempted(self, step: int) -> None:
        """Every rank agreed to stop after `step`: checkpoint it (unless just saved), say so, and leave resumable."""
        run = self.run
        run.logger.close()
        path = run.layout.checkpoints / ckpt.checkpoint_name(step) if self.last_saved_step == step else self.save(step)
        run.preemption.finish()
        if run.accelerator.is_main_process:
            run.layout.preempted_file.write_text(json.dumps({"step": step, "checkpoint": str(path),
                                                             "signal": run.preemption.signal_name}))
        run.accelerator.wait_for_everyone()
        ckpt.wait_for_rotations()
        raise Preempted(step, path, run.preemption.signal_name or "a signal")

    def wait(self) -> None:
        """Until the rotation of old checkpoints (in the background) is done."""
        ckpt.wait_for_rotations()

    def export_final(self) -> None:
        """The main process alone, after the other ranks have left: the last checkpoint as a Hugging Face folder."""
        from accel_fsdp.checkpoint.consolidate import consolidate

        run = self.run
        info = ckpt.latest_complete(run.layout.checkpoints)
        report = consolidate(info, run.layout.final, dtype=run.recipe.checkpoint.export_dtype)
        print(f"export: {report.summary()}")

    def _run_id(self) -> str | None:
        from accel_fsdp.run.folder import RunIdentity

        try:
            return RunIdentity.read(self.run.layout.run_file).run_id
        except UserError:
            return None
