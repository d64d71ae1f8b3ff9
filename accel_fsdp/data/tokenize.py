"""Tokenizing a source's rows: text, instruction and chat examples become token ids and a loss mask.

  text         every token carries a loss; an EOS token ends each document
  instruction  the tokenizer's chat template (a user turn and an assistant turn) when it has one, else the Alpaca
               prompt; loss on the response (and its end-of-turn token) only
  chat         the messages rendered with the chat template; loss on the assistant turns only
  preference   a pair: the prompt followed by the chosen answer, and by the rejected one (two examples, in this
               order); loss on the answers only. Strings (with the chat template as a user and an assistant turn when
               the tokenizer has one, else prompt and answer concatenated with an EOS after the answer), or
               conversations ending in an assistant turn that share everything before it

Texts are encoded in batches by the tokenizer's own Rust encoder (encoder.py: `encode_batch`, which runs on as many
threads as the process may use), the same encoder `tokenizer(text)` calls one text at a time, so the ids are
identical; `ExampleTokenizer.stream` encodes one batch while the next is read, checked and rendered. Checking a row
(its fields, their types, a chat's roles, what the chat template accepts) happens here, as the row passes: a bad row
is reported through the `SourceReader` with its file and line. This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import chain

import numpy as np

from accel_fsdp.config.recipe import SourceConfig
from accel_fsdp.data.encoder import ChatEncoder, ChatTemplate, closing_tokens, encode, encode_opening
from accel_fsdp.data.mixture import SourceStats
from accel_fsdp.data.shapes import as_messages, chat_field, implicit_prompt, prompt_field, prompt_left_out
from accel_fsdp.data.sources import CHAT_ROLES, SourceReader, check_messages
from accel_fsdp.errors import first_line

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


class PlainPrompt(str):
    """A pair's prompt read from the texts of its answers (`ExampleTokenizer._implicit_pair`): written as it is, never
    wrapped in a chat template's turns."""


def no_examples() -> list[Example]:
    """What a batch with bad rows (or checked without a tokenizer) encodes into."""
    return []


