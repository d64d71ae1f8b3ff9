"""When the loop's state is saved, and how a run continues from it. The checkpointer decides its own cadence
(`checkpoint.every_steps`, the end of the run, and a preemption every rank agreed on); checkpoint/store.py
writes and reads the files, checkpoint/index.py finds and judges them."""

from __future__ import annotations

import json
from pathlib import Path

from accel_fsdp.checkpoint import index as checkpoint_index
from accel_fsdp.checkpoint import store as ckpt
from accel_fsdp.checkpoint.consolidate import consolidate
from accel_fsdp.checkpoint.records import TrainerState
from accel_fsdp.errors import UserError
from accel_fsdp.layout import RunIdentity, checkpoint_name
from accel_fsdp.train.faults import Faults
from accel_fsdp.train.lifetime import Preempted
from accel_fsdp.train.observe import TrainLogger
from accel_fsdp.train.state import TrainingState


class Checkpointer:
    def __init__(self, run, logger: TrainLogger, faults: Faults | None = None, skip_steps_on_resume: int = 0):
        self.run = run
        self.logger = logger
        """Its logging window is saved with the training state, and restored on resume."""
        self.every = run.recipe.checkpoint.every_steps
        self.last_saved_step: int | None = None
        self.faults = faults  # crash injection inside a save (tests), from train/hooks.py
        self.skip_steps_on_resume = skip_steps_on_resume
        """Above 0 only in `verify`'s proof that its resume check can fail."""

    def after_step(self, state: TrainingState) -> None:
        run = self.run
        if self.every and state.step % self.every == 0 and state.step != run.total_steps:
            self.save(state)
        if run.preemption.agreed():
            self.stop_preempted(state)

    def at_end(self, state: TrainingState) -> None:
        if self.last_saved_step != state.step:
            self.save(state)

    def save(self, training: TrainingState) -> Path:
        run = self.run
        recipe = run.recipe
        step = training.step
        state = TrainerState(step=step, **run.sampler.position(step), tokens_seen=training.tokens_seen,
                             total_steps=run.total_steps, parameters=run.parameters,
                             trainable_parameters=run.trainable_parameters, data=run.sampler.state_dict(step),
                             log_window=self.logger.state_dict())  # collective, like the save
        path = ckpt.save_checkpoint(run.accelerator, run.model, run.optimizer, run.scheduler,
                                    root=run.layout.checkpoints, step=step, trainer_state=state, recipe=recipe,
                                    settings=run.settings, tokenizer=run.tokenizer, lora=recipe.model.lora.enabled,
                                    keep_last=recipe.checkpoint.keep_last, faults=self.faults, run_id=self._run_id())
        self.last_saved_step = step
        run.say(f"checkpoint: {path}")
        return path

    def resume(self) -> TrainingState:
        """Load the checkpoint the start decision chose (weights, optimizer, schedule, RNG, data position) and
        return the training state it saved."""
        run = self.run
        request, recipe, acc = run.request, run.recipe, run.accelerator
        # Every file is checked against its CRC-32 before anything reads it, the ranks sharing the reading.
        point = checkpoint_index.checkpoint_to_resume(run.layout.checkpoints, request.resume_from, accelerator=acc)
        info = point.checkpoint
        for note in point.notes():
            run.say(f"resume: {note}")
        for note in checkpoint_index.check_resume(info, recipe, run.settings, run.total_steps):
            run.say(f"resume: {note}")
        state = ckpt.load_checkpoint(acc, run.model, run.optimizer, run.scheduler, info,
                                     lora=recipe.model.lora.enabled)
        if state.data is not None:  # where each source stands; without it (never written so), replayed from step 0
            run.sampler.load_state_dict(state.data)
        self.logger.load_state_dict(state.log_window)
        training = TrainingState(step=state.step + self.skip_steps_on_resume, tokens_seen=state.tokens_seen or 0)
        self.last_saved_step = training.step
        run.say(f"resume: continuing from {info.path} at step {training.step} of {run.total_steps} "
                f"(epoch {state.epoch}, {state.rows_consumed or 0:,} rows consumed)")
        return training

    def stop_preempted(self, state: TrainingState) -> None:
        """Every rank agreed to stop after this step: checkpoint it (unless just saved), say so, and leave
        resumable."""
        run, step = self.run, state.step
        run.terminal.close_bar()
        path = run.layout.checkpoints / checkpoint_name(step) if self.last_saved_step == step else self.save(state)
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
        run = self.run
        info = checkpoint_index.latest_complete(run.layout.checkpoints)
        report = consolidate(info, run.layout.final, dtype=run.recipe.checkpoint.export_dtype)
        print(f"export: {report.summary()}")

    def _run_id(self) -> str | None:
        try:
            return RunIdentity.read(self.run.layout.run_file).run_id
        except UserError:
            return None
