"""`accel-fsdp data prepare` and `data show`: build a recipe's tokenized data ahead of a run, and look inside it.

`prepare` builds exactly the cache a run of the recipe would build (data/prepare.py; the same keys, so the run reads
it without tokenizing again) and reports each source: rows, tokens, truncation, packing efficiency, bytes on disk
per token, time. `show` decodes the first training sequences in the order the run reads them, marking the tokens
that carry a loss, and draws each source's histogram of example lengths.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from accel_fsdp.data.prepare import prepare_data
from accel_fsdp.data.sampler import total_steps
from accel_fsdp.errors import Problem, UserError
from accel_fsdp.files import write_with
from accel_fsdp.model.tokenizer import build_tokenizer


def prepare(recipe, tokenizer=None):
    """Build (or find, checked) every source's tables, the way a run does (data/prepare.py `prepare_data`); return the
    prepared data."""
    return prepare_data(recipe, tokenizer or build_tokenizer(recipe))


def prepare_report(recipe, data) -> str:
    lines = []
    weights = [s.weight for s in data.sources]
    total = sum(weights)
    sampler = data.sampler(recipe.training, world_size=1, rank=0)
    steps = total_steps(recipe, len(data))
    epochs = sampler.epochs(steps, data.mean_costs())
    for source, w, e in zip(data.sources, weights, epochs):
        s = source.stats
        size = sum(p.stat().st_size for p in source.folder.rglob("*") if p.is_file())
        tokens = s.train_tokens + (int(source.eval.meta["tokens"]) if source.eval is not None else 0)
        per_token = size / max(1, tokens)
        took = (f"tokenized in {s.seconds:.1f}s ({tokens / max(s.seconds, 1e-9):,.0f} tokens/s)" if source.built
                else "already in the cache")
        lines.append(f"{source.name} ({source.config.format}, {source.config.path}): {s.summary()}")
        lines.append(f"    {size / 2**20:,.1f} MiB on disk, {per_token:.2f} bytes per token; {took}; {source.folder}")
        if len(data.sources) > 1:
            lines.append(f"    weight {w / total:.2f} of the mixture by {data.mix_by}: about {e:.2f} epochs of it in "
                         f"{steps:,} steps")
        lines += [f"    warning: {text}" for text in s.warnings(recipe.data.seq_len)]
    return "\n".join(lines)


def show(recipe, *, sequences: int, color: bool, plot: Path | None = None) -> str:
    """The first `sequences` training sequences in the order a run reads them (step 0 on), decoded, with the tokens
    that carry a loss marked; optionally each source's histogram of example lengths drawn into `plot`."""
    if plot is not None:
        check_plot_path(plot)
    tokenizer = build_tokenizer(recipe)
    data = prepare(recipe, tokenizer)
    sampler = data.sampler(recipe.training, world_size=1, rank=0)
    out, step = [], 0
    while len(out) < sequences:
        for slot, unit in enumerate(sampler.global_sequences(step)):
            if len(out) >= sequences:
                break
            source, j = data.split(unit)
            out.extend(_describe(tokenizer, data, unit, step, slot, source, j, color))
        step += 1
    if plot is not None:
        draw_lengths(data, recipe.data.seq_len, plot)
        out.append(f"example lengths of each source: {plot}")
    return "\n\n".join(out)


def _describe(tokenizer, data, unit, step, slot, source, j, color) -> list[str]:
    """A unit's sequences, decoded: one, or a preference pair's chosen and rejected."""
    name = data.sources[source].name
    seqs = data.sequences(unit)
    out = []
    for k, s in enumerate(seqs):
        carries = s.labels != -100
        documents = int((s.positions == 0).sum())
        what = f"pair {j:,} {('chosen', 'rejected')[k]}" if len(seqs) == 2 else f"sequence {j:,}"
        head = (f"step {step} slot {slot}: {name} {what} ({len(s)} tokens, {int(carries.sum())} with a loss, "
                f"{documents} document{'s' if documents != 1 else ''})")
        out.append(head + "\n" + mark(tokenizer, s.ids, carries, s.positions, color))
    return out


def check_plot_path(path: Path) -> None:
    """Before any work: a file name whose suffix names a format matplotlib writes (its own list), not a folder."""
    if path.is_dir():
        raise UserError(Problem("--plot", f"{path} is a folder", f"name a file in it, e.g. {path / 'lengths.png'}"))
    _pyplot()
    from matplotlib.backend_bases import FigureCanvasBase

    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if path.suffix.lower().lstrip(".") not in formats:
        raise UserError(Problem("--plot", f"{path}: the suffix does not name an image format",
                                f"end the name with one of {', '.join('.' + f for f in formats)}"))


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError(Problem("--plot", "drawing needs matplotlib, which is not installed",
                                'pip install "accel-fsdp[plot]"')) from None
    return plt


LOSS_OPEN, LOSS_CLOSE, DOCUMENT = "\u00ab", "\u00bb", " \u2016 "
"""Without color: «text that carries a loss»; ‖ where a document starts."""


def mark(tokenizer, ids: np.ndarray, carries: np.ndarray, positions: np.ndarray, color: bool) -> str:
    """Decoded text, runs of loss-carrying tokens marked (green, or «...»), document starts shown as ‖."""
    import click

    parts = []
    start = 0
    n = len(ids)
    for i in range(1, n + 1):
        if i == n or carries[i] != carries[start] or positions[i] == 0:
            text = tokenizer.decode(ids[start:i].tolist(), skip_special_tokens=False)
            if carries[start]:
                text = click.style(text, fg="green", bold=True) if color else f"{LOSS_OPEN}{text}{LOSS_CLOSE}"
            if start and positions[start] == 0:
                parts.append(DOCUMENT)
            parts.append(text)
            start = i
    return "".join(parts)


def draw_lengths(data, seq_len: int, path: Path) -> None:
    """One histogram of example lengths (tokens, after truncation) per source, with seq_len marked."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(data.sources), 1, figsize=(8, 2.6 * len(data.sources)), squeeze=False)
    for ax, source in zip(axes[:, 0], data.sources):
        table = source.train
        starts = np.asarray(table.documents, dtype=np.int64)
        lengths = np.diff(np.concatenate([starts, [table.meta["tokens"]]]))
        ax.hist(lengths, bins=60, color="#4878a8")
        ax.axvline(seq_len, color="#c44e52", linestyle="--", label=f"seq_len {seq_len}")
        ax.set_title(f"{source.name}: {len(lengths):,} examples, median {int(np.median(lengths))} tokens")
        ax.set_xlabel("tokens per example")
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    # Whole or not at all; the format from the user's name, as savefig would take it (the temporary has no suffix).
    write_with(path, lambda temporary: fig.savefig(temporary, dpi=110, format=path.suffix[1:].lower() or "png"))
    plt.close(fig)
