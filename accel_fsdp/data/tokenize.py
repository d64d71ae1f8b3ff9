"""Tokenizing a source's rows: text, instruction and chat examples become token ids and a loss mask.

  text         every token carries a loss; an EOS token ends each document
  instruction  the tokenizer's chat template (a user turn and an assistant turn) when it has one, else the Alpaca
               prompt; loss on the response (and its end-of-turn token) only
  chat         the messages rendered with the chat template; loss on the assistant turns only

Texts are encoded in batches by the tokenizer's own Rust encoder (`encode_batch`, which runs on as many threads as
the process may use), the same encoder `tokenizer(text)` calls one text at a time, so the ids are identical.
Checking a row (its fields, their types, a chat's roles) happens here, as the row passes: a bad row is reported
through the `SourceReader` with its file and line. This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from accel_fsdp.config.recipe import SourceConfig
from accel_fsdp.data.sources import CHAT_ROLES, SourceReader, check_messages

ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


@dataclass
class Example:
    """One tokenized example, untruncated."""

    ids: np.ndarray
    """Token ids (int64)."""
    mask: np.ndarray | None
    """Which tokens carry a loss (bool); None: every token does (text)."""
    row: int
    """Its row (line) number in the source."""

    def __len__(self) -> int:
        return len(self.ids)


def encode(tokenizer, texts: list[str], *, special: bool) -> list[list[int]]:
    """Token ids of each text, as `tokenizer(text, add_special_tokens=special)["input_ids"]` gives them, encoded in
    one batch by the Rust backend (transformers' fast tokenizers call the same `encode_batch`:
    tokenization_utils_tokenizers.py, _batch_encode_plus; checked with 5.24.0)."""
    backend = _backend(tokenizer)
    if backend is None:  # a tokenizer without a Rust backend: one text at a time, through its own __call__
        return [tokenizer(t, add_special_tokens=special)["input_ids"] for t in texts]
    fast = getattr(backend, "encode_batch_fast", None) or backend.encode_batch  # _fast: no character offsets
    return [e.ids for e in fast(texts, add_special_tokens=special)]


def encode_with_offsets(tokenizer, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """(ids, character span of each token) of each text, without special tokens added (a chat template writes its
    own)."""
    backend = _backend(tokenizer)
    if backend is None:
        out = []
        for t in texts:
            enc = tokenizer(t, add_special_tokens=False, return_offsets_mapping=True)
            out.append((enc["input_ids"], enc["offset_mapping"]))
        return out
    return [(e.ids, e.offsets) for e in backend.encode_batch(texts, add_special_tokens=False)]


def _backend(tokenizer):
    """The Rust tokenizer of a fast tokenizer, set to neither truncate nor pad (as transformers sets it for a call
    without those options)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch"):
        return None
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()
    return backend


