"""The throughput table of the speed and memory knobs (issue 23), a section of benchmarks/gpu_check.py:

    python benchmarks/gpu_check.py --table-only --markdown table.md    # the table alone, one GPU
    python benchmarks/gpu_check.py --cpu                               # with the checks, tiny models on CPU ranks

Each model is trained for STEPS optimizer steps (gpu_check's `--table-steps` changes it), from random weights built
from its config (no download; the shapes of model/architectures.py), on packed built-in stories, once per row, each
row adding a knob to the row above: eager, +compile, +chunked loss, +activation offload, +FP8 (Llama on GPUs of
compute capability 8.9+). A row reports tokens/s and MFU (medians of the steps after the first; MFU against the
card's dense bf16 peak, hardware.py PEAK_FLOPS), the peak memory of a rank, and its loss after those steps against
eager's. A row that cannot run here says why, as SKIP.

On GPUs: llama-3.2-1b at 2,048 and 8,192 tokens, gpt2-xl at 1,024, full fine-tunes in bf16 on one GPU. On CPU ranks
(--cpu) the same rows on tiny models of the same families (2 blocks, the real vocabularies) at 128 tokens, where FP8
is skipped and MFU not measured: the mechanism runs, the figures are not the GPU's. On a CPU without native bf16
(AVX2 alone) the CPU rows are fp32 (`table_precision`): PyTorch emulates bf16 there, and a bf16 matrix product of the
Llama head's shape took 20x an fp32 one on an AVX2-only AMD EPYC (the table: 983 s in the test, against 172 s on an
AVX512-BF16 one).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from accel_fsdp.files import write_atomic

REPO = Path(__file__).resolve().parents[1]
STEPS = 20


@dataclass(frozen=True)
class Model:
    """One model of the table: its architecture (model/architectures.py) and what shrinks it on CPU ranks."""

    label: str
    architecture: str
    seq_len: int
    micro_batch: int
    vocab: int
    llama: bool
    cpu_overrides: dict


GPU_MODELS = (  # in the order of what matters most when a time budget cuts the table short
    Model("llama-3.2-1b", "llama-3.2-1b", 2048, 4, 128256, True, {}),
    Model("gpt2-xl", "gpt2-xl", 1024, 8, 50257, False, {}),
    Model("llama-3.2-1b", "llama-3.2-1b", 8192, 1, 128256, True, {}),
)
CPU_MODELS = (
    Model("llama (2 blocks, width 128)", "llama-3.2-1b", 128, 2, 128256, True,
          {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 32}),
    Model("gpt2 (2 blocks, width 128)", "gpt2-xl", 128, 2, 50257, False, {"n_layer": 2, "n_embd": 128, "n_head": 4}),
)


@dataclass(frozen=True)
class Variant:
    name: str
    sets: tuple[str, ...]
    """What the row adds to the one above it (`--set` items)."""


VARIANTS = (
    Variant("eager", ("training.compile=false", "training.chunked_loss=false", "training.activation_offload=false")),
    Variant("+compile", ("training.compile=true",)),
    Variant("+chunked loss", ("training.chunked_loss=true",)),
    Variant("+activation offload", ("training.activation_offload=true", "model.activation_checkpointing=true")),
    Variant("+FP8", ("training.mixed_precision=fp8",)),
)


def skipped_because(model: Model, variant: Variant, cpu: bool, known_keys: set[str]) -> str | None:
    """Why a row cannot run here, or None."""
    missing = [s.split("=")[0] for s in variant.sets if s.split("=")[0] not in known_keys]
    if variant.name != "eager" and missing:
        return f"{', '.join(missing)} is not a recipe key of this build"
    if variant.name == "+FP8":
        if not model.llama:
            return "GPT-2's Conv1D layers are not converted to float8 (model/fp8.py)"
        if cpu:
            return "float8 matrix products need a GPU of compute capability 8.9 or newer"
    return None


def table_precision(cpu: bool) -> tuple[str, str]:
    """The rows' precision and why: bf16, as users train on GPUs, except on CPU ranks of a CPU that emulates it."""
    if not cpu:
        return "bf16", ""
    from accel_fsdp.hardware import cpu_bf16

    native, name = cpu_bf16()
    return ("bf16", "") if native else ("fp32", f"{name} has no native bf16, which PyTorch emulates many times slower")


def recipe_for(model: Model, work: Path, cpu: bool, ranks: int, steps: int = STEPS) -> Path:
    overrides = dict(model.cpu_overrides if cpu else {}, vocab_size=model.vocab)
    data = {"name": f"throughput-{model.architecture}-{model.seq_len}",
            "model": {"architecture": model.architecture, "tokenizer": "builtin:quickstart",
                      "config_overrides": overrides, "attn_implementation": "sdpa"},
            "data": {"path": "builtin:quickstart", "seq_len": model.seq_len, "eval_fraction": 0, "packing": True,
                     "max_rows": 6000},
            "training": {"micro_batch_size": model.micro_batch, "global_batch_size": model.micro_batch * ranks,
                         "max_steps": steps, "lr": 1e-4, "warmup_steps": 0,
                         "mixed_precision": table_precision(cpu)[0]},
            "checkpoint": {"export_final": False}, "logging": {"every_steps": 1, "sample_prompt": None}}
    path = work / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def known_recipe_keys() -> set[str]:
    from accel_fsdp.config.recipe import key_reference

    return {key for key, *_ in key_reference()}


