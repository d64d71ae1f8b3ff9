"""Chat, instruction and preference examples: the fast encoder's ids and loss masks are those of the plain definition
(render the template once per turn boundary, tokenize the whole text with offsets, a token carries a loss when its
characters lie inside an assistant turn), on varied conversations and tokenizers."""

from __future__ import annotations

import random

import numpy as np
import pytest
from conftest import write_jsonl

from accel_fsdp.config.recipe import recipe_from_text
from accel_fsdp.data.prepare import prepare_data
from accel_fsdp.data.sources import SourceReader
from accel_fsdp.data.synthetic import build_tokenizer
from accel_fsdp.data.encoder import token_bytes
from accel_fsdp.data.tokenize import ExampleTokenizer
from accel_fsdp.errors import UserError
from accel_fsdp.model.tokenizer import BPE_CHAT_TEMPLATE, BPE_SPECIAL

LLAMA3_TEMPLATE = (  # Meta-Llama-3-8B-Instruct's, as published
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
LLAMA3_SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
REWRITING_TEMPLATE = (  # earlier assistant turns rendered shorter than the last: prefixes are not the text's start
    "{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ m['content'][:3] }}{% else %}{{ m['content'] }}{% endif %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
THINKING_TEMPLATE = (  # DeepSeek-R1's shape: the generation prompt opens a think block the rendered turns leave out
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<|end|>{% else %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|><think>\n"
    "{% endif %}")
GLUED_TEMPLATE = (  # the generation prompt ends in an added token, which a longer added token may run across
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")

WORDS = ("the", "cat", "is", "red", "alice", "naïve", "café", "中文", "ok", "🙂", "x=1;", "don't", "42", "...",
         "<|end|>", "e\u0301")  # the last: a decomposed é (not NFC)
PIECES = ("", " ", "  ", "\n", "\n\n", "\t", " \n ")


def text(rng: random.Random, longest: int = 12) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(0, longest))]
    return rng.choice(PIECES) + " ".join(words) + rng.choice(PIECES)


def conversation(rng: random.Random) -> list[dict]:
    messages = [{"role": "system", "content": text(rng)}] if rng.random() < 0.4 else []
    for _ in range(rng.randint(1, 4)):
        messages += [{"role": "user", "content": text(rng)}, {"role": "assistant", "content": text(rng)}]
    if rng.random() < 0.1:
        messages[-1]["name"] = "bot"  # a key beyond role and content: rendered by apply_chat_template itself
    if rng.random() < 0.15:
        messages = messages[1:] if messages[0]["role"] == "system" else messages
        messages = messages[1:]  # a conversation that starts with the assistant
    return messages


def bpe(special, template, pre_tokenizer=None, normalizer=None, post_processor=None, bos=None, rstrip=()):
    """A small byte-level BPE trained on the test's words, with the given special tokens and template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if normalizer is not None:
        tok.normalizer = normalizer
    if post_processor is not None:
        tok.post_processor = post_processor
    rng = random.Random(1)
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  special_tokens=[AddedToken(s, rstrip=s in rstrip, special=True) for s in special],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text(rng, 30) for _ in range(300)], trainer=trainer)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=special[0], bos_token=bos)
    out.chat_template = template
    return out


def tokenizers() -> dict:
    from tokenizers import Regex, pre_tokenizers, processors
    from tokenizers.normalizers import NFC

    return {
        "word-level (built-in)": lambda: build_tokenizer(),
        "byte-level BPE, the BPE template": lambda: bpe(BPE_SPECIAL, BPE_CHAT_TEMPLATE),
        "Llama-3 style": lambda: bpe(LLAMA3_SPECIAL, LLAMA3_TEMPLATE, bos="<|begin_of_text|>", pre_tokenizer=(
            pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])),
            post_processor=processors.ByteLevel(trim_offsets=False)),
        "ChatML, NFC (Qwen style)": lambda: bpe(CHATML_SPECIAL, CHATML_TEMPLATE, normalizer=NFC()),
        "ChatML, offsets trimmed (GPT-2's post-processor)": lambda: bpe(
            CHATML_SPECIAL, CHATML_TEMPLATE, post_processor=processors.ByteLevel(trim_offsets=True)),
        "an end token that strips spaces": lambda: bpe(BPE_SPECIAL, BPE_CHAT_TEMPLATE, rstrip=("<|end|>",)),
        "a template that rewrites earlier turns": lambda: bpe(BPE_SPECIAL, REWRITING_TEMPLATE),
        "an added token across the prompt's end": lambda: bpe(BPE_SPECIAL + ("<|assistant|>the",), GLUED_TEMPLATE),
        "a generation prompt the turns leave out": lambda: bpe(BPE_SPECIAL, THINKING_TEMPLATE),
    }


BYTE_PATH = {"byte-level BPE, the BPE template", "Llama-3 style", "ChatML, NFC (Qwen style)",
             "a template that rewrites earlier turns", "an added token across the prompt's end",
             "a generation prompt the turns leave out"}


@pytest.fixture(scope="module", params=list(tokenizers()))
def named_tokenizer(request):
    return request.param, tokenizers()[request.param]()


# ---------------------------------------------------------------------- the plain definition, written out


def reference_render(tok, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    text = tok.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = 0
        if i:
            prompt = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            history = tok.apply_chat_template(messages[:i], tokenize=False)
            start = len(prompt)
            if not text.startswith(prompt) and text.startswith(history):  # where the text and the prompt part
                start = len(history)
                while start < min(len(text), len(prompt)) and text[start] == prompt[start]:
                    start += 1
        upto = tok.apply_chat_template(messages[: i + 1], tokenize=False)
        spans.append((start, len(upto) if text.startswith(upto) else start + len(m["content"])))
    return text, spans


def reference_example(tok, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(s <= a and b <= e and b > a for s, e in spans) for a, b in enc["offset_mapping"]]
    return enc["input_ids"], mask


def examples(tok, fmt: str, rows: list[dict]):
    r = recipe_from_text(f"model: {{architecture: gpt2, tokenizer: 'builtin:quickstart'}}\n"
                         f"data: {{path: 'builtin:quickstart', format: {fmt}}}\n"
                         f"training: {{method: {'dpo' if fmt == 'preference' else 'sft'}}}\n", source="r.yaml")
    source = r.data.resolved_sources()[0]
    reader = SourceReader(r, source, 0)
    out = ExampleTokenizer(tok, source, reader)(list(range(1, len(rows) + 1)), rows)
    assert not reader.problems, reader.problems
    return [(ex.ids.tolist(), None if ex.mask is None else ex.mask.tolist()) for ex in out]


# ---------------------------------------------------------------------------------------------- the tests


def test_the_fast_path_is_taken_where_it_is_exact(named_tokenizer):
    name, tok = named_tokenizer
    assert (token_bytes(tok)[0] is not None) == (name in BYTE_PATH)


def test_chat_ids_and_masks_are_the_plain_definitions(named_tokenizer):
    name, tok = named_tokenizer
    rng = random.Random(0)
    conversations = [conversation(rng) for _ in range(150)]
    conversations = [m for m in conversations if any(x["role"] == "assistant" for x in m)]
    got = examples(tok, "chat", [{"messages": m} for m in conversations])
    want = [reference_example(tok, *reference_render(tok, m)) for m in conversations]
    assert got == want
    assert sum(sum(mask) for _, mask in got) > 0 and sum(len(ids) - sum(mask) for ids, mask in got) > 0


def test_instruction_ids_and_masks_are_the_plain_definitions(named_tokenizer):
    name, tok = named_tokenizer
    rng = random.Random(1)
    rows = [{"instruction": text(rng) + "?", "input": text(rng) if rng.random() < 0.5 else "",
             "output": text(rng) + "."} for _ in range(100)]
    got = examples(tok, "instruction", rows)
    want = []
    for row in rows:
        user = f"{row['instruction']}\n\n{row['input']}" if row["input"] else row["instruction"]
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]
        want.append(reference_example(tok, *reference_render(tok, messages)))
    assert got == want


def test_preference_ids_and_masks_are_the_plain_definitions(named_tokenizer):
    name, tok = named_tokenizer
    rng = random.Random(2)
    rows, pairs = [], []
    for k in range(100):
        shared = conversation(rng)[:-1] if k % 2 else [{"role": "user", "content": text(rng)}]
        if not shared or shared[-1]["role"] == "assistant":
            shared = shared + [{"role": "user", "content": text(rng)}]
        chosen, rejected = ("the " if k % 5 == 0 else "") + text(rng) + "yes", text(rng) + "no"
        if k % 2:
            rows.append({"chosen": shared + [{"role": "assistant", "content": chosen}],
                         "rejected": shared + [{"role": "assistant", "content": rejected}]})
        else:
            rows.append({"prompt": shared[0]["content"], "chosen": chosen, "rejected": rejected})
        pairs.append([shared + [{"role": "assistant", "content": a}] for a in (chosen, rejected)])
    got = examples(tok, "preference", rows)
    want = []
    for messages in (m for pair in pairs for m in pair):
        text_, spans = reference_render(tok, messages)
        want.append(reference_example(tok, text_, spans[-1:]))  # the answer: the last assistant turn
    assert got == want


@pytest.mark.parametrize("fmt", ["chat", "instruction", "preference"])
def test_an_answer_after_a_generation_prompt_the_turn_leaves_out_carries_a_loss_from_its_first_token(fmt):
    """DeepSeek-R1's template ends its generation prompt in "<think>\n", which its rendered assistant turns drop: the
    turn's start was taken at the end of that prompt, 8 characters into the answer, whose first tokens carried no
    loss."""
    tok = bpe(BPE_SPECIAL, THINKING_TEMPLATE)
    answer = "the cat is red ."
    user = [{"role": "user", "content": "who ?"}]
    row = {"chat": {"messages": [*user, {"role": "assistant", "content": answer}]},
           "instruction": {"instruction": "who ?", "output": answer},
           "preference": {"prompt": "who ?", "chosen": answer, "rejected": "no"}}[fmt]
    ids, mask = examples(tok, fmt, [row])[0]
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == answer + "<|end|>"


def test_a_conversation_the_template_refuses_is_named_by_line(tmp_path):
    tok = build_tokenizer()
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not "
                         "supported') }}{% endif %}{{ m['content'] }} {% endfor %}")
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "alice ."}]},
            {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "alice ."}]}]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    r = recipe_from_text(f"model: {{architecture: gpt2, tokenizer: 'builtin:quickstart'}}\n"
                         f"data: {{path: '{path}', format: chat}}\n"
                         "training: {micro_batch_size: 1, global_batch_size: 1}\n", source="r.yaml")
    with pytest.raises(UserError, match="chat.jsonl line 2: the chat template refuses this conversation: System role "
                                        "not supported"):
        prepare_data(r, tok)


def test_the_masks_are_computed_without_offsets_on_byte_level_tokenizers(monkeypatch):
    """The speed of the byte path is that it asks the encoder for no offsets: held here, so a change that quietly
    falls back to them everywhere fails."""
    import accel_fsdp.data.encoder as encoder

    tok = bpe(BPE_SPECIAL, BPE_CHAT_TEMPLATE)
    monkeypatch.setattr(encoder, "encode_with_offsets", lambda *a: pytest.fail("offsets asked for"))
    rng = random.Random(3)
    rows = [{"messages": [{"role": "user", "content": "the cat ?"}, {"role": "assistant", "content": text(rng) + "."}]}
            for _ in range(20)]
    got = examples(tok, "chat", rows)
    assert all(np.any(mask) for _, mask in got)


def test_a_preference_prompt_is_encoded_once(monkeypatch):
    import accel_fsdp.data.encoder as encoder

    tok, encoded = bpe(LLAMA3_SPECIAL, LLAMA3_TEMPLATE, bos="<|begin_of_text|>"), []
    real = encoder.encode
    monkeypatch.setattr(encoder, "encode", lambda tokenizer, texts, special: encoded.extend(texts) or real(
        tokenizer, texts, special=special))
    rows = [{"prompt": f"question {k} : who has a cat ?", "chosen": "alice .", "rejected": "bob ."} for k in range(8)]
    examples(tok, "preference", rows)
    for k in range(8):
        assert sum(f"question {k} :" in t for t in encoded) == 1


def test_conversation_pairs_without_a_chat_template_are_named_by_line(tmp_path):
    tok = build_tokenizer()
    tok.chat_template = None
    pair = {"chosen": [{"role": "user", "content": "who ?"}, {"role": "assistant", "content": "alice ."}],
            "rejected": [{"role": "user", "content": "who ?"}, {"role": "assistant", "content": "bob ."}]}
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "who ?", "chosen": "alice .", "rejected": "bob ."}, pair])
    r = recipe_from_text(f"model: {{architecture: gpt2, tokenizer: 'builtin:quickstart'}}\n"
                         f"data: {{path: '{path}', format: preference}}\n"
                         "training: {method: dpo, micro_batch_size: 1, global_batch_size: 1}\n", source="r.yaml")
    with pytest.raises(UserError, match="pairs.jsonl line 2: chosen and rejected are conversations, and the "
                                        "tokenizer has no chat template"):
        prepare_data(r, tok)
