"""The checks of a recipe that need no machine: the range of each key and the relations between keys, each
problem with its dotted key, value and fix (`Recipe.where` locates it: file and line, or --set). The recipe calls them
when it is loaded; what depends on the machine, the model or the data is preflight.py's.

This module must never touch the disk, the hub or torch.
"""

from __future__ import annotations

import re

from accel_fsdp.config.methods import METHODS, PAIR_METHODS, method_problems
from accel_fsdp.errors import Problem

BPE_VOCAB_MIN, BPE_VOCAB_MAX = 300, 1_000_000
"""The vocabulary sizes a trained byte-level BPE tokenizer takes (model.tokenizer: bpe:N, `tokenizer train
--vocab-size N`): its 256 bytes and special tokens, up to what any model here would embed."""
SEED_MAX, SEED_MAX_TEXT = 2**32 - 1, "2**32 - 1"
"""The largest seed a run or `generate --seed` takes: NumPy's seed range (torch.manual_seed takes more, and raises
past 2**64 - 1)."""

TRACKERS = ("tensorboard", "wandb")
ATTENTION_KERNELS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
MAX_STEPS = 10**9
"""More optimizer steps than any run takes (a billion steps of a second each are 32 years): a larger max_steps is
a typo, or an exponent where a count was meant."""
MAX_LR = 1.0
"""Above this a learning rate is a typo (3e3 for 3e-3): AdamW's update moves each weight by about lr per step."""


class _Found(list):
    """The problems found in one recipe. `need(condition, key, message, fix)` adds one where the condition fails;
    `need_range(condition, key, message, wanted, then)` adds a range problem whose fix is always the whole sentence
    "set KEY to WANTED[, THEN]" (e.g. "set training.max_steps to at least 1, or null"), so no fix is a fragment."""

    def __init__(self, recipe):
        super().__init__()
        self.where = recipe.where

    def need(self, cond: bool, key: str, msg: str, fix: str) -> None:
        if not cond:
            self.append(Problem(self.where(key), msg, fix))

    def need_range(self, cond: bool, key: str, msg: str, wanted: str, then: str = "") -> None:
        self.need(cond, key, msg, range_fix(key, wanted, then))


def range_fix(key: str, wanted: str, then: str = "") -> str:
    """The fix of a value out of its range, as one sentence: "set KEY to WANTED, THEN"."""
    return f"set {key} to {wanted}" + (f", {then}" if then else "")


def check_recipe(r) -> list[Problem]:
    """Ranges and relations between keys that need no machine to check, section by section."""
    return (_model_problems(r) + source_problems(r) + _data_problems(r) + _training_problems(r)
            + _saving_and_logging_problems(r) + _lora_problems(r))


def _model_problems(r) -> list[Problem]:
    """The run's name (a folder name), where the model comes from, its tokenizer and attention kernel."""
    p = _Found(r)
    need = p.need
    m = r.model
    need(not r.name or (re.fullmatch(r"[^/\\\x00-\x1f]+", r.name) is not None and not r.name.startswith(".")), "name",
         f"{r.name!r} cannot be a folder name (runs/<name>): it has a slash, a control character or a leading dot",
         "use letters, digits, '-', '_' (and '.' after the first character)")
    need(bool(m.name_or_path) != bool(m.architecture), "model.name_or_path",
         f"set exactly one of model.name_or_path ({m.name_or_path!r}) and model.architecture ({m.architecture!r})",
         "name_or_path loads pretrained weights; architecture builds the model from scratch")
    if m.tokenizer and m.tokenizer.startswith("bpe:"):
        n = m.tokenizer.removeprefix("bpe:")
        need(n.isdigit() and BPE_VOCAB_MIN <= int(n) <= BPE_VOCAB_MAX, "model.tokenizer", f"{m.tokenizer!r}: bpe:N "
             f"needs a vocabulary size N between {BPE_VOCAB_MIN} and {BPE_VOCAB_MAX:,}",
             "e.g. bpe:8192 (byte-level BPE trained on data.path)")
    attn = m.attn_implementation
    need(attn is None or attn in ATTENTION_KERNELS or "/" in attn, "model.attn_implementation",
         f"{attn!r} is not an attention kernel", f"use one of {', '.join(ATTENTION_KERNELS)} (or a hub kernel such as "
         "kernels-community/flash-attn)")
    return p


