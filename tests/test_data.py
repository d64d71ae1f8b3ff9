"""Data: loss masks, packing, the held-out split and the global batch order."""

from __future__ import annotations

import pytest
from conftest import write_jsonl

from accel_fsdp.config.recipe import recipe_from_text
from accel_fsdp.data.batches import GlobalBatchSampler, collate, label_count
from accel_fsdp.data.prepare import ALPACA_PROMPT, IGNORE_INDEX, _tokenize_batch, prepare_data, tokenize_example
from accel_fsdp.data.synthetic import build_tokenizer
from accel_fsdp.errors import UserError


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def recipe(fmt="text", path="builtin:quickstart", **data):
    extra = "".join(f"\n  {k}: {v}" for k, v in data.items())
    return recipe_from_text(f"""
model: {{architecture: gpt2, tokenizer: "builtin:quickstart"}}
data:
  path: "{path}"
  format: {fmt}{extra}
training: {{micro_batch_size: 2, global_batch_size: 4, max_steps: 3}}
""", source="r.yaml")


def test_text_labels_every_token(tok):
    ids, labels = tokenize_example(recipe(), tok, {"text": "alice has a red cat ."})
    assert ids == labels and ids[-1] == tok.eos_token_id


def test_instruction_masks_exactly_the_prompt(tok):
    r = recipe("instruction")
    row = {"instruction": "what color is the cat ?", "input": "alice has a red cat .", "output": "the cat is red ."}
    ids, labels = tokenize_example(r, tok, row)
    answer = tok("the cat is red .", add_special_tokens=False)["input_ids"]
    n_loss = sum(1 for x in labels if x != IGNORE_INDEX)
    assert n_loss == len(answer) + 1  # the answer and the end-of-turn token
    first = labels.index(next(x for x in labels if x != IGNORE_INDEX))
    assert all(x == IGNORE_INDEX for x in labels[:first])
    assert labels[first:first + len(answer)] == answer
    assert tok.decode(ids[:first]).endswith("<assistant>")


