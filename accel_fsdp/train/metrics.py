"""What a run reports: the metrics JSONL file, trackers, peak memory per rank, throughput and MFU.

One row per logged optimizer step in `<run>/metrics.jsonl` (written by the main process):
    {"kind": "train", "step", "loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_rank", "step_time_s",
     "peak_memory_bytes": [one per rank], "tokens_seen", "mfu" (GPU only), "source_tokens": {source: tokens}}
    {"kind": "eval", "step", "eval_loss", "eval_ppl", "eval_tokens", "eval_loss_by_source": {source: loss}}
A preference run's rows also carry the `PairStatistics` (eval rows with an `eval_` prefix). The same numbers go to
the trackers (tensorboard, wandb) through `accelerator.log` (per-source values as `train/source_tokens/<source>`).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from accel_fsdp.errors import Problem, UserError
from accel_fsdp.files import write_atomic
from accel_fsdp.model.facts import shape_of


def flops_per_token(config, seq_len: int, trainable_fraction: float = 1.0) -> float:
    """Training FLOPs per token: 6 x dense parameters (forward 2N, backward 4N) plus attention 12 x L x H x S
    (the PaLM appendix B accounting; embeddings excluded). LoRA skips the weight-gradient half of the
    backward of frozen weights: about 4N instead of 6N."""
    s = shape_of(config)
    head_dim = s.hidden // s.heads
    attn = s.hidden * s.heads * head_dim * 2 + s.hidden * s.kv_heads * head_dim * 2
    mlp = (3 if s.gated_mlp else 2) * s.hidden * s.intermediate
    dense = s.layers * (attn + mlp) + s.vocab * s.hidden  # the output projection counts, the embedding lookup not
    per_param = 6.0 if trainable_fraction >= 0.5 else 4.0
    return per_param * dense + 12.0 * s.layers * s.heads * head_dim * seq_len


@dataclass(kw_only=True)
class PairStatistics:
    """What a preference run reports besides its loss: means over the pairs of a logging window (train rows) or
    over the held-out pairs (eval rows, each key with an `eval_` prefix). The one list of them: the pair objective
    sums each over its pairs (train/methods/pairs.py), the logger and the evaluator turn the sums into these means,
    rows write them, `report` reads them."""

    reward_chosen: float
    """Mean reward of the chosen answers (each method defines its reward: docs/PREFERENCE.md)."""
    reward_rejected: float
    """Mean reward of the rejected answers."""
    reward_margin: float
    """reward_chosen - reward_rejected."""
    reward_accuracy: float
    """Share of pairs whose chosen answer has the strictly higher reward (a tie counts as wrong, as in TRL)."""
    logps_chosen: float
    """Mean over the pairs of the chosen answer's mean token log-probability, log pi(y_w) / |y_w|."""
    logps_rejected: float
    """Mean over the pairs of log pi(y_l) / |y_l|."""

    @classmethod
    def summed(cls) -> tuple[str, ...]:
        """The statistics an objective sums over pairs (with a "pairs" count); the margin is derived from them."""
        return tuple(f.name for f in fields(cls) if f.name != "reward_margin")

    @classmethod
    def from_sums(cls, sums: dict[str, float]) -> PairStatistics | None:
        """The means of sums over pairs; None without pairs (an sft run)."""
        if not sums.get("pairs"):
            return None
        means = {name: sums[name] / sums["pairs"] for name in cls.summed()}
        return cls(reward_margin=means["reward_chosen"] - means["reward_rejected"], **means)

    @classmethod
    def names(cls, prefix: str = "") -> tuple[str, ...]:
        return tuple(prefix + f.name for f in fields(cls))