def _data_problems(r) -> list[Problem]:
    """Sequence length, the held-out share, row limits, encoder threads."""
    p = _Found(r)
    d = r.data
    rng = p.need_range
    rng(d.seq_len >= 8, "data.seq_len", f"{d.seq_len} is too short", "at least 8", "typically 512 to 4096")
    rng(0 <= d.eval_fraction < 0.5, "data.eval_fraction", f"{d.eval_fraction} is outside [0, 0.5)",
        "a small share such as 0.05", "or 0 for no evaluation")
    rng(d.max_rows is None or d.max_rows > 0, "data.max_rows", f"{d.max_rows} must be positive", "at least 1",
        "or null to read every row")
    rng(d.num_proc is None or d.num_proc >= 1, "data.num_proc", f"{d.num_proc} must be at least 1", "at least 1",
        "or null for the cores this process may use")
    return p


def _training_problems(r) -> list[Problem]:
    """The batch arithmetic, the length of the run, the schedule and the optimizer."""
    p = _Found(r)
    need = p.need
    t = r.training
    rng = p.need_range
    rng(t.micro_batch_size >= 1, "training.micro_batch_size", f"{t.micro_batch_size} must be at least 1",
        "at least 1", "the sequences (preference pairs) per rank per micro-step, e.g. 1 to 16")
    rng(t.global_batch_size >= 1, "training.global_batch_size", f"{t.global_batch_size} must be at least 1",
        "at least 1", "the sequences (preference pairs) per optimizer step over all ranks")
    if t.micro_batch_size >= 1 and t.global_batch_size >= 1:
        need(t.splits_evenly(1), "training.global_batch_size",
             f"{t.global_batch_size} is not a multiple of training.micro_batch_size = {t.micro_batch_size}",
             f"use a global batch that is a multiple of micro_batch_size x processes (e.g. "
             f"{_multiples_by_processes(t.global_batch_size, t.micro_batch_size)}), or a smaller micro batch")
    if t.max_steps is not None and t.epochs is not None:
        p.append(Problem(r.where("training.max_steps"),
                         f"both max_steps ({t.max_steps}) and epochs ({t.epochs}) are set",
                         "keep one of them (on the command line: --set training.max_steps=null)"))
    rng(t.max_steps is None or t.max_steps >= 1, "training.max_steps", f"{t.max_steps} must be at least 1",
        "at least 1", "or null")
    rng(t.max_steps is None or t.max_steps <= MAX_STEPS, "training.max_steps", f"{t.max_steps or 0:,} steps would "
        f"outlast any machine (at most {MAX_STEPS:,})", "the number of optimizer steps to run",
        "or use training.epochs")
    rng(t.epochs is None or t.epochs > 0, "training.epochs", f"{t.epochs} must be positive", "a positive number",
        "e.g. 1 or 0.5")
    rng(t.lr > 0, "training.lr", f"{t.lr} must be positive", "a positive number",
        "typically 1e-5 to 3e-4 for fine-tuning")
    rng(t.lr <= MAX_LR, "training.lr", f"{t.lr:g} is above {MAX_LR:g}: AdamW moves every weight by about the "
        "learning rate each step, so the weights would be noise after one step", f"at most {MAX_LR:g}",
        "typically 1e-5 to 3e-4 for fine-tuning (3e-3 for a tiny model from scratch)")
    rng(0 <= t.min_lr_ratio <= 1, "training.min_lr_ratio", f"{t.min_lr_ratio} is outside [0, 1]",
        "a share between 0 and 1", "e.g. 0.1")
    rng(t.warmup_steps >= 0, "training.warmup_steps", f"{t.warmup_steps} must be 0 or more", "0 or more",
        "e.g. 100")
    if t.max_steps is not None and t.max_steps >= 1 and t.warmup_steps > t.max_steps:
        p.append(Problem(r.where("training.warmup_steps"),
                         f"{t.warmup_steps} warm-up steps exceed training.max_steps = {t.max_steps}",
                         range_fix("training.warmup_steps", f"at most {t.max_steps}",
                                   f"e.g. {t.max_steps // 10} (a tenth of the run)")))
    rng(t.weight_decay >= 0, "training.weight_decay", f"{t.weight_decay} must be 0 or more", "0 or more", "e.g. 0.1")
    # AdamW multiplies every weight by 1 - lr x weight_decay at each step (torch/optim/adamw.py): at 1 or more
    # the weights vanish or flip sign.
    rng(t.weight_decay < 0 or not 0 < t.lr <= MAX_LR or t.lr * t.weight_decay < 1, "training.weight_decay",
        f"{t.weight_decay:g} x training.lr {t.lr:g} is {t.lr * t.weight_decay:g}: AdamW multiplies every weight by "
        "1 minus that at each step", f"below 1 / training.lr = {1 / t.lr if t.lr > 0 else 0:g}",
        "typically 0.01 to 0.1")
    rng(0 <= t.adam_beta1 < 1, "training.adam_beta1", f"{t.adam_beta1} is outside [0, 1)", "at least 0 and below 1",
        "e.g. 0.9")
    rng(0 <= t.adam_beta2 < 1, "training.adam_beta2", f"{t.adam_beta2} is outside [0, 1)", "at least 0 and below 1",
        "e.g. 0.95")
    rng(0 < t.adam_eps < 1, "training.adam_eps", f"{t.adam_eps:g} is outside (0, 1): AdamW divides each update by "
        "the gradient's root mean square plus eps, so a large eps stops training", "a positive number below 1",
        "e.g. 1e-8")
    rng(t.max_grad_norm is None or t.max_grad_norm > 0, "training.max_grad_norm",
        f"{t.max_grad_norm} must be positive", "a positive number", "e.g. 1.0, or null to disable clipping")
    rng(0 <= t.seed <= SEED_MAX, "training.seed", f"{t.seed} is outside [0, {SEED_MAX_TEXT}]",
        f"a non-negative integer below {SEED_MAX + 1}", "NumPy's seed range")
    rng(t.eval_every_steps is None or t.eval_every_steps >= 1, "training.eval_every_steps",
        f"{t.eval_every_steps} must be at least 1", "at least 1", "or null to evaluate at the end only")
    rng(t.eval_max_batches is None or t.eval_max_batches >= 1, "training.eval_max_batches",
        f"{t.eval_max_batches} must be at least 1", "at least 1", "or null for the whole held-out split")
    rng(t.loss_chunk_tokens is None or t.loss_chunk_tokens >= 1, "training.loss_chunk_tokens",
        f"{t.loss_chunk_tokens} must be at least 1", "at least 1", "e.g. 512, or null for the planner's pick")
    return p


