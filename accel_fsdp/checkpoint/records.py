"""The two JSON records of a checkpoint, typed: `manifest.json` (what the checkpoint holds; `Manifest`) and
`trainer_state.json` (where training stood; `TrainerState`). Their keys on disk are the field names, in field
order. Readers use attributes; a record damaged on disk is a `DamagedRecord` (a UserError naming the checkpoint),
never a KeyError; any other file of it that cannot be read is one too (`damaged_if_unreadable`). This module reads
and writes no checkpoint files besides these two records.
"""

from __future__ import annotations

import json
import pickle
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from accel_fsdp.errors import Problem, UserError, first_line
from accel_fsdp.layout import MANIFEST, TRAINER_STATE

FORMAT = "accel-fsdp-checkpoint/1"


class DamagedRecord(UserError):
    """A manifest or trainer state that parses but is not one of ours (edited by hand, or damaged in place)."""

    def __init__(self, checkpoint: Path | str, reason: str):
        self.reason = reason
        """Why, as `checkpoint inspect` shows it: "manifest.json is damaged (...)"."""
        super().__init__(Problem(str(checkpoint), f"incomplete or corrupt checkpoint: {reason}",
                                 "use an earlier complete checkpoint (see `accel-fsdp checkpoint inspect` on the run "
                                 "folder)"))


@contextmanager
def damaged_if_unreadable(checkpoint: Path | str, what: str):
    """A file of the checkpoint that its reader cannot read (torch.load's UnpicklingError, DCP's
    CheckpointException, which is a BaseException, torch/distributed/checkpoint/api.py, checked with 2.13.0) becomes
    a `DamagedRecord` naming the checkpoint and the file: one message, where a rank showed torch's traceback. The
    manifest's sizes and checksums find most damage before; this is for what they cannot (a checkpoint whose
    manifest was rewritten, or written damaged)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (UserError, MemoryError):
        raise
    except (CheckpointException, pickle.UnpicklingError, EOFError, OSError, ValueError, RuntimeError) as e:
        if type(e).__name__ == "OutOfMemoryError":
            raise
        cause = e
        if isinstance(e, CheckpointException):  # its text is every rank's traceback: the first cause says it
            causes = [v[0] if isinstance(v, tuple) else v for v in e.failures.values()]
            cause = next((c for c in causes if isinstance(c, BaseException)), e)
        detail = ("UnpicklingError: not what torch.save wrote" if isinstance(cause, pickle.UnpicklingError)
                  else first_line(cause, 120, named=True))  # (torch's text is a paragraph on weights_only)
        raise DamagedRecord(checkpoint, f"{what} cannot be read ({detail})") from None


class _Record:
    """A JSON file of a checkpoint, as a dataclass whose fields are its keys."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass
class Manifest(_Record):
    """manifest.json: what a checkpoint holds. Written last, by the main process, once every rank's files are on disk:
    a checkpoint without one never finished."""

    format: str | None = FORMAT
    """FORMAT; another value is a checkpoint this version cannot read."""
    step: int = 0
    """The optimizer step the checkpoint was taken after."""
    epoch: int | None = None
    """Epoch of the data at that step."""
    world_size: int | None = None
    """Ranks that wrote it."""
    state_dict_type: str | None = None
    """SHARDED_STATE_DICT or FULL_STATE_DICT: how the model and optimizer files are laid out."""
    fsdp_version: int | None = None
    """1 or 2; their optimizer states are not interchangeable."""
    lora: bool | None = None
    """Only the LoRA adapter weights (and their optimizer state) are saved."""
    recipe_fingerprint: str | None = None
    """Fingerprint of the recipe that made it."""
    run_id: str | None = None
    """The run that made it (None: made before run ids)."""
    parameters: int | None = None
    """Parameters of the model."""
    trainable_parameters: int | None = None
    """Parameters the optimizer updates."""
    created: str | None = None
    """When it was written (local time, ISO 8601)."""
    versions: dict[str, str] | None = None
    """accel_fsdp, torch, accelerate and transformers versions that wrote it."""
    quantized_base: dict | None = None
    """The 4-bit base the adapters were trained on (model.quantize: method, fingerprint; model/quantize.py
    QuantizedBase). The base itself is not saved: it is rebuilt from the model files and checked against this."""
    starting_weights: str | None = None
    """Of a run whose checkpoints hold only against the weights it started from (LoRA adapters over their base; a
    DPO policy and its reference): their fingerprint (data/identity.py `weights_fingerprint`), which a resume compares
    with the model files as they are now. None otherwise."""
    data: dict | None = None
    """The identity of each data source as the run read it (data/identity.py `data_identity`): a resume compares it
    with the data as it is now."""
    files: dict[str, int] = field(default_factory=dict)
    """Every file (relative path) with its size in bytes."""
    crc32: dict[str, str] = field(default_factory=dict)
    """CRC-32 of every file, hex."""

    @staticmethod
    def shape_problem(data) -> str | None:
        """What is wrong with a manifest that parses but is not one of ours, or None."""
        if not isinstance(data, dict):
            return f"a JSON {type(data).__name__}, not an object"
        if not _is_count(data.get("step")):
            return f"step {data.get('step')!r} is not a step number"
        files = data.get("files")
        if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, int) for k, v in files.items()):
            return "its file list is not a mapping of file to size"
        if any(Path(k).is_absolute() or ".." in Path(k).parts for k in files):
            return "its file list names paths outside the checkpoint"
        if data.get("data") is not None and not isinstance(data.get("data"), dict):
            return "its data identity is not a mapping of source to identity"
        crc = data.get("crc32", {})
        if not isinstance(crc, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in crc.items()):
            return "its checksums are not a mapping of file to CRC-32"
        return None

    @classmethod
    def from_dict(cls, data, *, checkpoint: Path | str = "", checked: bool = True) -> Manifest:
        """The manifest a parsed manifest.json holds; unknown keys are ignored, missing ones are None. A DamagedRecord
        naming `checkpoint` if its step, files or checksums are not what we write (`checked=False`: take what is
        there, for questions such as which run made it)."""
        if checked:
            problem = cls.shape_problem(data)
            if problem:
                raise DamagedRecord(checkpoint, f"{MANIFEST} is damaged ({problem})")
        elif not isinstance(data, dict):
            data = {}
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        known.setdefault("format", None)  # a manifest that does not say its format is not one we can read
        if known.get("crc32") is None:
            known["crc32"] = {}
        return cls(**known)

    @classmethod
    def read(cls, checkpoint: Path, *, checked: bool = True) -> Manifest:
        """The manifest of the checkpoint folder `checkpoint`; a DamagedRecord if it is missing, unreadable or
        damaged."""
        try:
            data = json.loads((Path(checkpoint) / MANIFEST).read_text())
        except FileNotFoundError:
            raise DamagedRecord(checkpoint, f"no {MANIFEST} (the save did not finish, or not a checkpoint)") from None
        except (OSError, UnicodeDecodeError, ValueError):
            raise DamagedRecord(checkpoint, f"{MANIFEST} is corrupt") from None
        return cls.from_dict(data, checkpoint=checkpoint, checked=checked)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @property
    def total_bytes(self) -> int:
        """Bytes of all its files."""
        return sum(self.files.values())