@dataclass(kw_only=True)
class TrainRow:
    """One logging window of training (the row of its last step). Fields that files from older versions (or other
    writers) may lack default to None; `row_problem` says which a row must have."""
    step: int
    loss: float
    """The mean over the window's steps of each step's loss (the mean over its global batch's loss-carrying tokens;
    preference tuning: over its pairs, docs/PREFERENCE.md). README's metrics table defines every key."""
    lr: float | None = None
    """The rate the window's last step used."""
    grad_norm: float | None = None
    """Mean gradient norm (before clipping) over the window's steps."""
    tokens_per_s: float
    tokens_per_s_per_rank: float
    step_time_s: float
    tokens_seen: int | None = None
    peak_memory_bytes: list[int]
    """Per rank, during this window."""
    peak_memory_bytes_run: list[int] | None = None
    """Per rank, the highest of any window so far."""
    mfu: float | None = None
    """GPU only: model FLOPs utilization against the device's peak for the run's precision."""
    source_tokens: dict[str, int] | None = None
    """Loss-carrying tokens of each data source in this row's step (the last of the window)."""
    preference: PairStatistics | None = None
    """Preference tuning, over the window's pairs (written as top-level keys: reward_chosen, ...)."""
    kind: str = "train"


@dataclass(kw_only=True)
class EvalRow:
    step: int
    eval_loss: float
    """The mixture's held-out loss, what the training loss estimates: each source's held-out loss weighted by its
    expected share of what the training loss averages over (loss-carrying tokens; pairs for preference tuning) per
    optimizer step (train/evaluate.py `loss_shares`). One source: its held-out loss."""
    eval_ppl: float
    """exp(eval_loss), capped at exp(50)."""
    eval_tokens: int | None = None
    """Held-out loss-carrying tokens (preference tuning: of the chosen answers)."""
    eval_loss_by_source: dict[str, float] | None = None
    """Mean token loss (preference: mean pair loss) of each source's held-out sequences."""
    preference: PairStatistics | None = None
    """Preference tuning, over the held-out pairs (written as top-level keys: eval_reward_chosen, ...)."""
    kind: str = "eval"


@dataclass(kw_only=True)
class StartupRow:
    step: int
    time_to_first_step_s: float
    phases_s: dict[str, float] | None = None
    kind: str = "startup"


MetricsRow = TrainRow | EvalRow | StartupRow
ROW_TYPES = {"train": TrainRow, "eval": EvalRow, "startup": StartupRow}


OPTIONAL = {"mfu"}
"""Keys a row leaves out when they do not apply (MFU on CPU)."""
_PREFIX = {"train": "", "eval": "eval_"}
"""How a row's `preference` statistics are spelled at its top level."""


def row_to_dict(row: MetricsRow) -> dict:
    """The JSON of a row: kind first, as the file has always had it; no null MFU on CPU; a preference run's statistics
    as top-level keys (none in sft)."""
    d = {"kind": row.kind, **{k: v for k, v in asdict(row).items() if k not in ("kind", "preference")}}
    d = {k: v for k, v in d.items() if not (k in OPTIONAL and v is None)}
    statistics = getattr(row, "preference", None)
    if statistics is not None:
        d.update({_PREFIX[row.kind] + k: v for k, v in asdict(statistics).items()})
    return d


def row_from_dict(d: dict) -> MetricsRow:
    """A row checked by `row_problem`; keys this version does not know are left out."""
    cls = ROW_TYPES[d["kind"]]
    names = set(cls.__dataclass_fields__) - {"preference"}
    row = cls(**{k: v for k, v in d.items() if k in names})
    prefix = _PREFIX.get(row.kind)
    if prefix is not None and all(isinstance(d.get(k), (int, float)) for k in PairStatistics.names(prefix)):
        row.preference = PairStatistics(**{k: d[prefix + k] for k in PairStatistics.names()})
    return row


