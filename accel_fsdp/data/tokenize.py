"""Tokenizing a source's rows: text, instruction and chat examples become token ids and a loss mask.

  text         every token carries a loss; an EOS token ends each document
  instruction  the tokenizer's chat template (a user turn and an assistant turn) when it has one, else the Alpaca
               prompt; loss on the response (and its end-of-turn token) only
  chat         the messages rendered with the chat template; loss on the assistant turns only
  preference   a pair: the prompt followed by the chosen answer, and by the rejected one (two examples, in this
               order); loss on the answers only. Strings (with the chat template as a user and an assistant turn when
               the tokenizer has one, else prompt and answer concatenated with an EOS after the answer), or
               conversations ending in an assistant turn that share everything before it

Texts are encoded in batches by the tokenizer's own Rust encoder (`encode_batch`, which runs on as many threads as
the process may use), the same encoder `tokenizer(text)` calls one text at a time, so the ids are identical.
Checking a row (its fields, their types, a chat's roles) happens here, as the row passes: a bad row is reported
through the `SourceReader` with its file and line. This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

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

    @property
    def answer(self) -> int:
        """Index of the first token that carries a loss (preference: where the answer starts)."""
        if self.mask is None:
            return 0
        hits = np.flatnonzero(self.mask)
        return int(hits[0]) if len(hits) else len(self.ids)


def fit_pair(chosen: Example, rejected: Example, seq_len: int) -> tuple[Example, Example, bool, bool]:
    """A preference pair within seq_len tokens: (chosen, rejected, prompt cut, answer cut). The prompt is cut from the
    left by as many tokens as the longer of the two needs (both lose the same prompt tokens), the answers are kept;
    only an answer that does not fit with one prompt token before it (a sequence's first token carries no loss) is
    cut itself, from the right."""
    over = max(len(chosen), len(rejected)) - seq_len
    if over <= 0:
        return chosen, rejected, False, False
    cut = max(0, min(over, min(chosen.answer, rejected.answer) - 1))
    out, answer_cut = [], False
    for ex in (chosen, rejected):
        ids, mask = ex.ids[cut:], None if ex.mask is None else ex.mask[cut:]
        if len(ids) > seq_len:
            ids, mask, answer_cut = ids[:seq_len], None if mask is None else mask[:seq_len], True
        out.append(Example(ids, mask, ex.row))
    return out[0], out[1], cut > 0, answer_cut


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
        if fmt == "preference":
            return self._preference(numbers, rows)
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
        # One array for the batch (numpy builds it from the id lists faster than one array per document), each
        # example a view of it, an EOS inserted after every document.
        ids = encode(self.tokenizer, texts, special=True)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum()))
        if self.eos is not None:
            flat = np.insert(flat, np.cumsum(lengths), self.eos)
            lengths = lengths + 1
        ends = np.cumsum(lengths)
        return [Example(flat[end - size:end], None, n) for n, size, end in zip(kept, lengths.tolist(), ends.tolist())]

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


    # ----------------------------------------------------------------------------------------- preference

    def _preference(self, numbers, rows) -> list[Example]:
        """Two examples per row: prompt + chosen, prompt + rejected; the loss only on the answer."""
        conversations, strings = [], []
        for n, row in zip(numbers, rows):
            pair = self._pair(n, row)
            if pair is None:
                continue
            (conversations if isinstance(pair[1], list) else strings).append((n, *pair))
        if self.reader.problems or self.tokenizer is None:
            return []
        out: dict[int, list[Example]] = {}
        if strings and self.tokenizer.chat_template:  # a user turn and an assistant turn, as instruction rows are
            conversations += [(n, None, [{"role": "user", "content": p}, {"role": "assistant", "content": c}],
                               [{"role": "user", "content": p}, {"role": "assistant", "content": r}])
                              for n, p, c, r in strings]
            strings = []
        if strings:
            eos = [self.eos] if self.eos is not None else []
            prompts = encode(self.tokenizer, [p for _, p, _, _ in strings], special=True)
            answers = encode(self.tokenizer, [a for _, _, c, r in strings for a in (c, r)], special=False)
            for k, ((n, *_), p) in enumerate(zip(strings, prompts)):
                out[n] = [Example(np.asarray(p + a + eos, dtype=np.int64),
                                  np.concatenate([np.zeros(len(p), bool), np.ones(len(a) + len(eos), bool)]), n)
                          for a in (answers[2 * k], answers[2 * k + 1])]
        if conversations:
            texts, spans = [], []
            for _, _, chosen, rejected in conversations:
                for messages in (chosen, rejected):
                    text, turns = render_chat(self.tokenizer, messages)
                    texts.append(text)
                    spans.append(turns[-1:])  # the answer is the last assistant turn; earlier ones are the prompt
            encoded = encode_with_offsets(self.tokenizer, texts)
            for k, (n, *_) in enumerate(conversations):
                out[n] = [Example(np.asarray(encoded[j][0], dtype=np.int64), _inside(encoded[j][1], spans[j]), n)
                          for j in (2 * k, 2 * k + 1)]
        return [ex for n in numbers if n in out for ex in out[n]]

    def _pair(self, n: int, row: dict):
        """(prompt, chosen, rejected) of a row: three strings, or the prompt None and two conversations; None when the
        row is bad (recorded)."""
        s = self.source
        for role, column in (("chosen", s.chosen_field), ("rejected", s.rejected_field)):
            if column not in row:
                self.reader.missing_field(n, row, role)
                return None
        prompt, chosen, rejected = row.get(s.prompt_field), row[s.chosen_field], row[s.rejected_field]
        if isinstance(chosen, list) or isinstance(rejected, list):
            return self._conversations(n, prompt, chosen, rejected)
        for column, value in ((s.chosen_field, chosen), (s.rejected_field, rejected)):
            if not isinstance(value, str) or not value.strip():
                what = "is empty" if isinstance(value, str) or value is None else \
                    f"is not text ({type(value).__name__})"
                self.reader.bad("empty answer", n, f"answer {column!r} {what}",
                                "every pair needs two non-empty answers")
                return None
        if s.prompt_field not in row:
            self.reader.missing_field(n, row, "prompt")
            return None
        if not isinstance(prompt, str):
            self.reader.bad("prompt type", n, f"field {s.prompt_field!r} is not text", "use a string (or conversations "
                            "in chosen and rejected)")
            return None
        return prompt, chosen, rejected  # answers that prefer nothing are found by their tokens (data/build.py)

    def _conversations(self, n: int, prompt, chosen, rejected):
        s = self.source
        prefix = prompt if isinstance(prompt, list) else []
        if isinstance(prompt, str) and isinstance(chosen, list) and chosen and isinstance(chosen[0], dict) \
                and chosen[0].get("role") == "assistant":
            prefix = [{"role": "user", "content": prompt}]  # the prompt as text, the answers as assistant turns
        full = []
        for column, messages in ((s.chosen_field, chosen), (s.rejected_field, rejected)):
            problem = check_messages(prefix + messages) if isinstance(messages, list) else "is not a list of messages"
            if problem is None and messages[-1]["role"] != "assistant":
                problem = "does not end with an assistant turn (the answer)"
            if problem is None and not messages[-1]["content"].strip():
                problem = "ends with an empty answer"
            if problem:
                self.reader.bad("pair messages", n, f"{column}: {problem}", "chosen and rejected are conversations "
                                "that end with the answer (or the answer alone, with the prompt in its own field)")
                return None
            full.append(prefix + messages)
        if full[0][:-1] != full[1][:-1]:
            self.reader.bad("pair prefix", n, "chosen and rejected differ before their last assistant turn",
                            "both must share the conversation up to the answer")
            return None
        return None, full[0], full[1]


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