def _saving_and_logging_problems(r) -> list[Problem]:
    """Checkpoints, the preference loss's parameters, the collective timeout, logging."""
    p = _Found(r)
    need = p.need
    c, lg = r.checkpoint, r.logging
    rng = p.need_range
    rng(c.every_steps is None or c.every_steps >= 1, "checkpoint.every_steps",
        f"{c.every_steps} must be at least 1", "at least 1", "or null to save at the end only")
    rng(c.keep_last is None or c.keep_last >= 1, "checkpoint.keep_last", f"{c.keep_last} must be at least 1",
        "at least 1", "or null to keep every checkpoint")
    rng(bool(c.dir), "checkpoint.dir", "is empty", "a folder name", "e.g. checkpoints")
    pref = r.preference
    rng(pref.beta is None or pref.beta > 0, "preference.beta", f"{pref.beta} must be positive", "a positive number",
        "DPO: 0.01 to 0.5 (default 0.1); SimPO: 2 to 10 (default 2.0)")
    rng(0 <= pref.label_smoothing < 0.5, "preference.label_smoothing", f"{pref.label_smoothing} is outside [0, 0.5)",
        "at least 0 and below 0.5", "0 trusts every pair; conservative DPO uses 0.1 to 0.3")
    rng(pref.gamma >= 0, "preference.gamma", f"{pref.gamma} must be 0 or more", "0 or more",
        "SimPO: about 0.5 x beta")
    rng(pref.lambda_ >= 0, "preference.lambda", f"{pref.lambda_} must be 0 or more", "0 or more",
        "ORPO: 0.05 to 1 (default 0.1)")
    p += method_problems(r)
    minutes = r.fsdp.collective_timeout_minutes
    rng(0.1 <= minutes <= 7 * 24 * 60, "fsdp.collective_timeout_minutes",
        f"{int(minutes) if float(minutes).is_integer() else minutes} is outside [0.1, 10080]: 6 seconds to a "
        "week", "minutes between 0.1 and 10080", "e.g. 60")
    rng(lg.every_steps >= 1, "logging.every_steps", f"{lg.every_steps} must be at least 1", "at least 1", "e.g. 10")
    rng(1 <= lg.sample_max_new_tokens <= 4096, "logging.sample_max_new_tokens",
        f"{lg.sample_max_new_tokens} is outside [1, 4096]", "between 1 and 4096", "e.g. 24")
    for tracker in lg.trackers:
        need(tracker in TRACKERS, "logging.trackers", f"unknown tracker {tracker!r}", f"use {', '.join(TRACKERS)}")
    return p