class ExampleTokenizer:
    """Rows of one source -> `Example`s, checking each row for the source's format."""

    def __init__(self, tokenizer, source: SourceConfig, reader: SourceReader):
        """`tokenizer` None: check the rows only (the tokenizer is not on this machine), returning no examples."""
        self.tokenizer, self.source, self.reader = tokenizer, source, reader
        self.eos = tokenizer.eos_token_id if tokenizer is not None else None
        self.empty = 0
        """Rows of a text source whose text is empty (skipped, counted)."""

    def __call__(self, numbers: list[int], rows: list[dict]) -> list[Example]:
        fmt = self.source.format
        if fmt == "text":
            return self._text(numbers, rows)
        if fmt == "instruction":
            return self._instruction(numbers, rows)
        return self._chat(numbers, [(n, row.get(self.source.messages_field)) for n, row in zip(numbers, rows)
                                    if self._chat_row_ok(n, row)])

    # ----------------------------------------------------------------------------------------------- text

    def _text(self, numbers, rows) -> list[Example]:
        field = self.source.text_field
        texts, kept = [], []
        for n, row in zip(numbers, rows):
            if field not in row:
                self.reader.missing_field(n, row, "text")
                continue
            value = row[field]
            if value is not None and not isinstance(value, str):
                self.reader.bad("text type", n, f"field {field!r} is not text ({type(value).__name__})",
                                "every row's text must be a string")
                continue
            if not value or not value.strip():
                self.empty += 1
                continue
            texts.append(value)
            kept.append(n)
        if self.reader.problems or self.tokenizer is None:
            return []
        eos = [self.eos] if self.eos is not None else []
        return [Example(np.asarray(ids + eos, dtype=np.int64), None, n)
                for n, ids in zip(kept, encode(self.tokenizer, texts, special=True))]

    # ---------------------------------------------------------------------------------------- instruction

    def _instruction(self, numbers, rows) -> list[Example]:
        s = self.source
        good = []
        for n, row in zip(numbers, rows):
            ok = True
            for role, column in (("instruction", s.instruction_field), ("output", s.output_field)):
                if column not in row:
                    self.reader.missing_field(n, row, role)
                    ok = False
                    continue
                value = row[column]
                if not isinstance(value, str) or not value.strip():
                    what = "is missing or empty" if value is None or (isinstance(value, str) and not value.strip()) \
                        else f"is not text ({type(value).__name__} {str(value)[:40]!r})"
                    self.reader.bad(f"{role} value", n, f"field {column!r} {what}",
                                    "every row needs an instruction and an output")
                    ok = False
            extra = row.get(s.input_field)
            if extra is not None and not isinstance(extra, str):
                self.reader.bad("input value", n, f"field {s.input_field!r} is not text",
                                "use a string, or leave it out")
                ok = False
            if ok:
                good.append((n, row[s.instruction_field], extra or "", row[s.output_field]))
        if self.reader.problems or self.tokenizer is None:
            return []
        if self.tokenizer.chat_template:
            conversations = []
            for n, instruction, extra, output in good:
                user = f"{instruction}\n\n{extra}" if extra else instruction
                conversations.append((n, [{"role": "user", "content": user}, {"role": "assistant", "content": output}]))
            return self._chat(numbers, conversations)
        prompts = [(ALPACA_PROMPT_WITH_INPUT if extra else ALPACA_PROMPT).format(instruction=instruction, input=extra)
                   for _, instruction, extra, _ in good]
        eos = [self.eos] if self.eos is not None else []
        prompt_ids = encode(self.tokenizer, prompts, special=True)
        answer_ids = encode(self.tokenizer, [output for *_, output in good], special=False)
        out = []
        for (n, *_), p, a in zip(good, prompt_ids, answer_ids):
            a = a + eos
            out.append(Example(np.asarray(p + a, dtype=np.int64),
                               np.concatenate([np.zeros(len(p), bool), np.ones(len(a), bool)]), n))
        return out

    # ----------------------------------------------------------------------------------------------- chat

    def _chat_row_ok(self, n: int, row: dict) -> bool:
        if self.source.messages_field not in row:
            self.reader.missing_field(n, row, "messages")
            return False
        problem = check_messages(row[self.source.messages_field])
        if problem:
            self.reader.bad("messages", n, problem, f"each message needs a role ({', '.join(CHAT_ROLES)}) and text "
                            "content, and a conversation at least one assistant message")
            return False
        return True

    def _chat(self, numbers, conversations: list[tuple[int, list[dict]]]) -> list[Example]:
        """Render each conversation with the chat template; a token carries a loss when its characters lie inside
        an assistant turn (its content and the template's end-of-turn text). The template is rendered once per
        assistant turn to find where each reply starts and ends; the whole text is then tokenized once, so the
        tokens are those of the conversation as the model reads it (BPE merges across turn boundaries included)."""
        if self.reader.problems or self.tokenizer is None:
            return []
        texts, spans = [], []
        for _, messages in conversations:
            text, turn_spans = render_chat(self.tokenizer, messages)
            texts.append(text)
            spans.append(turn_spans)
        out = []
        for (n, _), (ids, offsets), turn_spans in zip(conversations, encode_with_offsets(self.tokenizer, texts), spans):
            out.append(Example(np.asarray(ids, dtype=np.int64), _inside(offsets, turn_spans), n))
        return out


def render_chat(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The conversation as text, and the character span of each assistant turn in it."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)) if i else 0
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        end = len(upto) if text.startswith(upto) else start + len(m["content"])  # a template that rewrites earlier
        spans.append((start, end))                                               # turns: the reply text only
    return text, spans


def _inside(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """For each token (its character span), whether it lies inside one of `spans` (and is not empty)."""
    if not offsets:
        return np.zeros(0, bool)
    o = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    inside = np.zeros(len(o), bool)
    for s, e in spans:
        inside |= (o[:, 0] >= s) & (o[:, 1] <= e) & (o[:, 1] > o[:, 0])
    return inside
