"""`accel-fsdp report RUN_DIR`: what a run did, from the files it wrote (metrics.jsonl, sharding.json, run.json):
steps, final and best evaluation loss, throughput, peak memory; for preference tuning the reward margin and
accuracy; and a loss curve (train and eval; with the margin and accuracy beside it for preference tuning) as PNG when
matplotlib is installed (`pip install "accel-fsdp[plot]"`)."""

from __future__ import annotations

import statistics
from pathlib import Path

from accel_fsdp.errors import Problem, UserError
from accel_fsdp.files import write_with
from accel_fsdp.layout import METRICS_FILE, RunIdentity, RunLayout, dangling_link_problem
from accel_fsdp.run.folder import lock_holder
from accel_fsdp.train.metrics import EvalRow, TrainRow, read_metrics


def summarize(run_dir: Path) -> dict:
    run_dir = Path(run_dir)
    layout = RunLayout.at(run_dir)
    metrics_file = layout.metrics_file
    if (dangling := dangling_link_problem(run_dir)) is not None:
        raise UserError(dangling)
    if not run_dir.is_dir():
        what = "does not exist" if not run_dir.exists() else "is a file, not a run folder"
        raise UserError(Problem(str(run_dir), what, "give the --output-dir of a run"))
    if not metrics_file.exists():
        raise UserError(Problem(str(run_dir), f"has no {METRICS_FILE}, so it is not a run folder (or the run logged "
                                "nothing yet)", "give the --output-dir of a run"))
    rows = read_metrics(metrics_file)
    train = [r for r in rows if isinstance(r, TrainRow)]  # every row was checked by read_metrics
    evals = [r for r in rows if isinstance(r, EvalRow)]
    if not train:
        raise UserError(Problem(str(metrics_file), "holds no training rows yet", "wait for the first logged step"))

    recipe_name = RunIdentity.read(layout.run_file).recipe_name if layout.run_file.exists() else None
    out = {
        "run": str(run_dir), "recipe": recipe_name, "steps": train[-1].step,
        "live": lock_holder(run_dir),  # a run still training: its figures so far, not its end
        "tokens_seen": train[-1].tokens_seen, "first_loss": train[0].loss, "final_loss": train[-1].loss,
        "tokens_per_s_median": statistics.median(r.tokens_per_s for r in train),
        "tokens_per_s_per_rank_median": statistics.median(r.tokens_per_s_per_rank for r in train),
        "step_time_s_median": statistics.median(r.step_time_s for r in train),
        "peak_memory_bytes_per_rank": [max(r.peak_memory_bytes[i] for r in train if i < len(r.peak_memory_bytes))
                                       for i in range(max(len(r.peak_memory_bytes) for r in train))],
    }
    mfu = [r.mfu for r in train if r.mfu is not None]
    if mfu:
        out["mfu_median"] = statistics.median(mfu)
    if evals:
        best = min(evals, key=lambda r: r.eval_loss)
        # A preference loss is of pairs, not tokens: exp() of it is no perplexity (the metrics row keeps its
        # documented exp(eval_loss); the summary, text and JSON alike, says none).
        ppl = evals[-1].eval_ppl if evals[-1].preference is None else None
        out.update(final_eval_loss=evals[-1].eval_loss, final_eval_ppl=ppl,
                   best_eval_loss=best.eval_loss, best_eval_step=best.step)
    if train[-1].preference is not None:
        out.update(final_reward_margin=train[-1].preference.reward_margin,
                   final_reward_accuracy=train[-1].preference.reward_accuracy)
    if evals and evals[-1].preference is not None:
        out.update(final_eval_reward_margin=evals[-1].preference.reward_margin,
                   final_eval_reward_accuracy=evals[-1].preference.reward_accuracy)
    return out


def format_summary(s: dict) -> str:
    mb = 1 << 20
    lines = [f"run {s['run']} (recipe {s['recipe']}): {s['steps']} steps, {s['tokens_seen'] or 0:,} tokens"
             + (f" so far: still running ({s['live']})" if s.get("live") else ""),
             f"  train loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}"]
    end = "so far" if s.get("live") else "at the end"
    if "final_eval_loss" in s:
        ppl = "" if s["final_eval_ppl"] is None else f" (perplexity {s['final_eval_ppl']:.2f})"
        lines.append(f"  eval loss {s['final_eval_loss']:.4f}{ppl} {end}; best "
                     f"{s['best_eval_loss']:.4f} at step {s['best_eval_step']}")
    if "final_reward_margin" in s:
        held = (f"; held out: margin {s['final_eval_reward_margin']:.4f}, accuracy "
                f"{s['final_eval_reward_accuracy']:.3f}" if "final_eval_reward_margin" in s else "")
        lines.append(f"  reward margin {s['final_reward_margin']:.4f}, accuracy "
                     f"{s['final_reward_accuracy']:.3f} {end} (train){held}")
    lines.append(f"  throughput {s['tokens_per_s_median']:,.0f} tokens/s ({s['tokens_per_s_per_rank_median']:,.0f} per "
                 f"rank), {s['step_time_s_median']:.3f} s per step (medians)"
                 + (f", MFU {100 * s['mfu_median']:.1f}%" if "mfu_median" in s else ""))
    lines.append("  peak memory per rank: " + ", ".join(f"{b / mb:,.0f} MB" for b in s["peak_memory_bytes_per_rank"]))
    return "\n".join(lines)


def plot(run_dir: Path) -> Path | None:
    """Write <run>/loss_curve.png; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    layout = RunLayout.at(run_dir)
    rows = read_metrics(layout.metrics_file)
    train = [r for r in rows if isinstance(r, TrainRow)]
    evals = [r for r in rows if isinstance(r, EvalRow)]
    preference = train[-1].preference is not None
    fig, axes = plt.subplots(1, 3 if preference else 1, figsize=(15 if preference else 7, 4), dpi=120, squeeze=False)
    ax = axes[0, 0]
    ax.plot([r.step for r in train], [r.loss for r in train], label="train loss", linewidth=1.5)
    if evals:
        ax.plot([r.step for r in evals], [r.eval_loss for r in evals], "o-", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean per pair)" if preference else "loss (mean per token)")
    ax.set_title(Path(run_dir).name)
    ax.grid(alpha=0.3)
    ax.legend()
    if preference:  # what preference tuning moves: the margin between the answers, and how often it is right
        held = [r for r in evals if r.preference is not None]
        for ax, key, label in ((axes[0, 1], "reward_margin", "reward margin (chosen - rejected)"),
                               (axes[0, 2], "reward_accuracy", "reward accuracy (chosen above rejected)")):
            ax.plot([r.step for r in train if r.preference], [getattr(r.preference, key) for r in train
                                                              if r.preference], label="train", linewidth=1.5)
            if held:
                ax.plot([r.step for r in held], [getattr(r.preference, key) for r in held], "o-", label="held out")
            ax.set_xlabel("optimizer step")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    out = layout.loss_curve
    write_with(out, lambda temporary: fig.savefig(temporary, format="png"))  # a kill leaves no half PNG
    plt.close(fig)
    return out