@dataclass
class LogWindow(_Record):
    """The logging window that was open when a checkpoint was taken (train/observe.py): the optimizer steps since the
    last train row and the sums its row will average, over all ranks. A resumed run's first row then averages the
    same steps as an uninterrupted run's."""

    steps: int = 0
    """Optimizer steps in the window."""
    loss: float = 0.0
    """Sum of those steps' losses (each the mean over its global batch)."""
    grad_norm: float = 0.0
    """Sum of their gradient norms (before clipping)."""
    sums: dict[str, float] = field(default_factory=dict)
    """The window's sums of what the objective logs (a preference run's rewards and log-probs over its pairs; train/
    methods `Objective.statistics` reads them); empty for sft."""

    @classmethod
    def from_dict(cls, data) -> LogWindow | None:
        """The window a trainer state holds; None where it holds none, or one that is not ours (its steps are then
        logged without it: the row averages fewer steps, nothing else changes)."""
        if not isinstance(data, dict) or not _is_count(data.get("steps")) or not isinstance(data.get("sums"), dict):
            return None
        numbers = [data.get("loss"), data.get("grad_norm"), *data["sums"].values()]
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in numbers):
            return None
        return cls(steps=data["steps"], loss=float(data["loss"]), grad_norm=float(data["grad_norm"]),
                   sums={str(k): float(v) for k, v in data["sums"].items()})


@dataclass
class TrainerState(_Record):
    """trainer_state.json: where training stood when the checkpoint was taken (the model, optimizer and RNG states
    are in their own files)."""

    step: int
    """Optimizer steps done."""
    epoch: int | None = None
    """Passes over the whole mixture done: units drawn // the units of all sources (each source's own place is in
    `data`)."""
    batch_in_epoch: int | None = None
    """Global batches drawn since that pass began."""
    rows_consumed: int | None = None
    """Units drawn since the start (global batch x step): packed sequences, rows or preference pairs, whichever the
    data's unit is."""
    tokens_seen: int | None = None
    """Tokens trained on since the start (labels counted)."""
    total_steps: int | None = None
    """Optimizer steps the run was set to do."""
    parameters: int | None = None
    """Parameters of the model."""
    trainable_parameters: int | None = None
    """Parameters the optimizer updates."""
    data: dict | None = None
    """Where each data source stands after `step` (data/sampler.py: units drawn from each, and what they cost)."""
    log_window: LogWindow | None = None
    """The logging window open at `step` (None: the checkpoint was taken right after a train row, or by an earlier
    version)."""
    scheduler: dict | None = None
    """The learning-rate scheduler's state_dict (saved with the checkpoint, consumed by load_checkpoint)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Keys of a newer writer this version does not know: kept, written back as they were."""

    @classmethod
    def from_dict(cls, data, *, checkpoint: Path | str = "") -> TrainerState:
        """A DamagedRecord naming `checkpoint` if it is not a JSON object with a step number."""
        if not isinstance(data, dict):
            raise DamagedRecord(checkpoint, f"{TRAINER_STATE} is damaged (a JSON {type(data).__name__}, not an object)")
        if not _is_count(data.get("step")):
            raise DamagedRecord(checkpoint, f"{TRAINER_STATE} is damaged (step {data.get('step')!r} is not a step "
                                "number)")
        names = [f.name for f in fields(cls) if f.name != "extra"]
        known = {k: data[k] for k in names if k in data}
        known["log_window"] = LogWindow.from_dict(data.get("log_window"))
        return cls(**known, extra={k: v for k, v in data.items() if k not in names})

    @classmethod
    def read(cls, checkpoint: Path) -> TrainerState:
        try:
            data = json.loads((Path(checkpoint) / TRAINER_STATE).read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise DamagedRecord(checkpoint, f"{TRAINER_STATE} is unreadable ({type(e).__name__})") from None
        return cls.from_dict(data, checkpoint=checkpoint)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object: the known keys in field order (the log window only where one was open), then the unknown
        ones, then the scheduler (last, as it was always written)."""
        written_apart = ("extra", "scheduler", "log_window")
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in written_apart}
        if self.log_window is not None:
            out["log_window"] = self.log_window.to_dict()
        out.update(self.extra)
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler
        return out
