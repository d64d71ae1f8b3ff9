"""The Rust encoder, driven a batch at a time: texts -> token ids (`encode`), and conversations -> their text, token
ids and the loss mask of their assistant turns (`ChatTemplate`, `ChatEncoder`). Rows and their formats are
tokenize.py's; this module sees only texts. It imports no torch.

The loss mask of a conversation is defined by the plain computation (tests/test_chat_masks.py writes it out and holds
every path here to it, ids and masks alike): the text is `apply_chat_template(messages)`, tokenized whole; assistant
turn i spans from the end of `apply_chat_template(messages[:i], add_generation_prompt=True)` (0 for a first message;
where the text goes on with `messages[:i]` rendered alone but not with the generation prompt, from where the two part)
to the end of `apply_chat_template(messages[:i + 1])` where the text goes on with that, else its content's length
further (a template that rewrites earlier turns); a token carries a loss when its characters (the encoder's offsets,
not empty) lie inside a span. Computed that way, a conversation costs 3 renders a turn through apply_chat_template
and a Python list of offsets per token; here, the same result costs 2 renders a turn of the compiled template and,
for byte-level BPE tokenizers that keep offsets untrimmed (Llama 3's and `bpe:N`'s among them; not GPT-2's own), a
few numpy operations per batch.
"""

from __future__ import annotations

import os
import unicodedata
from itertools import chain

import numpy as np


def encode(tokenizer, texts: list[str], *, special: bool) -> list[list[int]]:
    """Token ids of each text, as `tokenizer(text, add_special_tokens=special)["input_ids"]` gives them, encoded in
    one batch by the Rust backend (transformers' fast tokenizers call the same `encode_batch`:
    tokenization_utils_tokenizers.py, _batch_encode_plus; checked with 5.24.0)."""
    backend = _backend(tokenizer)
    if backend is None:  # a tokenizer without a Rust backend: one text at a time, through its own __call__
        return [tokenizer(t, add_special_tokens=special)["input_ids"] for t in texts]
    fast = getattr(backend, "encode_batch_fast", None) or backend.encode_batch  # _fast: no character offsets
    return [e.ids for e in fast(texts, add_special_tokens=special)]


def encode_opening(tokenizer, texts: list[str], closing: list[int]) -> list[list[int]]:
    """As `encode(tokenizer, texts, special=True)` without `closing`, the special tokens the tokenizer writes after a
    text (`closing_tokens`): the tokens that open a text (a BOS) are kept. A tokenizer whose post-processor appends
    its EOS (Llama 2's and Mistral's with add_eos_token, a `TemplateProcessing` of "$A </s>") ended an Alpaca prompt
    with an EOS before its answer, and a text document with two (its own and the one tokenize.py appends)."""
    ids = encode(tokenizer, texts, special=True)
    if not closing:
        return ids
    k = len(closing)
    return [i[:-k] if i[-k:] == closing else i for i in ids]


def closing_tokens(tokenizer) -> list[int]:
    """The ids the tokenizer's special tokens put after a text: [] for most (GPT-2's and Llama 3's add none)."""
    plain, special = encode(tokenizer, ["a"], special=False)[0], encode(tokenizer, ["a"], special=True)[0]
    for start in range(len(special) - len(plain) + 1):
        if special[start:start + len(plain)] == plain:
            return special[start + len(plain):]
    return []


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


# ------------------------------------------------------------------------------------ chat: template and mask


def template_syntax_error(tokenizer) -> str | None:
    """Why the tokenizer's chat template is not valid Jinja, or None. Jinja compiles a template before rendering it
    (transformers: utils/chat_template_utils.py `_compile_jinja_template`), so a syntax error comes first, whatever the
    messages; without this it was blamed on the first row, as a conversation the template refuses."""
    from jinja2 import TemplateSyntaxError

    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    except TemplateSyntaxError as e:
        return f"{e.message} (line {e.lineno})"
    except Exception:  # noqa: BLE001 - a template that refuses or fails on this conversation: its rows will say
        return None
    return None


