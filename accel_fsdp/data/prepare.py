"""Training data: read rows, check them, tokenize with loss masks, pack, split, and hand out global batches.

Flow: `read_rows` (local file, hub dataset or built-in data) -> `check_rows` (fields, roles) -> deterministic
held-out split on raw rows -> `tokenize` (text / instruction / chat; labels are -100 on prompt and padding
tokens) -> packing into seq_len rows (EOS between documents, position ids restarting per document) -> saved
once in the cache, keyed by everything that affects it, built by the main process first.

Every row holds equal-length lists input_ids, labels, position_ids, plus its length (non-padding tokens) and
n_labels (tokens that carry a loss), so batch statistics need no communication. Position ids restart at 0 for each
document (and for trailing padding), which transformers turns into a block-diagonal causal mask when no
attention mask is passed, so packed documents do not attend to each other.

Batches of these rows are made in batches.py. This module imports no torch (`recipe validate` uses it).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from accel_fsdp.data.synthetic import BUILTIN_DATA, write_builtin
from accel_fsdp.errors import Problem, UserError
from accel_fsdp.layout import cache_dir

IGNORE_INDEX = -100
CHAT_ROLES = ("system", "user", "assistant")
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
_BATCH = 2000  # rows per tokenization/packing batch; only the last row of each batch may be partly padding


@dataclass
class DataStats:
    rows_read: int = 0
    empty_rows: int = 0
    train_rows: int = 0
    eval_rows: int = 0
    train_sequences: int = 0
    eval_sequences: int = 0
    train_tokens: int = 0
    """Non-padding tokens of the training sequences."""
    label_tokens: int = 0
    """Training tokens that carry a loss (not masked)."""
    truncated: int = 0
    """Examples cut at seq_len (their tail is lost); reported, never silently dropped."""
    no_label_rows: int = 0
    """Examples with no loss-carrying token left after truncation."""
    examples: int = 0
    """Training examples tokenized (non-empty rows)."""
    packing_efficiency: float = 1.0
    """Share of non-padding tokens in the training sequences."""
    packed: bool = False

    TRUNCATION_WARNING = 0.05

    def warnings(self, recipe) -> list[str]:
        """What the user should know before training on this data."""
        out = []
        share = self.no_label_rows / max(1, self.examples)
        if share >= self.TRUNCATION_WARNING:
            out.append(f"{100 * share:.0f}% of the training examples ({self.no_label_rows:,} of {self.examples:,}) "
                       f"lost all their loss-carrying tokens to truncation at data.seq_len = {recipe.data.seq_len}: "
                       "they are trained on nothing (raise data.seq_len, or shorten the prompts)")
        return out

    def summary(self) -> str:
        parts = [f"{self.rows_read:,} rows read", f"{self.train_rows:,} train / {self.eval_rows:,} held out",
                 f"{self.train_sequences:,} training sequences of up to seq_len tokens",
                 f"{self.train_tokens:,} tokens ({self.label_tokens:,} with loss)"]
        if self.packed:
            parts.append(f"packing efficiency {self.packing_efficiency:.4f}")
        if self.truncated:
            parts.append(f"{self.truncated:,} examples longer than seq_len were truncated")
        if self.no_label_rows:
            parts.append(f"{self.no_label_rows:,} examples have no response tokens left after truncation")
        if self.empty_rows:
            parts.append(f"{self.empty_rows:,} empty rows skipped")
        return "; ".join(parts)


# ------------------------------------------------------------------------------------------------- reading


def resolve_data_path(recipe) -> tuple[str, str | None]:
    """(kind, local path) where kind is builtin, hub or file."""
    path = recipe.data.path
    if path.startswith("builtin:"):

        name = path.split(":", 1)[1]
        if name not in BUILTIN_DATA:
            raise UserError(Problem(recipe.where("data.path"), f"no built-in dataset {name!r}",
                                    f"use one of {', '.join('builtin:' + n for n in BUILTIN_DATA)}"))
        return "builtin", None
    if path.startswith("hub:"):
        return "hub", None
    p = Path(path).expanduser()
    if not p.is_absolute() and recipe.source and not p.exists():
        # Relative to the recipe file when not found relative to the working directory.
        alt = Path(recipe.source).parent / p
        if alt.exists():
            p = alt
    if not p.exists() and p.suffix.lower() not in _FORMATS and re.fullmatch(r"[\w.-]+/[\w.-]+", path):
        return "hub", None  # owner/name with no such local file: a hub dataset
    return "file", str(p)


def read_rows(recipe, *, max_rows: int | None = None):
    """The raw rows as a `datasets.Dataset`; one clear `UserError` for a missing, empty or unreadable source."""
    import datasets

    datasets.disable_progress_bars()
    d = recipe.data
    kind, local = resolve_data_path(recipe)
    where = recipe.where("data.path")
    if kind == "builtin":

        local = str(write_builtin(d.path.split(":", 1)[1]))
        builder = "json"
    elif kind == "hub":
        name = d.path.removeprefix("hub:")
        try:
            ds = datasets.load_dataset(name, d.hub_config, split=d.split)
        except Exception as e:  # the hub raises many types; all mean "could not get it"
            raise UserError(Problem(where, f"cannot load hub dataset {name!r} (config {d.hub_config!r}, split "
                                    f"{d.split!r}): {str(e).splitlines()[0][:200]}",
                                    "check the name, data.hub_config and data.split, and your network")) from None
        return _limit(ds, max_rows or d.max_rows)
    else:
        p = Path(local)
        if not p.exists():
            raise UserError(Problem(where, f"data file {local!r} not found",
                                    "check the path (relative paths start at the working directory or the recipe's "
                                    "folder), or use builtin:quickstart"))
        if p.is_dir():
            raise UserError(Problem(where, f"{local!r} is a folder", "point data.path at one file"))
        builder = _FORMATS.get(p.suffix.lower())
        if builder is None:
            raise UserError(Problem(where, f"unsupported file type {p.suffix!r}",
                                    f"use one of {', '.join(_FORMATS)}"))
        if p.stat().st_size == 0 or (builder != "parquet" and not p.read_text(errors="replace").strip()):
            raise UserError(Problem(where, f"data file {local!r} is empty", "put training rows in it"))
        if builder != "parquet":
            problem = not_utf8(p)
            if problem:
                raise UserError(Problem(f"{where} ({local})", problem, "save the file as UTF-8, e.g. iconv -f "
                                        "latin1 -t utf-8 FILE > FILE.utf8 (or -f utf-16)"))
    kwargs: dict[str, Any] = {}
    if builder == "text":
        kwargs["sample_by"] = "paragraph"
    try:
        with _library_logs_silenced():  # datasets logs its own error line before raising: one message per mistake
            ds = datasets.load_dataset(builder, data_files=local, split="train", **kwargs)
    except Exception as e:
        detail = _find_bad_json_line(local) if builder == "json" else None
        msg = detail or f"cannot read it as {builder}: {_root_cause(e)}"
        fix = {"json": "fix the file: one JSON object per line (.jsonl), or one JSON list of objects (.json)",
               "csv": "fix the file: a header line, then the same number of comma-separated fields on every line "
                      "(quote fields that contain commas)",
               "parquet": "write the file again (it is not a readable Parquet file)"}.get(builder, "fix the file")
        raise UserError(Problem(f"{where} ({local})", msg, fix)) from None
    if len(ds) == 0:
        raise UserError(Problem(where, f"data file {local!r} has no rows", "put training rows in it"))
    return _limit(ds, max_rows or d.max_rows)


def not_utf8(path: Path) -> str | None:
    """Where a text file stops being UTF-8 ("line 3, byte 0xe9 at column 7: the file is probably Latin-1"), or None."""
    with open(path, "rb") as f:
        head = f.read(4)
        if head.startswith((b"\xff\xfe", b"\xfe\xff")):
            return "the file is UTF-16 (it starts with a UTF-16 byte-order mark), not UTF-8"
        f.seek(0)
        for number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                byte = line[e.start]
                guess = "UTF-16" if b"\x00" in line else "Latin-1 or Windows-1252"
                return (f"line {number} is not UTF-8 (byte 0x{byte:02x} at column {e.start + 1}); the file is "
                        f"probably {guess}")
    return None


class _library_logs_silenced:
    """datasets logs an ERROR line of its own before it raises; ours says the same thing with the fix."""
    def __enter__(self):
        import logging

        self.logger = logging.getLogger("datasets")
        self.level = self.logger.level
        self.logger.setLevel(logging.CRITICAL)

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)


def too_little_data(recipe, sequences: int) -> Problem | None:
    """One optimizer step needs a global batch of training sequences; fewer, and nothing would train."""
    t = recipe.training
    if sequences >= t.global_batch_size:
        return None
    return Problem(recipe.where("training.global_batch_size"), f"{t.global_batch_size} rows per optimizer step, but "
                   f"the data has only {sequences:,} training sequences (after packing and the held-out split)",
                   f"use a global batch of at most {max(1, sequences)} or more data (data.path, data.max_rows)")


def _limit(ds, n):
    return ds.select(range(min(n, len(ds)))) if n else ds


def _root_cause(e: BaseException) -> str:
    while e.__cause__ is not None:
        e = e.__cause__
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


def _find_bad_json_line(path: str) -> str | None:
    with open(path, errors="replace") as f:
        text = f.read()
    if path.endswith(".json") and text.lstrip().startswith("["):
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            return f"line {e.lineno}: invalid JSON ({e.msg})"
        return None
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            return f"line {i}: invalid JSON ({e.msg})"
        if not isinstance(value, dict):
            return f"line {i}: expected a JSON object per line, found {type(value).__name__}"
    return None


def check_rows(recipe, ds) -> list[Problem]:
    """Fields present and well-formed for the recipe's format. Problems name the file, row and field."""
    d = recipe.data
    where = recipe.where("data.path")
    cols = set(ds.column_names)
    row_name = "line" if d.path.endswith(".jsonl") else "row"
    p: list[Problem] = []

    def need_column(key, col):
        if col not in cols:
            p.append(Problem(recipe.where(key), f"{d.path} has no field {col!r} (its fields: "
                             f"{', '.join(sorted(cols))})", f"set {key} to one of them"))
            return False
        return True

    if d.format == "text":
        if need_column("data.text_field", d.text_field):
            bad = _first(ds[d.text_field], lambda v: v is not None and not isinstance(v, str))
            if bad is not None:
                p.append(Problem(where, f"{row_name} {bad + 1}: field {d.text_field!r} is not text", "use strings"))
    elif d.format == "instruction":
        ok = need_column("data.instruction_field", d.instruction_field)
        ok = need_column("data.output_field", d.output_field) and ok
        if ok:
            for col in (d.instruction_field, d.output_field):
                bad = _first(ds[col], lambda v: not isinstance(v, str) or not v.strip())
                if bad is not None:
                    value = ds[col][bad]
                    what = "is missing or empty" if value is None or (isinstance(value, str) and not value.strip()) \
                        else f"is not text ({type(value).__name__} {str(value)[:40]!r})"
                    p.append(Problem(where, f"{row_name} {bad + 1}: field {col!r} {what}",
                                     "every row needs an instruction and an output"))
    else:
        if need_column("data.messages_field", d.messages_field):
            for i, messages in enumerate(ds[d.messages_field]):
                problem = _check_messages(messages)
                if problem:
                    p.append(Problem(where, f"{row_name} {i + 1}: {problem}",
                                     f"each message needs a role ({', '.join(CHAT_ROLES)}) and text content"))
                    break
    return p