def profile_window(steps: int) -> str:
    """The last two steps (the one before them is the profiler's warm-up): the row's median, over the steps after the
    first, is not moved by the profiler's own cost in two of them."""
    return f"{max(2, steps - 1)}-{steps}"


def profiled_split(folder: Path) -> str:
    """Rank 0's split of a profiled step (train/profiling.py `StepSplit`): each region's share of the step's wall time
    (kernel time on a GPU: what the optimizer step and the rest cost beside the forward and backward)."""
    from accel_fsdp.train.profiling import CLIPPING, FORWARD_BACKWARD, OPTIMIZER, StepSplit

    path = folder / "profile" / "rank0.summary.json"
    shares = StepSplit.read(path).shares() if path.exists() else {}
    short = {FORWARD_BACKWARD: "fwd+bwd", CLIPPING: "clip", OPTIMIZER: "optimizer"}
    return " / ".join(f"{short[name]} {share:.0%}" for name, share in shares.items()) or "-"


def train(recipe: Path, folder: Path, sets: list[str], cpu: bool, ranks: int, run=None, steps: int = STEPS) -> tuple[
        subprocess.CompletedProcess, list[dict]]:
    """One row's run; `run` is gpu_check's subprocess runner under its time budget (plain subprocess.run if None)."""
    import json

    from accel_fsdp.config.binder import later_wins

    argv = [sys.executable, "-m", "accel_fsdp", "recipe", "run", str(recipe), "--output-dir", str(folder),
            "--overwrite", "--benchmark", "--num-processes", str(ranks), *(["--cpu"] if cpu else []),
            "--profile", profile_window(steps)]
    for item in later_wins(sets):  # each row adds to the one above: a later value replaces an earlier
        argv += ["--set", item]
    if run is None:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=1200, cwd=REPO)
    else:
        proc = run(argv, 1200, cwd=REPO)
    # The run's own output beside its folder, for a row that failed (its cell holds only the last line).
    write_atomic(folder.parent / f"{folder.name}.output.txt", f"$ {' '.join(argv)}\n{proc.stdout}\n{proc.stderr}")
    metrics = folder / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
    return proc, [r for r in rows if r.get("kind") == "train"]


def row_figures(rows: list[dict], eager_loss: float | None) -> list[str]:
    """tokens/s and MFU (medians of the steps after the first, which compiles and warms up), peak memory of a rank,
    the last loss and its difference to eager's."""
    later = rows[1:] or rows
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in later)
    mfu = [r["mfu"] for r in later if r.get("mfu") is not None]
    peak = max(max(r["peak_memory_bytes"]) for r in rows)
    loss = rows[-1]["loss"]
    versus = "" if eager_loss is None else f" ({(loss - eager_loss) / eager_loss:+.2%} vs eager)"
    return [f"{tokens_per_s:,.0f}", f"{statistics.median(mfu):.1%}" if mfu else "-", f"{peak / 2**30:.2f} GiB",
            f"{loss:.4f}{versus}"]


def throughput_section(work: Path, cpu: bool, ranks: int, device: str, section_type, steps: int = STEPS, budget=None,
                       run=None, on_row=lambda: None, on_start=lambda section: None):
    """The table, as gpu_check's Section; each row printed as it is measured, then `on_row()`. `budget` (gpu_check's
    Budget): a row that would start after it is spent is a SKIP that says so. `steps` below STEPS (at least 2: the
    first step is warm-up) gives the same rows for less time: tests/test_knob_throughput.py checks the mechanism, not
    the figures."""
    precision, why = table_precision(cpu)
    section = section_type(f"Knob throughput: {steps} steps on {ranks} x {device}, {precision}"
                           + (f" ({why})" if why else ""),
                           ["model", "tokens", "variant", "result", "tokens/s", "MFU", "peak memory",
                            f"loss after {steps} steps", "profiled step: share of its wall time"])
    on_start(section)
    keys = known_recipe_keys()
    for model in CPU_MODELS if cpu else GPU_MODELS:
        recipe, sets, eager_loss = recipe_for(model, work, cpu, ranks, steps), [], None
        for variant in VARIANTS:
            sets += [s for s in variant.sets if s.split("=")[0] in keys]
            why = skipped_because(model, variant, cpu, keys) or (budget.spent() if budget else None)
            head = [model.label, f"{model.seq_len:,}", variant.name]
            if why:
                cells = [*head, "SKIP", why, "", "", "", ""]
            else:
                started = time.monotonic()
                folder = work / f"throughput-{model.architecture}-{model.seq_len}-{len(section.rows)}"
                proc, rows = train(recipe, folder, sets, cpu, ranks, run, steps)
                if proc.returncode != 0 or len(rows) < steps:
                    tail = (proc.stderr or proc.stdout).strip().splitlines()
                    cells = [*head, "FAIL", f"exit {proc.returncode}: {tail[-1][:200] if tail else 'no output'}",
                             "", "", "", ""]
                else:
                    figures = row_figures(rows, eager_loss)
                    eager_loss = rows[-1]["loss"] if eager_loss is None else eager_loss
                    cells = [*head, "INFO", *figures, profiled_split(folder)]
                print(f"      ({time.monotonic() - started:.0f} s)", flush=True)
            print(f"{cells[3]:<5} {' '.join(c for c in cells[:3])}: {' | '.join(c for c in cells[4:] if c)}",
                  flush=True)
            section.rows.append(cells)
            on_row()
    return section
