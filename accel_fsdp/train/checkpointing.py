"""When the loop's state is saved, and how a run continues from it. The checkpointer decides its own cadence
(`checkpoint.every_steps`, the end of the run, and a preemption every rank agreed on); checkpoint/store.py
writes and reads the files, checkpoint/index.py finds and judges them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from accel_fsdp.checkpoint import index as checkpoint_index
from accel_fsdp.checkpoint import store as ckpt
from accel_fsdp.checkpoint.consolidate import consolidate
from accel_fsdp.checkpoint.records import TrainerState
from accel_fsdp.errors import Problem, UserError
from accel_fsdp.files import DISK_FULL, write_atomic
from accel_fsdp.layout import RunIdentity, RunLayout, checkpoint_name
from accel_fsdp.run.folder import DAMAGED, move_aside
from accel_fsdp.train.faults import Faults
from accel_fsdp.train.lifetime import Preempted, Preemption, doing
from accel_fsdp.train.observe import Terminal, TrainLogger
from accel_fsdp.train.state import TrainingState


class Checkpointer:
    """Saves the training state at its cadence (and at a preemption every rank agreed on), resumes a run from it, and
    exports the last checkpoint. Built from what it saves, what describes it and where it goes."""

    def __init__(self, *, accelerator, model, optimizer, scheduler, sampler, logger: TrainLogger, recipe, settings,
                 tokenizer, layout: RunLayout, terminal: Terminal, preemption: Preemption, total_steps: int,
                 parameters: int, trainable_parameters: int, data_identity: dict | None = None,
                 faults: Faults | None = None, quantized_base: dict | None = None,
                 starting_weights: str | None = None):
        self.accelerator, self.model, self.optimizer, self.scheduler = accelerator, model, optimizer, scheduler
        self.sampler = sampler
        """Where the data stands is saved with the weights."""
        self.logger = logger
        """Its logging window is saved with the training state, and restored on resume."""
        self.recipe, self.settings, self.tokenizer = recipe, settings, tokenizer
        self.layout, self.terminal, self.preemption = layout, terminal, preemption
        self.total_steps, self.parameters, self.trainable_parameters = total_steps, parameters, trainable_parameters
        self.every = recipe.checkpoint.every_steps
        self.last_saved_step: int | None = None
        self.newest: Path | None = None
        """The run's newest checkpoint: this attempt's last save, or the one it resumed from."""
        self.resumed_from: Path | None = None
        self.faults = faults  # crash injection inside a save (tests), from train/hooks.py
        self.data_identity = data_identity
        """What the run's data was (data/identity.py): saved with every checkpoint, compared on resume."""
        self.quantized_base = quantized_base
        """The 4-bit base's record (model.quantize): saved in each manifest, checked against the checkpoint's on
        resume."""
        self.starting_weights = starting_weights
        """The fingerprint of the weights the run started from, where its checkpoints hold only against them
        (data/identity.py `weights_fingerprint`): saved in each manifest, compared on resume."""

    def after_step(self, state: TrainingState, before_save: Callable[[], None] = lambda: None) -> None:
        """`before_save`: confirms that the step was taken (train/finite.py), before a checkpoint records it."""
        if self.every and state.step % self.every == 0 and state.step != self.total_steps:
            before_save()
            self.save(state)
        if self.preemption.agreed():
            before_save()
            self.stop_preempted(state)

    def at_end(self, state: TrainingState) -> None:
        if self.last_saved_step != state.step:
            self.save(state)

    def save(self, training: TrainingState) -> Path:
        recipe, sampler, step = self.recipe, self.sampler, training.step
        doing(f"the save of the checkpoint of step {step}")
        state = TrainerState(step=step, **sampler.position(step), tokens_seen=training.tokens_seen,
                             total_steps=self.total_steps, parameters=self.parameters,
                             trainable_parameters=self.trainable_parameters, data=sampler.state_dict(step),
                             log_window=self.logger.state_dict())  # collective, like the save
        path = ckpt.save_checkpoint(self.accelerator, self.model, self.optimizer, self.scheduler,
                                    root=self.layout.checkpoints, step=step, trainer_state=state, recipe=recipe,
                                    settings=self.settings, tokenizer=self.tokenizer, lora=recipe.model.lora.enabled,
                                    keep_last=recipe.checkpoint.keep_last, faults=self.faults, run_id=self._run_id(),
                                    data_identity=self.data_identity, quantized_base=self.quantized_base,
                                    starting_weights=self.starting_weights)
        self.last_saved_step, self.newest = step, path
        self.terminal.say(f"checkpoint: {path}")
        return path

    def resume(self, resume_from: str | None = None, *, accept_data_change: bool = False) -> TrainingState:
        """Load the checkpoint the start decision chose (`resume_from`, else the newest intact one): weights,
        optimizer, schedule, RNG, data position, logging window; return the training state it saved.
        `accept_data_change`: --accept-data-change, go on though a data source changed since."""
        recipe, acc, say = self.recipe, self.accelerator, self.terminal.say
        # Every file is checked against its CRC-32 before anything reads it, the ranks sharing the reading.
        point = checkpoint_index.checkpoint_to_resume(self.layout.checkpoints, resume_from, accelerator=acc)
        info = point.checkpoint
        for note in point.notes() + checkpoint_index.check_resume(info, recipe, self.settings, self.total_steps,
                                                                  accept_data_change=accept_data_change):
            say(f"resume: {note}")
        self._keep_aside(point.passed_over)
        checkpoint_index.check_quantized_base(info, self.quantized_base)
        state = ckpt.load_checkpoint(acc, self.model, self.optimizer, self.scheduler, info,
                                     lora=recipe.model.lora.enabled)
        if state.data is not None:  # where each source stands; without it (never written so), replayed from step 0
            self.sampler.load_state_dict(state.data)
        self.logger.load_state_dict(state.log_window)
        training = TrainingState(step=state.step, tokens_seen=state.tokens_seen or 0)
        self.last_saved_step, self.newest, self.resumed_from = training.step, info.path, info.path
        say(f"resume: continuing from {info.path} at step {training.step} of {self.total_steps} "
            f"(epoch {state.epoch}, {state.rows_consumed or 0:,} units drawn)")
        return training

    def _keep_aside(self, passed_over: list) -> None:
        """Collective. The damaged or cut-short checkpoints a resume went back past are moved aside, kept: left in
        place, the run's own save of the same step would replace one, and rotation would count a changed one (its
        sizes are right) among the newest it keeps, deleting the intact ones this run writes."""
        if passed_over and self.accelerator.is_main_process:
            aside = move_aside(self.layout.checkpoints, [c.path for c in passed_over], DAMAGED)
            self.terminal.say(f"resume: {', '.join(c.name for c in passed_over)} kept in {aside} (accel-fsdp never "
                              "deletes it: look at it, or delete it yourself)")
        if passed_over:
            self.accelerator.wait_for_everyone()  # every rank agreed on passed_over: the CRC-32s were shared

    def stop_preempted(self, state: TrainingState) -> None:
        """Every rank agreed to stop after this step: checkpoint it (unless just saved), say so, and leave
        resumable."""
        step, preemption = state.step, self.preemption
        self.terminal.close_bar()
        path = self.layout.checkpoints / checkpoint_name(step) if self.last_saved_step == step else self.save(state)
        if self.accelerator.is_main_process:
            write_atomic(self.layout.preempted_file, json.dumps({"step": step, "checkpoint": str(path),
                                                                "signal": preemption.signal_name}))
        self.accelerator.wait_for_everyone()
        ckpt.wait_for_rotations()
        raise Preempted(step, path, preemption.signal_name or "a signal")

    def newest_checkpoint(self) -> str | None:
        return str(self.newest) if self.newest is not None else None

    def started_from(self) -> tuple[str, bool]:
        """Where this attempt's weights came from, as a message names it, and whether that is a checkpoint."""
        if self.resumed_from is not None:
            return f"{self.resumed_from} (the checkpoint this run resumed from)", True
        model = self.recipe.model
        if model.name_or_path:
            return f"{self.recipe.where('model.name_or_path')} ({model.name_or_path})", False
        return f"{self.recipe.where('model.architecture')} (weights drawn at random)", False

    def wait(self) -> None:
        """Until the rotation of old checkpoints (in the background) is done."""
        ckpt.wait_for_rotations()

    def export_final(self) -> None:
        """The main process alone, after the other ranks have left: the last checkpoint as a Hugging Face folder. A
        full disk is one message (the export is written whole or not at all: an earlier one stays as it was) with the
        command that writes it later; the checkpoint is complete either way."""
        info = checkpoint_index.latest_complete(self.layout.checkpoints)
        during = (lambda: self.faults.in_export(info.manifest.step)) if self.faults is not None else None
        try:
            report = consolidate(info, self.layout.final, dtype=self.recipe.checkpoint.export_dtype, during=during)
        except OSError as e:
            if e.errno not in DISK_FULL:
                raise
            raise UserError(Problem(str(self.layout.final), f"exporting {info.name} failed: {e.strerror}",
                                    "free space there, then export the complete checkpoint with `accel-fsdp "
                                    f"checkpoint consolidate {self.layout.root} {self.layout.final}`")) from None
        print(f"export: {report.summary()}")

    def _run_id(self) -> str | None:
        try:
            return RunIdentity.read(self.layout.run_file).run_id
        except UserError:
            return None