def test_instruction_without_chat_template_uses_the_alpaca_prompt(tiny_gpt2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_gpt2)
    tok.chat_template = None
    ids, labels = tokenize_example(recipe("instruction"), tok, {"instruction": "who has a cat ?", "input": "",
                                                                "output": "alice ."})
    prompt = tok(ALPACA_PROMPT.format(instruction="who has a cat ?"))["input_ids"]
    answer = tok("alice .", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ids == prompt + answer
    assert labels == [IGNORE_INDEX] * len(prompt) + answer


def test_chat_masks_everything_but_assistant_turns(tok):
    messages = [{"role": "system", "content": "you answer questions about stories ."},
                {"role": "user", "content": "alice has a red cat . who has a cat ?"},
                {"role": "assistant", "content": "alice has a red cat ."},
                {"role": "user", "content": "what color is the cat ?"},
                {"role": "assistant", "content": "the cat is red ."}]
    ids, labels = tokenize_example(recipe("chat"), tok, {"messages": messages})
    kept = [tok.convert_ids_to_tokens(i) for i, x in zip(ids, labels) if x != IGNORE_INDEX]
    assert " ".join(kept) == "alice has a red cat . <end> the cat is red . <end>"
    assert all(x in (IGNORE_INDEX, i) for i, x in zip(ids, labels))


def test_padding_is_masked_and_isolated(tok):
    x = IGNORE_INDEX  # rows as the data holds them: each document's first token carries no label
    rows = {"input_ids": [[5, 6, 7], [5, 6, 7, 8, 9]], "labels": [[x, 6, 7], [x, 6, 7, 8, 9]],
            "position_ids": [[0, 1, 2], [0, 1, 2, 3, 4]], "length": [3, 5]}
    batch = collate(rows, pad_id=0, use_position_ids=True, multiple_of=8)
    assert batch["input_ids"].shape == (2, 8)
    assert batch["labels"][0, 3:].tolist() == [IGNORE_INDEX] * 5  # padding never carries a loss
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]  # padding is its own document
    assert label_count(batch["labels"]) == 2 + 4
    with_mask = collate(rows, pad_id=0, use_position_ids=False, multiple_of=8)
    assert with_mask["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0, 0, 0], [1] * 5 + [0] * 3]


def test_packing_keeps_every_token_and_restarts_positions(tok):
    r = recipe(seq_len=16)
    rows = {"text": ["alice has a red cat .", "bob has a blue dog . the dog is happy .", "", "the end ."]}
    out = _tokenize_batch(r, tok, 16, tok.pad_token_id, True, rows)
    docs = [tokenize_example(r, tok, {"text": t})[0] for t in rows["text"] if t]
    packed = [i for seq, n in zip(out["input_ids"], out["length"]) for i in seq[:n]]
    assert packed == [i for d in docs for i in d]  # every token, in order
    assert all(len(seq) == 16 for seq in out["input_ids"])
    first = out["position_ids"][0]
    assert first[:len(docs[0])] == list(range(len(docs[0]))) and first[len(docs[0])] == 0
    assert sum(out["n_empty"]) == 1
    # No token predicts the first token of the next document: a packed row's loss is its documents' losses.
    labels = out["labels"][0]
    assert labels[0] == labels[len(docs[0])] == IGNORE_INDEX
    assert labels[1:len(docs[0])] == docs[0][1:]
    assert out["n_labels"] == [sum(1 for y in row if y != IGNORE_INDEX) for row in out["labels"]]


def test_builtin_packing_efficiency_is_reported_and_high(tok):
    data = prepare_data(recipe(seq_len=128), tok)
    assert data.stats.packed and data.stats.packing_efficiency >= 0.99
    assert data.stats.train_tokens == sum(data.train["length"])
    assert "packing efficiency" in data.stats.summary()
    again = prepare_data(recipe(seq_len=128), tok)
    assert again.train["input_ids"][:5] == data.train["input_ids"][:5]  # deterministic (and cached)
    assert len(data.eval) > 0 and data.stats.eval_rows == 1000  # 5% of 20,000 held out


def test_long_rows_are_truncated_and_counted_never_dropped(tmp_path, tok):
    path = write_jsonl(tmp_path / "long.jsonl", [{"instruction": "who ?", "output": "alice " * 40 + "."}] * 3
                       + [{"instruction": "who ?", "output": "bob ."}])
    r = recipe("instruction", str(path), seq_len=16, eval_fraction=0)
    data = prepare_data(r, tok)
    assert data.stats.truncated == 3 and len(data.train) == 4
    assert "3 examples longer than seq_len were truncated" in data.stats.summary()
    assert max(data.train["length"]) == 16


@pytest.mark.parametrize("rows,expected", [
    ([{"messages": [{"role": "robot", "content": "hi"}]}], "line 1: message 1 has unknown role 'robot'"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], "line 1: no assistant message, so nothing to learn"),
    ([{"messages": "hello"}], "line 1: messages must be a non-empty list"),
])
def test_bad_chat_rows(tmp_path, tok, rows, expected):
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    with pytest.raises(UserError) as e:
        prepare_data(recipe("chat", str(path)), tok)
    assert expected in e.value.format_message()


def test_chat_needs_a_template(tmp_path, tiny_gpt2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_gpt2)
    tok.chat_template = None
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "assistant", "content": "hi"}]}])
    with pytest.raises(UserError) as e:
        prepare_data(recipe("chat", str(path)), tok)
    assert "chat data needs a tokenizer with a chat template" in e.value.format_message()


def test_instruction_rows_need_their_fields(tmp_path, tok):
    path = write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "who ?", "response": "alice ."}])
    with pytest.raises(UserError) as e:
        prepare_data(recipe("instruction", str(path)), tok)
    msg = e.value.format_message()
    assert "data.output_field: " in msg and "has no field 'output' (its fields: instruction, response)" in msg


def test_global_batches_do_not_depend_on_the_number_of_ranks():
    """Step s reads the same rows whatever the world size: resuming on 1 rank what 2 started sees the same data."""
    def rows_of(world, micro):
        seen = []
        for step in range(12):
            step_rows = []
            for rank in range(world):
                s = GlobalBatchSampler(50, global_batch=8, micro_batch=micro, world_size=world, rank=rank, seed=3)
                step_rows += [r for mb in s.micro_batches(step) for r in mb]
            seen.append(sorted(step_rows))
        return seen

    two, one = rows_of(2, 2), rows_of(1, 4)
    assert two == one
    first_epoch = [r for step in two[:6] for r in step]  # 50 // 8 = 6 steps per epoch
    assert len(set(first_epoch)) == len(first_epoch) == 48  # no row twice within an epoch
    assert two[6] != two[0]  # epoch 2 is reshuffled
    s = GlobalBatchSampler(50, global_batch=8, micro_batch=2, world_size=2, rank=0, seed=3)
    assert s.accumulation_steps == 2 and s.position(7) == {"epoch": 1, "batch_in_epoch": 1, "rows_consumed": 56}