class ChatTemplate:
    """The tokenizer's chat template, rendered as `apply_chat_template(messages, tokenize=False)` renders it.

    Messages of plain role and content strings go straight to the template transformers compiled (its cache:
    utils/chat_template_utils.py, _compile_jinja_template), with the variables apply_chat_template gives it
    (render_jinja_template: messages, tools, documents, add_generation_prompt and the special tokens' map): half
    of apply_chat_template's time is normalizing and copying the messages, which changes nothing for such messages
    (checked with transformers 5.24.0), and the sandbox keeps the template from changing them. The template's
    globals are merged with those variables once, not at every render (what `Template.render` does in jinja 3.1:
    a context of `dict(globals, **variables)`, then `root_render_func`): half of what is left. Anything else (more
    keys in a message, a template transformers cannot hand us) goes through apply_chat_template itself, and the
    first conversation is rendered both ways: were they ever to differ, every render goes through
    apply_chat_template."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.compiled, self.variables, self.checked = None, {}, False
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            self.compiled = _compile_jinja_template(tokenizer.get_chat_template())
            self.variables = {**self.compiled.globals, "tools": None, "documents": None,
                              **tokenizer.special_tokens_map}
        except Exception:  # noqa: BLE001 - any change in transformers' internals: the public path, as exact
            self.compiled = None

    def render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        if self.compiled is None or not all(len(m) == 2 for m in messages):  # role and content only (checked)
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        template = self.compiled
        context = template.new_context({**self.variables, "messages": messages,
                                         "add_generation_prompt": generation_prompt}, shared=True)
        try:
            text = template.environment.concat(template.root_render_func(context))
        except Exception:  # noqa: BLE001 - as Template.render: the template's own error, its traceback rewritten
            template.environment.handle_exception()
        if not self.checked:
            self.checked = True
            if text != self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                          add_generation_prompt=generation_prompt):
                self.compiled = None
        return text

    def answer_start(self, text: str, before: list[dict], prompt: str | None = None) -> int:
        """Where the assistant turn after `before` starts in `text`: the end of `before` rendered with the generation
        prompt (`prompt`, when rendered already). A generation prompt that opens more than the rendered turn does
        (DeepSeek-R1's ends in "<think>\n", which its assistant turns drop from the history) would put that end
        inside the answer, its first characters without a loss: where the text does not go on with it but does with
        `before` rendered alone, the turn starts where the text and the generation prompt part."""
        if not before:
            return 0
        prompt = self.render(before, True) if prompt is None else prompt
        if text.startswith(prompt):
            return len(prompt)
        history = self.render(before)
        if not text.startswith(history):  # a template that rewrites earlier turns: as it was
            return len(prompt)
        return len(history) + len(os.path.commonprefix([text[len(history):], prompt[len(history):]]))

    def conversation(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation as text, and the character span of each assistant turn in it (2 renders a turn)."""
        text = self.render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = self.answer_start(text, messages[:i])
            if i == len(messages) - 1:  # messages[:i + 1] is the conversation: the text itself
                spans.append((start, len(text)))
                continue
            upto = self.render(messages[:i + 1])
            spans.append((start, len(upto) if text.startswith(upto) else start + len(m["content"])))
        return text, spans


class ChatEncoder:
    """Texts and their assistant spans -> (ids, mask) of each, in one batch of the Rust encoder.

    A byte-level BPE tokenizer (`token_bytes`) needs no offsets: a token's offsets are the characters its bytes come
    from, and its bytes are its vocabulary entry's, so token k of a text covers bytes [sum of the lengths before it,
    + its own) and carries a loss when that lies inside a span (the span's characters in bytes). Two binary searches a
    span, for the whole batch in numpy, and the encoder skips computing offsets. A text whose tokens' bytes do not add
    up to its own (an added token that swallows spaces, a normalizer that changed it) takes the offsets path, as
    does every text of any other tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.backend = _backend(tokenizer)
        self.byte_lengths, self.normal_form = token_bytes(tokenizer) if self.backend is not None else (None, None)
        self.added, self.inner = None, set()
        """A preference prompt is encoded once (`pairs`) when these are set: which ids are added tokens, and the
        characters that occur in an added token after its first."""
        if (self.byte_lengths is not None and self.normal_form is None
                and not getattr(self.backend, "encode_special_tokens", False)):  # special tokens as plain text
            tokens = self.backend.get_added_tokens_decoder()
            if not any(t.single_word or t.lstrip or t.rstrip for t in tokens.values()):
                self.added = np.zeros(len(self.byte_lengths), bool)
                self.added[list(tokens)] = True
                self.inner = {c for t in tokens.values() for c in t.content[1:]}

    def __call__(self, texts: list[str], spans: list[list[tuple[int, int]]]) -> list[tuple[np.ndarray, np.ndarray]]:
        if self.byte_lengths is None:
            return [self._by_offsets(t, s) for t, s in zip(texts, spans)]
        return [got or self._by_offsets(t, s) for got, t, s in zip(self._by_bytes(texts, spans), texts, spans)]

    def pairs(self, prompts: list[str], texts: list[str], spans) -> list[tuple[np.ndarray, np.ndarray]]:
        """As `self(texts, spans)` for preference pairs: texts[2k] and texts[2k + 1] (the chosen and the rejected
        conversation) share their prompt, prompts[k] (what comes before the answer, and the generation prompt), which
        is encoded once. The encoder finds the added (special) tokens of a text first and encodes the text between
        them piece by piece, so a text cut right after one encodes as its two parts' ids end to end: cut after the
        prompt's last added token (its ids say where), when no added token could run across the cut (the next
        character occurs in none after its first), the text starts with the prompt's part and the added tokens
        match as written (`self.added`). Any other text is encoded whole."""
        if self.added is None or not texts:
            return self(texts, spans)
        heads, pieces, piece_spans = [], [], []
        for k, ids in enumerate(encode(self.tokenizer, prompts, special=False)):
            cut = self._cut(prompts[k], np.asarray(ids, dtype=np.int64))
            for text, turns in ((texts[2 * k], spans[2 * k]), (texts[2 * k + 1], spans[2 * k + 1])):
                if cut is not None:
                    q, head = cut
                    if (text.startswith(prompts[k][:q]) and (q == len(text) or text[q] not in self.inner)
                            and all(s >= q for s, _ in turns)):
                        heads.append(head)
                        pieces.append(text[q:])
                        piece_spans.append([(s - q, e - q) for s, e in turns])
                        continue
                heads.append(None)
                pieces.append(text)
                piece_spans.append(turns)
        out = []
        for head, got, text, turns in zip(heads, self._by_bytes(pieces, piece_spans), texts, spans):
            if got is None:  # the bytes did not add up: the whole text, by its offsets
                out.append(self._by_offsets(text, turns))
            elif head is None:
                out.append(got)
            else:  # the prompt's tokens end before the answer starts: none carries a loss
                out.append((np.concatenate([head, got[0]]), np.concatenate([np.zeros(len(head), bool), got[1]])))
        return out

    def _cut(self, prompt: str, ids: np.ndarray) -> tuple[int, np.ndarray] | None:
        """(the character after the prompt's last added token, the ids up to it), or None where there is no such
        token or the prompt's bytes do not add up. The encoder chose that token before anything after it, so the
        ids up to it are those of the prompt's text up to it."""
        added = np.flatnonzero(self.added[ids])
        size = self.byte_lengths[ids]
        encoded = prompt.encode("utf-8")
        if not len(added) or int(size.sum()) != len(encoded):
            return None
        n = int(added[-1]) + 1
        q = int(size[:n].sum())
        return (q if len(encoded) == len(prompt) else len(encoded[:q].decode("utf-8"))), ids[:n]

    def _by_bytes(self, texts: list[str], spans) -> list[tuple[np.ndarray, np.ndarray] | None]:
        """(ids, mask) of each text from its tokens' bytes; None for a text whose bytes do not add up (or not in the
        tokenizer's normal form)."""
        if not texts:
            return []
        ids = encode(self.tokenizer, texts, special=False)
        counts = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(chain.from_iterable(ids), dtype=np.int64, count=int(counts.sum()))
        size = self.byte_lengths[flat]
        end = np.cumsum(size)
        start = end - size
        bounds = np.concatenate([[0], np.cumsum(counts)])
        text_end = np.concatenate([[0], end])[bounds]  # byte position where each text's tokens end
        exact, span_starts, span_ends = [], [], []
        for k, (text, turns) in enumerate(zip(texts, spans)):
            ascii_ = text.isascii()
            size_k = len(text) if ascii_ else len(text.encode("utf-8"))
            ok = text_end[k + 1] - text_end[k] == size_k and (
                self.normal_form is None or ascii_ or unicodedata.is_normalized(self.normal_form, text))
            exact.append(ok)
            if not ok:
                continue
            base = int(text_end[k])
            for s, e in turns:
                s, e = max(0, min(s, len(text))), max(0, min(e, len(text)))
                span_starts.append(base + (s if ascii_ else len(text[:s].encode("utf-8"))))
                span_ends.append(base + (e if ascii_ else len(text[:e].encode("utf-8"))))
        # Tokens' byte spans rise strictly, so those inside [s, e] are a run: from the first that starts at s or
        # later to the last that ends at e or before; marked by +1 and -1 and a running sum.
        first = np.searchsorted(start, span_starts, side="left")
        after = np.maximum(np.searchsorted(end, span_ends, side="right"), first)
        edges = np.zeros(len(flat) + 1, np.int32)
        np.add.at(edges, first, 1)
        np.add.at(edges, after, -1)
        mask = np.cumsum(edges[:-1]) > 0
        return [(flat[a:b], mask[a:b]) if ok else None
                for a, b, ok in zip(bounds[:-1].tolist(), bounds[1:].tolist(), exact)]

    def _by_offsets(self, text: str, turns: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        ((ids, offsets),) = encode_with_offsets(self.tokenizer, [text])
        return np.asarray(ids, dtype=np.int64), _inside(offsets, turns)


NORMAL_FORMS = {"NFC", "NFD", "NFKC", "NFKD"}
"""Normalizers that leave a text already in their form as it is (checked per text, `unicodedata.is_normalized`)."""
SPLITTING_PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits", "Punctuation"}
"""Pre-tokenizers that cut a text without changing it (ByteLevel maps each byte to a character of its alphabet)."""


def token_bytes(tokenizer) -> tuple[np.ndarray | None, str | None]:
    """(bytes of text each token id stands for, the normalizer's Unicode form or None) for a tokenizer whose token
    offsets are exactly the bytes its ids stand for: byte-level BPE (every vocabulary entry written in ByteLevel's
    256-character alphabet), no normalizer but a Unicode form, pre-tokenizers that only cut, no trimming of offsets
    (ByteLevel's and RoBERTa's post-processors trim spaces off them: GPT-2's own tokenizer does), no added token that
    strips spaces, no unknown token. (None, None) for any other tokenizer, which takes the offsets path."""
    import json

    from tokenizers.pre_tokenizers import ByteLevel

    backend = _backend(tokenizer)
    spec = json.loads(backend.to_str())
    model, normalizer, pre = spec.get("model") or {}, spec.get("normalizer"), spec.get("pre_tokenizer") or {}
    pres = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if (model.get("type") != "BPE" or model.get("byte_fallback") or model.get("dropout")
            or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix") or model.get("unk_token")
            or not any(p.get("type") == "ByteLevel" for p in pres)
            or not all(p.get("type") in SPLITTING_PRE_TOKENIZERS and not p.get("add_prefix_space") for p in pres)
            or (normalizer is not None and normalizer.get("type") not in NORMAL_FORMS)
            or '"trim_offsets": true' in json.dumps(spec.get("post_processor"))
            or any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens", []))):
        return None, None
    alphabet = set(ByteLevel.alphabet())
    vocab, added = backend.get_vocab(with_added_tokens=False), backend.get_added_tokens_decoder()
    lengths = np.full(max(chain(vocab.values(), added, [0])) + 1, 1 << 40, np.int64)  # an id of no token: never a
    for token, i in vocab.items():                                                     # text's length
        if not token or not alphabet.issuperset(token):
            return None, None
        lengths[i] = len(token)
    for i, token in added.items():
        if not token.content:
            return None, None
        lengths[i] = len(token.content.encode("utf-8"))
    return lengths, normalizer["type"] if normalizer else None


def _inside(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """For each token (its character span), whether it lies inside one of `spans` (and is not empty)."""
    if not offsets:
        return np.zeros(0, bool)
    o = np.fromiter(chain.from_iterable(offsets), dtype=np.int64, count=2 * len(offsets)).reshape(-1, 2)
    inside = np.zeros(len(o), bool)
    for s, e in spans:
        inside |= (o[:, 0] >= s) & (o[:, 1] <= e) & (o[:, 1] > o[:, 0])
    return inside