def _lora_problems(r) -> list[Problem]:
    """LoRA's rank, scale, dropout and targets, when it is enabled; a quantized base needs it."""
    p = _Found(r)
    need = p.need
    m = r.model
    lora = m.lora
    rng = p.need_range  # judged with LoRA off too: a recipe switched with --set model.lora.enabled keeps its values
    rng(lora.r >= 1, "model.lora.r", f"{lora.r} must be at least 1", "at least 1", "e.g. 8 or 16")
    rng(lora.alpha >= 1, "model.lora.alpha", f"{lora.alpha} must be at least 1", "at least 1", "commonly 2 x r")
    rng(0 <= lora.dropout < 1, "model.lora.dropout", f"{lora.dropout} is outside [0, 1)",
        "at least 0 and below 1", "e.g. 0.05")
    rng(bool(lora.target_modules) or not lora.enabled, "model.lora.target_modules", "is empty",
        "the names of linear layers", "e.g. [q_proj, v_proj]")
    need(not m.quantize or lora.enabled, "model.quantize", f"{m.quantize} holds the frozen base in 4 bits, and without "
         "LoRA every weight trains (a 4-bit weight cannot)", "set model.lora.enabled: true (QLoRA), or leave "
         "model.quantize out")
    return p


def source_problems(r) -> list[Problem]:
    """data.path or data.sources, and each source: a path, a positive weight, a name of its own."""
    d, where = r.data, r.where
    if d.path and d.sources:
        return [Problem(where("data.sources"), f"both data.path ({d.path!r}) and data.sources "
                        f"({len(d.sources)} entries) are set", "keep data.path for one source, or move it into "
                        "data.sources as an entry of the mixture")]
    if not d.path and not d.sources:
        return [Problem(where("data.path"), "no data given", "set data.path to a .jsonl/.json/.csv/.parquet/.txt "
                        "file, hub:<dataset>, or builtin:quickstart (or data.sources for a mixture)")]
    p: list[Problem] = []
    resolved = d.resolved_sources()
    for i, (entry, source) in enumerate(zip(d.sources or [None], resolved)):
        key = f"data.sources.{i}" if entry is not None else "data"
        label = f" (source {source.name!r})" if entry is not None else ""
        if entry is not None and not entry.path:
            p.append(Problem(where(key), f"source {i} has no path", "give each entry of data.sources a path"))
        if not (source.weight > 0):
            p.append(Problem(where(f"{key}.weight"), f"{source.weight}{label} must be positive",
                             "weights are relative shares, e.g. 0.7 and 0.3 (a source you do not want: remove it)"))
        if source.max_rows is not None and source.max_rows <= 0:
            p.append(Problem(where(f"{key}.max_rows"), f"{source.max_rows}{label} must be positive",
                             range_fix(f"{key}.max_rows", "at least 1", "or null to read every row")))
        if source.format == "chat" and d.packing:
            p.append(Problem(where("data.packing"), f"packing is not supported for chat data{label}",
                             "set data.packing to false (chat sequences are padded)"))
        method = r.training.method
        fmt_key = f"{key}.format" if entry is not None and entry.format is not None else "data.format"
        if METHODS[method].pairs and source.format != "preference":
            p.append(Problem(where(fmt_key), f"{source.format}{label}: training.method {method} trains on preference "
                             "pairs", "use data with a prompt, a chosen and a rejected answer (format: preference), "
                             "or training.method: sft"))
        if not METHODS[method].pairs and source.format == "preference":
            p.append(Problem(where(fmt_key), f"preference pairs{label} need a preference method, and "
                             f"training.method is {method}", f"set training.method to {', '.join(PAIR_METHODS[:-1])} "
                             f"or {PAIR_METHODS[-1]} (or, to fine-tune "
                             "on the chosen answers, make them instruction rows)"))
        if source.format == "preference" and d.packing:
            p.append(Problem(where("data.packing"), f"preference pairs{label} are not packed (a pair's two answers "
                             "go through the model side by side)", "set data.packing to false, or leave it out"))
    names = [s.name for s in resolved]
    for name in sorted({n for n in names if names.count(n) > 1}):
        numbers = [i for i, n in enumerate(names) if n == name]
        p.append(Problem(where(f"data.sources.{numbers[1]}.name"), f"sources {', '.join(map(str, numbers))} are all "
                         f"named {name!r}", "give each source a name of its own (name: ...)"))
    return p


def _multiples_by_processes(global_batch: int, micro: int, processes=(1, 2, 8)) -> str:
    """The global batches nearest above `global_batch` that split on 1, 2 and 8 processes: a recipe knows no process
    count, and an example for one alone ("35" for micro 5) is refused again on another ("not divisible by 5 x 2")."""
    by_batch: dict[int, list[int]] = {}
    for n in processes:
        by_batch.setdefault(_round_up(global_batch, micro * n), []).append(n)
    return ", ".join(f"{batch} on {' or '.join(map(str, ns))} process{'es' if ns != [1] else ''}"
                     for batch, ns in by_batch.items())


def _round_up(x: int, m: int) -> int:
    return ((x + m - 1) // m) * m
