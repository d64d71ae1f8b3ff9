"""`accel-fsdp bench`: throughput and memory of a recipe, measured through the real CLI.

Each measurement is a real run (`recipe run --benchmark`: no evaluation, checkpoints or export) of warm-up plus N
optimizer steps in a temporary folder; the figures come from its metrics.jsonl (after warm-up: median step time
and tokens/s, peak memory of every rank, MFU on GPUs) and sharding.json (bytes of parameters, gradients and
optimizer state per rank). Comparisons run their variants in the same invocation, on the same model, batch and
data, alternating them when repeated, and report medians: machines are noisy, ratios measured side by side
are what to trust.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from accel_fsdp.config.accelerate import FULL_SHARD, NO_SHARD, SHARD_GRAD_OP
from accel_fsdp.config.binder import later_wins
from accel_fsdp.errors import UserError
from accel_fsdp.files import scratch_folder, write_atomic
from accel_fsdp.layout import RunLayout
from accel_fsdp.model.tokenizer import offline_tokenizer
from accel_fsdp.train.lifetime import tied_to_this_process
from accel_fsdp.train.metrics import TrainRow, read_metrics


@dataclass
class Measurement:
    label: str
    tokens_per_s: float
    tokens_per_s_per_rank: float
    step_time_s: float
    peak_memory_bytes: list[int] = field(default_factory=list)
    state_bytes: list[int] = field(default_factory=list)
    """Parameters + gradients + optimizer state per rank."""
    mfu: float | None = None


def _run(argv: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    full = tied_to_this_process(dict(os.environ, **(env or {}), PYTHONUNBUFFERED="1"))  # a killed bench: no orphan
    return subprocess.run([sys.executable, "-m", "accel_fsdp", *argv], capture_output=True, text=True, env=full)


def bench_overrides(steps: int, warmup: int) -> list[str]:
    return [f"training.max_steps={steps + warmup}", "training.warmup_steps=0", "training.eval_every_steps=null",
            "checkpoint.every_steps=null",
            "checkpoint.export_final=false", "logging.every_steps=1", "logging.sample_prompt=null"]


def measure_ours(recipe: str, config: str, overrides: list[str], steps: int, warmup: int, label: str,
                 workdir: Path, cpu: bool = False) -> Measurement:
    """`cpu`: the config on CPU ranks whatever it was written for (--cpu of `recipe run`)."""
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=workdir))
    argv = ["recipe", "run", recipe, "--accelerate-config", config, "--output-dir", str(run_dir), "--overwrite",
            "--benchmark", *(["--cpu"] if cpu else [])]
    for item in later_wins(list(overrides) + bench_overrides(steps, warmup)):  # the bench's own replace the user's
        argv += ["--set", item]
    proc = _run(argv)
    if proc.returncode != 0:
        _fail(label, proc)
    layout = RunLayout.at(run_dir)
    from accel_fsdp.train.sharding import ShardingRecord

    rows = [r for r in read_metrics(layout.metrics_file) if isinstance(r, TrainRow) and r.step > warmup]
    state = ShardingRecord.read(layout.sharding_file).model_state_bytes()
    peak = [max(r.peak_memory_bytes[i] for r in rows) for i in range(len(rows[0].peak_memory_bytes))]
    mfu = [r.mfu for r in rows if r.mfu is not None]
    return Measurement(label, statistics.median(r.tokens_per_s for r in rows),
                       statistics.median(r.tokens_per_s_per_rank for r in rows),
                       statistics.median(r.step_time_s for r in rows), peak, state,
                       statistics.median(mfu) if mfu else None)


def measure_baseline(recipe: str, config_path: Path, overrides: list[str], steps: int, warmup: int,
                     workdir: Path, cpu: bool = False) -> Measurement:
    """The hand-written loop (tools/baseline.py), launched by Accelerate's own launcher with the same config."""
    out = Path(tempfile.mkstemp(prefix="baseline-", suffix=".json", dir=workdir)[1])
    script = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", str(config_path),
              "--main_process_port", "0", "-m", "accel_fsdp.tools.baseline", recipe, str(out), "--steps", str(steps),
              "--warmup", str(warmup), *(["--cpu"] if cpu else [])]
    for item in overrides:
        script += ["--set", item]
    env = dict(os.environ, PYTHONUNBUFFERED="1", ACCEL_FSDP_ACCELERATE_CONFIG=str(config_path))
    proc = subprocess.run(script, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        _fail("baseline", proc)
    r = json.loads(out.read_text())
    return Measurement("baseline", r["tokens_per_s"], r["tokens_per_s_per_rank"], r["step_time_s"])


def _fail(label: str, proc: subprocess.CompletedProcess) -> None:
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
    if proc.returncode == 2:  # a user error, already worded for the user
        raise UserError("\n".join(line.removeprefix("error: ") for line in tail if line.strip()))
    raise RuntimeError(f"benchmark run {label!r} failed (exit {proc.returncode}):\n" + "\n".join(tail))


def variant_config(base: Path, workdir: Path, name: str, **fsdp) -> Path:
    """A copy of the accelerate config with some fsdp_config keys changed (for --compare)."""
    data = yaml.safe_load(base.read_text())
    data.setdefault("fsdp_config", {}).update(fsdp)
    if data["fsdp_config"].get("fsdp_version") == 1:
        data["fsdp_config"].pop("fsdp_reshard_after_forward", None)
    path = workdir / f"{name}.yaml"
    write_atomic(path, yaml.safe_dump(data))
    return path


def compare_strategies(recipe, config: Path, overrides, steps, warmup, workdir, cpu=False) -> list[Measurement]:
    """The strategies table: NO_SHARD (FSDP1, the DDP-like baseline), SHARD_GRAD_OP and FULL_SHARD."""
    version = int(yaml.safe_load(config.read_text()).get("fsdp_config", {}).get("fsdp_version", 1))
    no_shard = variant_config(config, workdir, "no_shard", fsdp_version=1, fsdp_sharding_strategy=NO_SHARD,
                              fsdp_use_orig_params=True, fsdp_sync_module_states=False)
    out = [measure_ours(recipe, str(no_shard), overrides, steps, warmup, "NO_SHARD (FSDP1)", workdir, cpu)]
    for strategy in (SHARD_GRAD_OP, FULL_SHARD):
        out.append(measure_ours(recipe, str(config), list(overrides) + [f"fsdp.sharding_strategy={strategy}"], steps,
                                warmup, f"{strategy} (FSDP{version})", workdir, cpu))
    return out


def linear_classes(meta_model) -> list[str]:
    """Class names of the linear layers inside the first transformer block (Conv1D for GPT-2, Linear for Llama)."""
    blocks = set(getattr(meta_model, "_no_split_modules", None) or [])
    block = next(m for m in meta_model.modules() if type(m).__name__ in blocks)
    return sorted({type(m).__name__ for m in block.modules() if type(m).__name__ in ("Linear", "Conv1D")})


def compare_wrapping(recipe, config: Path, overrides, steps, warmup, workdir, classes: list[str],
                     cpu: bool = False) -> list[Measurement]:
    """The "wrap test": one unit per transformer block vs the whole model as one unit vs one per Linear.

    Per Linear means every linear layer class of the blocks is a unit of its own (a transformer-based policy on
    that class): Accelerate's size-based policy would also try to shard ModuleList containers under FSDP2."""
    per_block = variant_config(config, workdir, "per_block", fsdp_auto_wrap_policy="TRANSFORMER_BASED_WRAP",
                               fsdp_transformer_layer_cls_to_wrap=None)
    whole = variant_config(config, workdir, "whole", fsdp_auto_wrap_policy="NO_WRAP")
    per_linear = variant_config(config, workdir, "per_linear", fsdp_auto_wrap_policy="TRANSFORMER_BASED_WRAP",
                                fsdp_transformer_layer_cls_to_wrap=",".join(classes))
    return [measure_ours(recipe, str(per_block), overrides, steps, warmup, "per block (transformer layer)", workdir,
                         cpu),
            measure_ours(recipe, str(whole), overrides, steps, warmup, "whole model (no wrap)", workdir, cpu),
            measure_ours(recipe, str(per_linear), overrides, steps, warmup, f"per Linear ({', '.join(classes)})",
                         workdir, cpu)]


def format_measurements(rows: list[Measurement], title: str) -> str:
    mb = 1 << 20
    lines = [title, f"{'variant':<34}{'tokens/s':>11}{'per rank':>10}{'step s':>9}{'state MB/rank':>15}"
                    f"{'peak MB/rank':>14}{'MFU':>7}"]
    for m in rows:
        state = f"{max(m.state_bytes) / mb:,.1f}" if m.state_bytes else "-"
        peak = f"{max(m.peak_memory_bytes) / mb:,.0f}" if m.peak_memory_bytes else "-"
        mfu = f"{100 * m.mfu:.1f}%" if m.mfu is not None else "-"
        lines.append(f"{m.label:<34}{m.tokens_per_s:>11,.0f}{m.tokens_per_s_per_rank:>10,.0f}{m.step_time_s:>9.3f}"
                     f"{state:>15}{peak:>14}{mfu:>7}")
    return "\n".join(lines)


def strategy_summary(rows: list[Measurement]) -> list[str]:
    """'memory per rank X vs Y unsharded, Z% saved'."""
    base = rows[0]
    out = []
    for m in rows[1:]:
        saved = 1 - max(m.state_bytes) / max(base.state_bytes)
        out.append(f"{m.label}: model state per rank {max(m.state_bytes) / (1 << 20):,.1f} MB vs "
                   f"{max(base.state_bytes) / (1 << 20):,.1f} MB unsharded, {100 * saved:.0f}% saved "
                   f"({max(m.state_bytes) / max(base.state_bytes):.2f} of NO_SHARD); speed "
                   f"{m.tokens_per_s / base.tokens_per_s:.2f}x NO_SHARD")
    return out


def to_json(result: dict) -> str:
    def plain(v):
        if isinstance(v, Measurement):
            return asdict(v)
        if isinstance(v, list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return json.dumps(plain(result), indent=1)


def run(recipe, config, overrides: list[str], *, steps: int, warmup: int, compare: str | None,
        baseline_rounds: int, cpu: bool = False) -> tuple[dict, str]:
    """One `accel-fsdp bench` invocation: (results for --json, the table to print). `cpu`: every run on CPU ranks,
    whatever the config was written for (--cpu)."""
    recipe_path = str(Path(recipe.source).absolute())
    result: dict = {"recipe": recipe.name, "config": config.label}
    with scratch_folder("accel-fsdp-bench") as work:
        if compare == "strategies":
            rows = compare_strategies(recipe_path, config.path, overrides, steps, warmup, work, cpu)
            result["strategies"] = rows
            text = format_measurements(rows, f"strategies on {config.label} ({recipe.name}):")
            text += "\n" + "\n".join(strategy_summary(rows))
        elif compare == "wrapping":
            from accel_fsdp.model.build import meta_model, model_config

            skeleton = meta_model(model_config(recipe, tokenizer=offline_tokenizer(recipe), offline=True))
            rows = compare_wrapping(recipe_path, config.path, overrides, steps, warmup, work, linear_classes(skeleton),
                                    cpu)
            result["wrapping"] = rows
            text = format_measurements(rows, f"wrapping on {config.label} ({recipe.name}):")
        elif baseline_rounds:
            ours, base = [], []
            for i in range(baseline_rounds):  # alternate, so drifts in machine load hit both sides alike
                ours.append(measure_ours(recipe_path, str(config.path), overrides, steps, warmup,
                                         f"accel-fsdp (round {i + 1})", work, cpu))
                base.append(measure_baseline(recipe_path, config.path, overrides, steps, warmup, work, cpu))
            ratio = statistics.median(o.tokens_per_s for o in ours) / statistics.median(b.tokens_per_s for b in base)
            result.update(ours=ours, baseline=base, ratio=ratio)
            text = format_measurements(ours + base, f"ours vs a hand-written Accelerate FSDP loop on {config.label} "
                                       f"({recipe.name}), {baseline_rounds} alternating rounds:")
            text += f"\nthroughput ratio ours / baseline (medians): {ratio:.3f}"
        else:
            m = measure_ours(recipe_path, str(config.path), overrides, steps, warmup, recipe.name, work, cpu)
            result["measurement"] = m
            text = format_measurements([m], f"{recipe.name} on {config.label}, {steps} steps after {warmup} warm-up:")
    return result, text