def check_tokenizer(recipe, tokenizer) -> list[Problem]:
    if recipe.data.format == "chat" and not tokenizer.chat_template:
        return [Problem(recipe.where("data.format"), "chat data needs a tokenizer with a chat template, and "
                        f"{recipe.model.tokenizer or recipe.model.name_or_path!r} has none",
                        "use an instruct/chat model's tokenizer (model.tokenizer), or format: instruction")]
    return []


def _check_messages(messages) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty list"
    has_assistant = False
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            return f"message {j + 1} is not a {{role, content}} object"
        if m["role"] not in CHAT_ROLES:
            return f"message {j + 1} has unknown role {m['role']!r}"
        if not isinstance(m["content"], str):
            return f"message {j + 1} content is not text"
        has_assistant |= m["role"] == "assistant"
    if not has_assistant:
        return "no assistant message, so nothing to learn"
    return None


def _first(values, bad) -> int | None:
    for i, v in enumerate(values):
        if bad(v):
            return i
    return None


# ---------------------------------------------------------------------------------------------- tokenizing


def tokenize_example(recipe, tokenizer, row: dict) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one raw row, untruncated. labels are -100 where no loss is taken."""
    d = recipe.data
    eos = tokenizer.eos_token_id
    if d.format == "text":
        ids = tokenizer(row[d.text_field] or "", add_special_tokens=True)["input_ids"]
        ids = ids + [eos] if eos is not None else ids
        return ids, list(ids)
    if d.format == "instruction":
        instruction, extra, output = row[d.instruction_field], row.get(d.input_field) or "", row[d.output_field]
        if tokenizer.chat_template:
            user = f"{instruction}\n\n{extra}" if extra else instruction
            messages = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
            return _chat_ids(tokenizer, messages)
        template = ALPACA_PROMPT_WITH_INPUT if extra else ALPACA_PROMPT
        prompt = template.format(instruction=instruction, input=extra)
        prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        answer_ids = tokenizer(output, add_special_tokens=False)["input_ids"] + ([eos] if eos is not None else [])
        return prompt_ids + answer_ids, [IGNORE_INDEX] * len(prompt_ids) + answer_ids
    return _chat_ids(tokenizer, row[d.messages_field])


def _chat_ids(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Render with the chat template; labels only on assistant turns (their content and end-of-turn tokens).

    The template is rendered once per assistant turn boundary to find the character span of each assistant
    reply, then the whole text is tokenized once and tokens are labelled by their character offsets. This works
    for any template and any tokenizer (BPE merges across boundaries included).
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)) if i else 0
        end = len(tokenizer.apply_chat_template(messages[: i + 1], tokenize=False))
        if not text.startswith(tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)):
            end = start + len(m["content"])  # templates that rewrite earlier turns: label the reply text only
        spans.append((start, end))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    labels = []
    for tok, (a, b) in zip(ids, enc["offset_mapping"]):
        inside = any(a >= s and b <= e and b > a for s, e in spans)
        labels.append(tok if inside else IGNORE_INDEX)
    return ids, labels


def _tokenize_batch(recipe, tokenizer, seq_len: int, pad_id: int, packing: bool, batch: dict) -> dict:
    """Tokenize one batch of raw rows into training sequences (packed or padded)."""
    n = len(next(iter(batch.values())))
    rows = [{k: batch[k][i] for k in batch} for i in range(n)]
    examples, truncated, no_label, empty = [], 0, 0, 0
    for row in rows:
        if recipe.data.format == "text" and not (row[recipe.data.text_field] or "").strip():
            empty += 1
            continue
        ids, labels = tokenize_example(recipe, tokenizer, row)
        if len(ids) > seq_len and not (packing and recipe.data.format == "text"):
            ids, labels = ids[:seq_len], labels[:seq_len]
            truncated += 1
        if all(x == IGNORE_INDEX for x in labels[1:]):
            no_label += 1
        examples.append((ids, labels))
    if packing and recipe.data.format == "text":
        seqs = _pack_stream(examples, seq_len)
    elif packing:
        seqs = _pack_bins(examples, seq_len)
    else:
        seqs = [[ex] for ex in examples]
    out = {"input_ids": [], "labels": [], "position_ids": [], "length": [], "n_truncated": [], "n_no_label": [],
           "n_empty": [], "n_labels": []}
    for k, seq in enumerate(seqs):
        ids, labels, pos = [], [], []
        for e_ids, e_labels in seq:
            ids += e_ids
            labels += e_labels
            pos += list(range(len(e_ids)))
        length = len(ids)
        if packing:  # packed rows are always full length; trailing padding is its own "document"
            pad = seq_len - length
            ids += [pad_id] * pad
            labels += [IGNORE_INDEX] * pad
            pos += list(range(pad))
        # A document's first token is predicted by nothing of its own: in a packed row the shift would make the
        # previous document's last token predict it. Masking it makes a packed row's loss the sum of its
        # documents' losses run alone, and rows can be concatenated (padding-free batches) safely.
        labels = [IGNORE_INDEX if p == 0 else y for p, y in zip(pos, labels)]
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["position_ids"].append(pos)
        out["length"].append(length)
        out["n_labels"].append(sum(1 for x in labels if x != IGNORE_INDEX))
        # Per-batch counters ride on the first row of the batch (datasets maps return rows, not totals).
        out["n_truncated"].append(truncated if k == 0 else 0)
        out["n_no_label"].append(no_label if k == 0 else 0)
        out["n_empty"].append(empty if k == 0 else 0)
    if not seqs:  # a batch of only empty rows still reports them
        for column in out:
            out[column].append([] if column in ("input_ids", "labels", "position_ids") else 0)
        out["n_empty"][-1] = empty
        out["length"][-1] = -1
    return out


def _pack_stream(examples, seq_len):
    """Concatenate documents (each ending in EOS) and cut into seq_len pieces: every token is kept."""
    seqs, current, used = [], [], 0
    for ids, labels in examples:
        while ids:
            take = min(len(ids), seq_len - used)
            current.append((ids[:take], labels[:take]))
            ids, labels = ids[take:], labels[take:]
            used += take
            if used == seq_len:
                seqs.append(current)
                current, used = [], 0
    if current:
        seqs.append(current)
    return seqs


def _pack_bins(examples, seq_len):
    """First-fit-decreasing bin packing that keeps each example whole (for prompt/response data)."""
    order = sorted(range(len(examples)), key=lambda i: (-len(examples[i][0]), i))
    bins: list[list[int]] = []
    space: list[int] = []
    for i in order:
        n = len(examples[i][0])
        for b, free in enumerate(space):
            if n <= free:
                bins[b].append(i)
                space[b] -= n
                break
        else:
            bins.append([i])
            space.append(seq_len - n)
    return [[examples[i] for i in sorted(b)] for b in bins]


# ---------------------------------------------------------------------------------------- the whole thing


@dataclass
class PreparedData:
    train: Any
    eval: Any | None
    stats: DataStats


def prepare_data(recipe, tokenizer, accelerator=None, *, rows=None) -> PreparedData:
    """Read, check, split, tokenize and pack the recipe's data; cached, built once by the main process.

    With an `accelerator`, the main process builds while the others wait, and a failure on the main process
    makes every rank stop (with the message shown once) instead of leaving the others waiting at a barrier.
    """
    import datasets

    datasets.disable_progress_bars()
    key = _cache_key(recipe, tokenizer)
    folder = cache_dir() / "tokenized" / key
    # One builder per machine (the cache folder need not be shared between machines).
    builds = accelerator is None or accelerator.is_local_main_process
    error: UserError | None = None
    if builds and not (folder / "stats.json").exists():
        try:
            _build(recipe, tokenizer, folder, key, rows)
        except UserError as e:
            e.rank_local = accelerator is not None and not accelerator.is_main_process  # another machine's builder
            error = e
    if accelerator is not None and accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        if not all(gather_object([error is None])) and error is None:
            raise UserError("the main process could not prepare the data (its message is above)")
    if error is not None:
        raise error
    stats = DataStats(**{k: v for k, v in json.loads((folder / "stats.json").read_text()).items()
                         if k in DataStats.__dataclass_fields__})
    train = datasets.load_from_disk(str(folder / "train"))
    evaluation = datasets.load_from_disk(str(folder / "eval")) if (folder / "eval").exists() else None
    return PreparedData(train=train.with_format("python"), eval=evaluation, stats=stats)


def _build(recipe, tokenizer, folder: Path, key: str, rows=None) -> None:
    import shutil

    d = recipe.data
    rows = read_rows(recipe) if rows is None else rows
    problems = check_rows(recipe, rows) + check_tokenizer(recipe, tokenizer)
    if problems:
        raise UserError(problems, title=f"data {d.path} has {len(problems)} problems")
    stats = DataStats(rows_read=len(rows))
    if d.eval_fraction > 0 and len(rows) >= 2:
        split = rows.train_test_split(test_size=d.eval_fraction, seed=recipe.training.seed, shuffle=True)
        train_rows, eval_rows = split["train"], split["test"]
    else:
        train_rows, eval_rows = rows, None
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    fn_kwargs = dict(recipe=recipe, tokenizer=tokenizer, seq_len=d.seq_len, pad_id=pad_id, packing=recipe.packing)

    counter_columns = ["n_truncated", "n_no_label", "n_empty"]

    def tokenize(ds, name):
        out = ds.map(lambda b: _tokenize_batch(batch=b, **fn_kwargs), batched=True, batch_size=_BATCH,
                     remove_columns=ds.column_names, num_proc=d.num_proc, load_from_cache_file=False,
                     new_fingerprint=f"{key}-{name}", desc="tokenizing")
        counters = {k: sum(out[k]) for k in counter_columns + ["n_labels"]}
        out = out.filter(lambda r: r["length"] >= 0, new_fingerprint=f"{key}-{name}-filtered")
        return out.remove_columns(counter_columns), counters

    train, counters = tokenize(train_rows, "train")
    stats.truncated, stats.no_label_rows, stats.empty_rows = counters["n_truncated"], counters["n_no_label"], \
        counters["n_empty"]
    stats.train_rows = stats.examples = len(train_rows) - counters["n_empty"]
    if len(train) == 0:
        raise UserError(Problem(recipe.where("data.path"), f"{d.path} has no non-empty training rows",
                                "put text in the rows"))
    if counters["n_labels"] == 0:
        fields = {"instruction": f"data.output_field ({d.output_field!r})", "chat": "the assistant messages"}
        raise UserError(Problem(recipe.where("data.path"), f"no training example keeps a token that carries a loss "
                                f"({counters['n_no_label']:,} of {len(train_rows):,} lost it to truncation at "
                                f"data.seq_len = {d.seq_len}, or have none), so nothing would be learned",
                                f"raise data.seq_len, or check {fields.get(d.format, 'the data')}"))
    stats.train_sequences = len(train)
    lengths = train["length"]
    stats.train_tokens = int(sum(lengths))
    stats.label_tokens = int(counters["n_labels"])
    stats.packed = recipe.packing
    stats.packing_efficiency = stats.train_tokens / (len(train) * d.seq_len) if recipe.packing else \
        stats.train_tokens / max(1, sum(lengths))
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    train.save_to_disk(str(tmp / "train"))
    if eval_rows is not None and len(eval_rows):
        evaluation, eval_counters = tokenize(eval_rows, "eval")
        stats.eval_rows = len(eval_rows) - eval_counters["n_empty"]
        stats.eval_sequences = len(evaluation)
        if len(evaluation):
            evaluation.save_to_disk(str(tmp / "eval"))
    (tmp / "stats.json").write_text(json.dumps(asdict(stats), indent=1))
    try:
        os.replace(tmp, folder)
    except OSError:  # another machine's builder sharing this cache finished first; its result is identical
        shutil.rmtree(tmp, ignore_errors=True)


def _cache_key(recipe, tokenizer) -> str:
    d = recipe.data
    kind, local = resolve_data_path(recipe)
    if kind == "file" and local and os.path.exists(local):
        st = os.stat(local)
        source = [os.path.abspath(local), st.st_size, st.st_mtime_ns]
    else:
        source = [d.path, d.hub_config, d.split]
    tok = tokenizer.backend_tokenizer.to_str() if hasattr(tokenizer, "backend_tokenizer") else repr(tokenizer)
    parts = {
        "version": 5, "source": source, "data": asdict(d) | {"num_proc": None}, "packing": recipe.packing,
        "seed": recipe.training.seed, "tokenizer": hashlib.sha256(tok.encode()).hexdigest(),
        "chat_template": tokenizer.chat_template, "special": [tokenizer.eos_token_id, tokenizer.pad_token_id,
                                                              tokenizer.bos_token_id],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]