class MetricsWriter:
    """Appends rows to metrics.jsonl (main process only) and forwards them to the trackers."""
    def __init__(self, accelerator, path: Path):
        self.accelerator = accelerator
        self.path = path

    def start_at(self, step: int) -> bool:
        """Before the first row of this attempt, which starts after optimizer step `step` (0: a new run, whose file
        starts empty). A resumed run repeats the steps after its checkpoint: their rows from the interrupted attempt
        are dropped. Whether the file keeps an evaluation of `step` (main process; False elsewhere)."""
        if self.accelerator.is_main_process and self.path.exists():
            kept = [r for r in read_metrics(self.path, strict=False) if r.step <= step] if step else []
            write_atomic(self.path, "".join(json.dumps(row_to_dict(r)) + "\n" for r in kept))
            return any(isinstance(r, EvalRow) and r.step == step for r in kept)
        return False

    def write(self, record: TrainRow | EvalRow | StartupRow) -> None:
        row, step = row_to_dict(record), record.step
        if self.accelerator.is_main_process:
            try:
                with self.path.open("a") as f:
                    f.write(json.dumps(row) + "\n")
            except OSError as e:  # a write of an open file names none: name ours (a resume drops a row cut short)
                raise OSError(e.errno, e.strerror, str(self.path)) if e.filename is None else e from e
        if self.accelerator.trackers:
            scalars = {}
            for k, v in row.items():
                if isinstance(v, dict):
                    scalars.update({f"{k}/{name}": x for name, x in v.items() if isinstance(x, (int, float))})
                elif isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                    scalars[k] = v
            self.accelerator.log({f"{row['kind']}/{k}": v for k, v in scalars.items()}, step=step)


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


def read_metrics(path: Path, *, strict: bool = True) -> list[MetricsRow]:
    """The rows of a metrics file. A last line cut short (the run was killed while writing it) is skipped. A
    damaged line elsewhere is a UserError naming it (`strict`), or skipped (a resume rewrites the file anyway)."""
    if not path.exists():
        return []
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError as e:
        raise UserError(Problem(str(path), f"cannot be read ({e.strerror or e})", "check the file")) from None
    rows = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
            why = row_problem(row)
        except ValueError:
            row, why = None, "not JSON"
        if why is None:
            rows.append(row_from_dict(row))
        elif i == len(lines) - 1 and why == "not JSON" or not strict:
            continue  # a last line cut short by a kill, or a resume that rewrites the file anyway
        else:
            raise UserError(Problem(f"{path}:{i + 1}", f"is not a metrics row: {why} (the file was edited or "
                                    "damaged)", f"delete or repair line {i + 1}"))
    return rows


# The numbers each kind of row must carry (what report and bench read).
_ROW_NUMBERS = {"train": ("loss", "tokens_per_s", "tokens_per_s_per_rank", "step_time_s"),
                "eval": ("eval_loss", "eval_ppl"), "startup": ("time_to_first_step_s",)}


def row_problem(row) -> str | None:
    """What makes `row` not a metrics row, or None."""
    if not isinstance(row, dict) or row.get("kind") not in _ROW_NUMBERS:
        return "no known kind"
    step = row.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"step {step!r} is not a step number"
    for key in _ROW_NUMBERS[row["kind"]]:
        value = row.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"{key} {value!r} is not a number"
    if row["kind"] == "train":
        peaks = row.get("peak_memory_bytes")
        if not isinstance(peaks, list) or not all(isinstance(p, int) and not isinstance(p, bool) for p in peaks):
            return "peak_memory_bytes is not a list of byte counts"
    return None


START_ENV = "ACCEL_FSDP_T0"
"""Set by the CLI to the wall-clock time its command started, so the ranks measure time to first step from there."""


class StartupClock:
    """Where the time to the first optimizer step goes: launch (the command's start to this process's start),
    imports, data, model build, sharding, first step. Marks are taken in order; `phases` are the gaps."""
    def __init__(self):
        self.start = float(os.environ.get(START_ENV) or _process_start_time())
        self.marks: list[tuple[str, float]] = [("launch", _process_start_time())]

    def mark(self, phase: str) -> None:
        """`phase` ended now."""
        self.marks.append((phase, time.time()))

    def phases(self) -> dict[str, float]:
        out, last = {}, self.start
        for name, t in self.marks:
            out[name] = round(max(0.0, t - last), 3)
            last = t
        return out

    def summary(self) -> str:
        phases = self.phases()
        return (f"first optimizer step after {sum(phases.values()):.1f}s ("
                + ", ".join(f"{name} {seconds:.1f}" for name, seconds in phases.items()) + ")")


def _process_start_time() -> float:
    """Wall-clock start of this process (Linux: /proc; elsewhere: now)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration, IndexError):
        return time.time()