class ExampleTokenizer:
    """Rows of one source -> `Example`s, checking each row for the source's format."""

    def __init__(self, tokenizer, source: SourceConfig, reader: SourceReader):
        """`tokenizer` None: check the rows only (the tokenizer is not on this machine), returning no examples."""
        self.tokenizer, self.source, self.reader = tokenizer, source, reader
        self.eos = tokenizer.eos_token_id if tokenizer is not None else None
        self.closing = closing_tokens(tokenizer) if tokenizer is not None else []
        """What the tokenizer's special tokens write after a text, left out where this module writes the end."""
        has_template = tokenizer is not None and bool(tokenizer.chat_template)
        self.template = ChatTemplate(tokenizer) if has_template else None
        self.chat_encoder = ChatEncoder(tokenizer) if has_template else None
        self.empty, self.empty_lines = 0, []
        """Rows of a text source whose text is empty (skipped, counted), and the first few of them."""
        self.empty_turns, self.empty_turn_lines = 0, []
        """Rows kept whose preference prompt, or an assistant turn (not a pair's answer), is empty or whitespace, and
        the first few of them: they teach answers to nothing, or to answer nothing (a field named wrong, a conversation
        cut). Trained as they are (their tokens are what they were), and warned about (SourceStats.warnings)."""

    def __call__(self, numbers: list[int], rows: list[dict]) -> list[Example]:
        return self.check_and_render(numbers, rows)()

    def check_and_render(self, numbers: list[int], rows: list[dict]) -> Callable[[], list[Example]]:
        """Check a batch's rows (problems go to the reader) and render their texts now; the function returned
        encodes them into examples. Only that function calls the encoder, which releases the GIL while it works:
        `stream` runs it on a thread of its own, beside the reading and rendering of the next batch."""
        fmt = self.source.format
        if fmt == "text":
            return self._text(numbers, rows)
        if fmt == "instruction":
            return self._instruction(numbers, rows)
        if fmt == "preference":
            return self._preference(numbers, rows)
        conversations = [(n, self._chat_messages(n, row)) for n, row in zip(numbers, rows)]
        return self._chat([(n, messages) for n, messages in conversations if messages is not None])

    def stream(self, batches: Iterable[tuple[list[int], list[dict]]]):
        """(numbers, rows, examples) of each batch, in order. A batch is encoded on a second thread while this one
        reads, checks and renders the next and the caller stores the one before: the Rust encoder keeps the cores
        busy and the Python work of preparing a source (half of it, for chat data) hides behind it. At most two
        batches are in flight."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1, thread_name_prefix="encoder") as pool:
            ahead = None
            for numbers, rows in batches:
                job = pool.submit(self.check_and_render(numbers, rows))
                if ahead is not None:
                    yield ahead[0], ahead[1], ahead[2].result()
                ahead = (numbers, rows, job)
            if ahead is not None:
                yield ahead[0], ahead[1], ahead[2].result()

    # ----------------------------------------------------------------------------------------------- text

    def _text(self, numbers, rows) -> Callable[[], list[Example]]:
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
                SourceStats.note_row(self.empty_lines, n)
                continue
            texts.append(value)
            kept.append(n)
        if self.reader.problems or self.tokenizer is None:
            return no_examples
        return lambda: self._text_examples(kept, texts)

    def _text_examples(self, kept: list[int], texts: list[str]) -> list[Example]:
        # One array for the batch (numpy builds it from the id lists faster than one array per document), each
        # example a view of it, an EOS inserted after every document.
        ids = encode_opening(self.tokenizer, texts, self.closing)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum()))
        if self.eos is not None:
            flat = np.insert(flat, np.cumsum(lengths), self.eos)
            lengths = lengths + 1
        ends = np.cumsum(lengths)
        return [Example(flat[end - size:end], None, n) for n, size, end in zip(kept, lengths.tolist(), ends.tolist())]

    # ---------------------------------------------------------------------------------------- instruction

    def _instruction(self, numbers, rows) -> Callable[[], list[Example]]:
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
                    what = ("is missing or empty" if value is None or (isinstance(value, str) and not value.strip())
                            else f"is not text ({type(value).__name__} {str(value)[:40]!r})")
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
            return no_examples
        if self.tokenizer.chat_template:
            conversations = []
            for n, instruction, extra, output in good:
                user = f"{instruction}\n\n{extra}" if extra else instruction
                conversations.append((n, [{"role": "user", "content": user}, {"role": "assistant", "content": output}]))
            return self._chat(conversations)
        return lambda: self._alpaca_examples(good)

    def _alpaca_examples(self, good: list[tuple[int, str, str, str]]) -> list[Example]:
        """The Alpaca prompt (with the tokenizer's special tokens) and the output (with an EOS), encoded apart."""
        prompts = [(ALPACA_PROMPT_WITH_INPUT if extra else ALPACA_PROMPT).format(instruction=instruction, input=extra)
                   for _, instruction, extra, _ in good]
        eos = [self.eos] if self.eos is not None else []
        prompt_ids = encode_opening(self.tokenizer, prompts, self.closing)
        answer_ids = encode(self.tokenizer, [output for *_, output in good], special=False)
        out = []
        for (n, *_), p, a in zip(good, prompt_ids, answer_ids):
            a = a + eos
            out.append(Example(np.asarray(p + a, dtype=np.int64),
                               np.concatenate([np.zeros(len(p), bool), np.ones(len(a), bool)]), n))
        return out

    # ----------------------------------------------------------------------------------------------- chat

    def _chat_messages(self, n: int, row: dict) -> list[dict] | None:
        """A chat row's messages in {role, content} form (ShareGPT's read as such: data/shapes.py), or None with the
        row reported."""
        field = chat_field(row, self.source)
        if field not in row:
            self.reader.missing_field(n, row, "messages")
            return None
        messages, problem = as_messages(row[field])
        problem = problem or check_messages(messages)
        if problem:
            self.reader.bad("messages", n, problem, f"each message needs a role ({', '.join(CHAT_ROLES)}) and text "
                            "content (or ShareGPT's from: human, gpt or system, and value), and a conversation at "
                            "least one assistant message")
            return None
        self._note_empty_turns(n, messages)
        return messages

    def _note_empty_turns(self, n: int, messages: list[dict]) -> None:
        if any(m["role"] == "assistant" and not m["content"].strip() for m in messages):
            self._note_empty_turn(n)

    def _note_empty_turn(self, n: int) -> None:
        self.empty_turns += 1
        SourceStats.note_row(self.empty_turn_lines, n)

    def _chat(self, conversations: list[tuple[int, list[dict]]]) -> Callable[[], list[Example]]:
        """Render each conversation with the chat template; a token carries a loss when its characters lie inside
        an assistant turn (its content and the template's end-of-turn text). The whole text is tokenized at once, so
        the tokens are those of the conversation as the model reads it (BPE merges across turn boundaries
        included)."""
        if self.reader.problems or self.tokenizer is None:
            return no_examples
        rows, texts, spans = [], [], []
        for n, messages in conversations:
            rendered = self._render(n, self.template.conversation, messages)
            if rendered is not None:
                rows.append(n)
                texts.append(rendered[0])
                spans.append(rendered[1])
        if self.reader.problems:
            return no_examples
        return lambda: [Example(ids, mask, n) for n, (ids, mask) in zip(rows, self.chat_encoder(texts, spans))]

    def _render(self, n: int, render, *args):
        """render(*args), or None with the row reported when the chat template refuses it (a template may raise on a
        role order it does not support) or fails on it (a Python error inside the template: `content + 1`, a
        missing key; it stopped the build with a traceback)."""
        from jinja2 import TemplateError

        try:
            return render(*args)
        except TemplateError as e:
            self.reader.bad("chat template", n, f"the chat template refuses this conversation: {first_line(e)}",
                            "fix the row's messages (roles, order), or use a tokenizer whose template accepts them")
        except Exception as e:  # noqa: BLE001 - raised by the template's own code, whatever it is
            self.reader.bad("chat template", n, f"the chat template fails on this conversation "
                            f"({first_line(e, named=True)})", "correct the template (chat_template.jinja, or "
                            "chat_template in tokenizer_config.json), or the row's messages if it is their doing")
        return None

    # ----------------------------------------------------------------------------------------- preference

    def _preference(self, numbers, rows) -> Callable[[], list[Example]]:
        """Two examples per row: prompt + chosen, prompt + rejected; the loss only on the answer."""
        conversations, strings, plain = [], [], []
        for n, row in zip(numbers, rows):
            pair = self._pair(n, row)
            if pair is None:
                continue
            if isinstance(pair[1], list) and self.tokenizer is not None and self.template is None:
                self.reader.bad("pair template", n, "chosen and rejected are conversations, and the tokenizer has no "
                                "chat template to write them with", "use a tokenizer with a chat template "
                                "(model.tokenizer), or give the prompt and the two answers as strings")
                continue
            if isinstance(pair[1], list):
                conversations.append((n, *pair))
            else:
                (plain if isinstance(pair[0], PlainPrompt) else strings).append((n, *pair))
        if self.reader.problems or self.tokenizer is None:
            return no_examples
        if strings and self.tokenizer.chat_template:  # a user turn and an assistant turn, as instruction rows are
            conversations += [(n, None, [{"role": "user", "content": p}, {"role": "assistant", "content": c}],
                               [{"role": "user", "content": p}, {"role": "assistant", "content": r}])
                              for n, p, c, r in strings]
            strings = []
        strings += plain
        prompts, texts, spans, rows_ = [], [], [], []
        for n, _, chosen, rejected in conversations:
            # The answer is the last message, and both share what comes before it (checked): where it starts is
            # rendered once for the two, and encoded once (ChatEncoder.pairs).
            start = self._render(n, self.template.render, chosen[:-1], True) if len(chosen) > 1 else ""
            pair = start is not None and [self._render(n, self.template.render, m) for m in (chosen, rejected)]
            if pair and None not in pair:
                rows_.append(n)
                prompts.append(start)
                texts += pair
                spans += [[(self.template.answer_start(text, chosen[:-1], start), len(text))] for text in pair]
        if self.reader.problems:
            return no_examples
        return lambda: self._pairs(numbers, strings, rows_, prompts, texts, spans)

    def _pairs(self, numbers, strings, rows, prompts, texts, spans) -> list[Example]:
        """The pairs' examples, in the rows' order: strings without a chat template (prompt and answer encoded apart,
        an EOS after the answer), and rendered conversations."""
        out: dict[int, list[Example]] = {}
        if strings:
            eos = [self.eos] if self.eos is not None else []
            prompt_ids = encode_opening(self.tokenizer, [str(p) for _, p, _, _ in strings], self.closing)
            answers = encode(self.tokenizer, [a for _, _, c, r in strings for a in (c, r)], special=False)
            for k, ((n, *_), p) in enumerate(zip(strings, prompt_ids)):
                out[n] = [Example(np.asarray(p + a + eos, dtype=np.int64),
                                  np.concatenate([np.zeros(len(p), bool), np.ones(len(a) + len(eos), bool)]), n)
                          for a in (answers[2 * k], answers[2 * k + 1])]
        encoded = self.chat_encoder.pairs(prompts, texts, spans) if texts else []
        for k, n in enumerate(rows):
            out[n] = [Example(*encoded[2 * k], n), Example(*encoded[2 * k + 1], n)]
        return [ex for n in numbers if n in out for ex in out[n]]

    def _pair(self, n: int, row: dict):
        """(prompt, chosen, rejected) of a row: three strings (the prompt a PlainPrompt where the answers held it), or
        the prompt None and two conversations; None when the row is bad (recorded)."""
        s = self.source
        for role, column in (("chosen", s.chosen_field), ("rejected", s.rejected_field)):
            if column not in row:
                self.reader.missing_field(n, row, role)
                return None
        prompt_column = prompt_field(row, s)
        prompt, chosen, rejected = row.get(prompt_column), row[s.chosen_field], row[s.rejected_field]
        chosen, rejected = ([a] if isinstance(a, dict) else a for a in (chosen, rejected))  # one message each
        if isinstance(chosen, list) or isinstance(rejected, list):
            return self._conversations(n, prompt, chosen, rejected, prompt_column)
        for column, value in ((s.chosen_field, chosen), (s.rejected_field, rejected)):
            if not isinstance(value, str) or not value.strip():
                what = ("is empty" if isinstance(value, str) or value is None
                        else f"is not text ({type(value).__name__})")
                self.reader.bad("empty answer", n, f"answer {column!r} {what}",
                                "every pair needs two non-empty answers")
                return None
        if prompt_left_out(row, s):
            return self._implicit_pair(n, chosen, rejected)
        if s.prompt_field not in row:  # a prompt field the user named is read as named
            self.reader.missing_field(n, row, "prompt")
            return None
        if not isinstance(prompt, str):
            self.reader.bad("prompt type", n, f"field {s.prompt_field!r} is not text", "use a string (or conversations "
                            "in chosen and rejected)")
            return None
        if not prompt.strip():
            self._note_empty_turn(n)
        return prompt, chosen, rejected  # answers that prefer nothing are found by their tokens (data/build.py)

    def _implicit_pair(self, n: int, chosen: str, rejected: str):
        """(prompt, chosen, rejected) of two texts that hold their prompt (HH-RLHF's dialogues), split where they
        part (data/shapes.py `implicit_prompt`, TRL's rule), the prompt a PlainPrompt: as TRL does for
        pairs of strings, no chat template writes them (the texts carry their own turns' markup)."""
        start, problem = implicit_prompt(chosen, rejected)
        if problem:
            self.reader.bad("implicit prompt", n, f"no field {self.source.prompt_field!r}, and {problem}",
                            "give the prompt in a field of its own (data.prompt_field), and the answers without it")
            return None
        return PlainPrompt(chosen[:start]), chosen[start:], rejected[start:]

    def _conversations(self, n: int, prompt, chosen, rejected, prompt_column: str):
        """`prompt_column`: where the prompt was read (prompt_field, or ShareGPT's conversations)."""
        s = self.source
        prompt, problem = as_messages(prompt)
        chosen, chosen_problem = as_messages(chosen)
        rejected, rejected_problem = as_messages(rejected)
        for column, problem in ((prompt_column, problem), (s.chosen_field, chosen_problem),
                                (s.rejected_field, rejected_problem)):
            if problem:
                self.reader.bad("pair messages", n, f"{column}: {problem}", "chosen and rejected are conversations "
                                "that end with the answer (or the answer alone, with the prompt in its own field)")
                return None
        prefix = prompt if isinstance(prompt, list) else []
        if (isinstance(prompt, str) and isinstance(chosen, list) and chosen and isinstance(chosen[0], dict)
                and chosen[0].get("role") == "assistant"):
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
        self._note_empty_turns(n, full[0][:-1])
        return None, full[0], full[1]
