"""The public datasets users fine-tune on, in the shapes they come in (ShareGPT, OpenAI chat, Alpaca, Dolly,
Anthropic's HH-RLHF, HuggingFaceH4/ultrafeedback_binarized, TRL's implicit prompts), read as TRL, axolotl and
LLaMA-Factory read them: each shape's tokens are those of the same rows written in the shape we always read, or the
row ends in one message naming the file and line. In-process (`data prepare`, ExampleTokenizer): the fast tier."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import cli, user_error, write_jsonl

from accel_fsdp.config.recipe import recipe_from_text
from accel_fsdp.data.encoder import encode, encode_opening
from accel_fsdp.data.shapes import implicit_prompt
from accel_fsdp.data.sources import SourceReader
from accel_fsdp.data.synthetic import build_tokenizer
from accel_fsdp.data.tokenize import ExampleTokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def examples(tok, fmt: str, rows: list[dict], **data) -> list[tuple[list[int], list[bool]]]:
    """(ids, loss mask) of each example of `rows`, through the code that reads a whole source."""
    extra = "".join(f"\n  {k}: {v}" for k, v in data.items())
    recipe = recipe_from_text(f"""
model: {{architecture: gpt2, tokenizer: "builtin:quickstart"}}
data:
  path: "builtin:quickstart"
  format: {fmt}{extra}
training: {{micro_batch_size: 2, global_batch_size: 4, max_steps: 3, method: {"dpo" if fmt == "preference" else "sft"}}}
""", source="r.yaml")
    source = recipe.data.resolved_sources()[0]
    reader = SourceReader(recipe, source, 0)
    out = ExampleTokenizer(tok, source, reader)(list(range(1, len(rows) + 1)), rows)
    assert not reader.problems, reader.problems
    return [(ex.ids.tolist(), (np.ones(len(ex.ids), bool) if ex.mask is None else ex.mask).tolist()) for ex in out]


def prepare(path: Path, fmt: str, *more: str) -> list[str]:
    """`data prepare` of the quickstart recipe on one file: a batch of one sequence, nothing held out."""
    method = ("--set", "training.method=dpo") if fmt == "preference" else ()
    return ["data", "prepare", "quickstart", "--set", f"data.path={path}", "--set", f"data.format={fmt}",
            "--set", "training.micro_batch_size=1", "--set", "training.global_batch_size=1",
            "--set", "data.eval_fraction=0", *method, *more]


def prepared_tokens(path: Path, fmt: str, *more: str) -> bytes:
    """The token and label tables `data prepare` wrote for one file (their bytes, as a run reads them)."""
    code, out = cli(*prepare(path, fmt, *more))
    assert code == 0, out
    entry = Path(out.split("tokens/s); ")[1].split()[0])
    return b"".join((entry / "train" / name).read_bytes() for name in ("tokens.bin", "labels.bin", "sequences.bin"))


def openai(*turns, **keys) -> list[dict]:
    return [{"role": role, "content": content, **keys} for role, content in turns]


def sharegpt(*turns) -> list[dict]:
    return [{"from": who, "value": value} for who, value in turns]


TURNS = (("system", "alice has a cat ."), ("user", "what does alice have ?"), ("assistant", "alice has a red cat ."))
SHAREGPT_TURNS = (("system", "alice has a cat ."), ("human", "what does alice have ?"),
                  ("gpt", "alice has a red cat ."))


# ------------------------------------------------------------------------------------------------ ShareGPT


@pytest.mark.parametrize("row", [
    {"conversations": sharegpt(*SHAREGPT_TURNS)},                                  # ShareGPT as published
    {"messages": sharegpt(*SHAREGPT_TURNS)},                                       # its messages in our field
    {"conversations": sharegpt(*((w.replace("human", "user").replace("gpt", "assistant"), v)
                                 for w, v in SHAREGPT_TURNS))},                    # from: user / assistant
    {"conversations": [{"from": w, "value": v, "weight": 1} for w, v in SHAREGPT_TURNS]},  # axolotl's weight key
    *({"conversations": sharegpt(*SHAREGPT_TURNS[:2], (bot, SHAREGPT_TURNS[2][1]))}  # raw dumps name the chatbot
      for bot in ("chatgpt", "bing", "bard")),
], ids=["conversations", "messages-field", "from-user-assistant", "extra-keys", "chatgpt", "bing", "bard"])
def test_sharegpt_conversations_read_as_the_same_openai_messages(tok, row):
    """role from `from` (human -> user, gpt -> assistant, system), content from `value`: the same tokens and mask as
    the conversation written with role and content."""
    assert examples(tok, "chat", [row]) == examples(tok, "chat", [{"messages": openai(*TURNS)}])


@pytest.mark.parametrize("who", ["function_call", "observation", "tool"])
def test_sharegpt_tool_turns_are_refused_as_tool_roles_are(tmp_path, who):
    path = write_jsonl(tmp_path / "sg.jsonl", [{"conversations": sharegpt(("human", "alice has"), (who, "a cat"),
                                                                          ("gpt", "a red cat ."))}])
    msg = user_error(*prepare(path, "chat"))
    assert (f"sg.jsonl line 1: message 2 has unknown role {who!r}; a tool's call and its result are not trained here"
            in msg), msg


def test_a_conversation_mixing_sharegpt_and_openai_messages_is_one_message_naming_the_line(tmp_path):
    rows = [{"conversations": sharegpt(("human", "alice has"), ("gpt", "a cat ."))}] * 2
    rows.append({"conversations": [{"from": "human", "value": "alice has"}, {"role": "assistant", "content": "a cat"}]})
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    msg = user_error(*prepare(path, "chat"))
    assert ("mixed.jsonl line 3: message 1 is ShareGPT's {from, value} form and message 2 is not (a conversation is "
            "read in one form)") in msg, msg
    assert msg.count("error:") == 1


def test_a_messages_field_the_user_named_is_not_replaced_by_conversations(tmp_path):
    path = write_jsonl(tmp_path / "sg.jsonl", [{"conversations": sharegpt(("human", "alice has"), ("gpt", "a cat"))}])
    msg = user_error(*prepare(path, "chat", "--set", "data.messages_field=dialog"))
    assert "sg.jsonl line 1: has no field 'dialog' (its fields: conversations)" in msg, msg


def test_sharegpt_preference_pairs_read_as_the_same_conversations(tok):
    """LLaMA-Factory's ShareGPT pairs: the conversation in `conversations`, one message as each answer."""
    row = {"conversations": sharegpt(("human", "what does alice have ?")),
           "chosen": {"from": "gpt", "value": "alice has a red cat ."},
           "rejected": {"from": "gpt", "value": "alice has a dog ."}}
    ours = {"prompt": openai(("user", "what does alice have ?")),
            "chosen": openai(("assistant", "alice has a red cat .")),
            "rejected": openai(("assistant", "alice has a dog ."))}
    assert examples(tok, "preference", [row]) == examples(tok, "preference", [ours])
    # and conversations of {from, value} messages as chosen and rejected (no prompt: TRL's implicit one)
    whole = {"chosen": sharegpt(("human", "what does alice have ?"), ("gpt", "alice has a red cat .")),
             "rejected": sharegpt(("human", "what does alice have ?"), ("gpt", "alice has a dog ."))}
    assert examples(tok, "preference", [whole]) == examples(tok, "preference", [ours])


# ------------------------------------------------------------------------------ implicit prompts (HH-RLHF)


@pytest.mark.parametrize("chosen,rejected,prompt", [
    ("The sky is blue.", "The sky is green.", "The sky is"),                       # TRL's own example
    ("\n\nHuman: hi\n\nAssistant: Sure thing", "\n\nHuman: hi\n\nAssistant: No", "\n\nHuman: hi\n\nAssistant:"),
    ("alice has a cat", "alice has a car", "alice has a ca"),                      # a shared answer start stays prompt
])
def test_implicit_prompt_is_trls_longest_common_prefix_less_its_last_space(chosen, rejected, prompt):
    start, problem = implicit_prompt(chosen, rejected)
    assert problem is None and chosen[:start] == prompt and rejected[:start] == prompt


def test_hh_rlhf_pairs_split_where_the_answers_part_and_no_chat_template_wraps_them(tok):
    """The built-in tokenizer has a chat template; like TRL for string pairs, it does not write these: the tokens are
    the prompt's (with the tokenizer's opening), then the answer and an EOS, the loss on the answer alone."""
    row = {"chosen": "alice has a cat . what does alice have ? alice has a red cat .",
           "rejected": "alice has a cat . what does alice have ? the dog ."}
    chosen, rejected = examples(tok, "preference", [row])
    (prompt,) = encode_opening(tok, ["alice has a cat . what does alice have ?"], [])
    for (ids, mask), answer in ((chosen, " alice has a red cat ."), (rejected, " the dog .")):
        (answer_ids,) = encode(tok, [answer], special=False)
        assert ids == prompt + answer_ids + [tok.eos_token_id]
        assert mask == [False] * len(prompt) + [True] * (len(answer_ids) + 1)


@pytest.mark.parametrize("chosen,rejected,says", [
    ("a red cat .", "the dog .", "share no text at their start, so no prompt can be read from them"),
    ("alice has a cat", "alice has a cat and a dog", "one is the start of the other"),
    ("alice has a cat", "alice has a cat", "are equal"),
])
def test_a_pair_without_prompt_whose_shared_start_is_empty_or_whole_is_refused(tmp_path, chosen, rejected, says):
    path = write_jsonl(tmp_path / "hh.jsonl", [{"chosen": chosen, "rejected": rejected}])
    msg = user_error(*prepare(path, "preference"))
    assert "hh.jsonl line 1: no field 'prompt', and chosen and rejected" in msg and says in msg, msg
    assert "give the prompt in a field of its own (data.prompt_field)" in msg


def test_a_prompt_field_the_user_named_is_read_as_named(tmp_path):
    path = write_jsonl(tmp_path / "hh.jsonl", [{"chosen": "alice has a cat", "rejected": "alice has a dog"}])
    msg = user_error(*prepare(path, "preference", "--set", "data.prompt_field=question"))
    assert "hh.jsonl line 1: has no field 'question' (its fields: chosen, rejected)" in msg, msg


# ---------------------------------------------------------------------- shapes that already worked, held


ULTRAFEEDBACK = {  # HuggingFaceH4/ultrafeedback_binarized's columns, as its train_prefs split holds them
    "prompt": "what does alice have ?", "prompt_id": "0f3a",
    "chosen": openai(("user", "what does alice have ?"), ("assistant", "alice has a red cat .")),
    "rejected": openai(("user", "what does alice have ?"), ("assistant", "alice has a dog .")),
    "messages": openai(("user", "what does alice have ?"), ("assistant", "alice has a red cat .")),
    "score_chosen": 8.5, "score_rejected": 3.0}


def test_ultrafeedback_binarized_and_trls_conversational_implicit_prompt_read_as_explicit_pairs(tok):
    explicit = {"prompt": openai(("user", "what does alice have ?")),
                "chosen": openai(("assistant", "alice has a red cat .")),
                "rejected": openai(("assistant", "alice has a dog ."))}
    implicit = {k: ULTRAFEEDBACK[k] for k in ("chosen", "rejected")}  # TRL's conversational implicit prompt
    assert examples(tok, "preference", [ULTRAFEEDBACK]) == examples(tok, "preference", [explicit])
    assert examples(tok, "preference", [implicit]) == examples(tok, "preference", [explicit])


def test_openai_messages_with_name_keys_read(tok):
    named = examples(tok, "chat", [{"messages": openai(*TURNS, name="alice")}])
    assert named == examples(tok, "chat", [{"messages": openai(*TURNS)}])  # the built-in template writes no name


def test_alpaca_and_dolly_rows_read_by_field_names(tok):
    alpaca = {"instruction": "what does alice have ?", "input": "alice has a cat .", "output": "a red cat ."}
    dolly = {"instruction": "what does alice have ?", "context": "alice has a cat .", "response": "a red cat .",
             "category": "closed_qa"}
    assert (examples(tok, "instruction", [dolly], input_field="context", output_field="response")
            == examples(tok, "instruction", [alpaca]))


def test_parquet_files_of_sharegpt_and_ultrafeedback_give_the_jsonl_files_tables(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name, fmt, row in (("sharegpt", "chat", {"conversations": sharegpt(*SHAREGPT_TURNS)}),
                           ("ultrafeedback", "preference", ULTRAFEEDBACK)):
        rows = [row] * 3
        jsonl = write_jsonl(tmp_path / f"{name}.jsonl", rows)
        parquet = tmp_path / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), parquet)
        assert prepared_tokens(parquet, fmt) == prepared_tokens(jsonl, fmt), name


@pytest.mark.parametrize("fmt,theirs,ours", [
    ("chat", {"conversations": sharegpt(*SHAREGPT_TURNS)}, {"messages": openai(*TURNS)}),
    ("preference", {"conversations": sharegpt(("human", "what does alice have ?")),
                    "chosen": {"from": "gpt", "value": "alice has a red cat ."},
                    "rejected": {"from": "gpt", "value": "alice has a dog ."}},
     {"prompt": openai(("user", "what does alice have ?")), "chosen": openai(("assistant", "alice has a red cat .")),
      "rejected": openai(("assistant", "alice has a dog ."))}),
], ids=["chat", "pairs"])
def test_a_bpe_tokenizer_learns_from_sharegpt_values_as_from_contents(tmp_path, fmt, theirs, ours):
    """`model.tokenizer: bpe:N` learns its vocabulary from the texts a model reads: ShareGPT's values are those."""
    bpe = ("--set", "model.tokenizer=bpe:300")
    assert (prepared_tokens(write_jsonl(tmp_path / "theirs.jsonl", [theirs] * 3), fmt, *bpe)
            == prepared_tokens(write_jsonl(tmp_path / "ours.jsonl", [ours] * 3), fmt, *bpe))


def test_sharegpt_rows_read_as_text_are_told_to_be_chat(tmp_path):
    path = write_jsonl(tmp_path / "sg.jsonl", [{"conversations": sharegpt(("human", "alice has"), ("gpt", "a cat"))}])
    msg = user_error(*prepare(path, "text"))
    assert "fix: the rows look like chat data: set data.format: chat" in msg, msg


def test_recipe_validate_reads_a_sharegpt_file(tmp_path):
    path = write_jsonl(tmp_path / "sg.jsonl", [{"conversations": sharegpt(*SHAREGPT_TURNS)}] * 4)
    code, out = cli("recipe", "validate", "quickstart", "--set", f"data.path={path}", "--set", "data.format=chat",
                    "--set", "training.micro_batch_size=1", "--set", "training.global_batch_size=2",
                    "--set", "data.eval_fraction=0")
    assert code == 0 and "data: sg (chat): 4 rows read" in out, out


def test_a_parquet_column_of_both_message_forms_reads_each_row_by_the_keys_it_fills(tmp_path):
    """Parquet gives every message of a column every key any message has (null where it had none): a ShareGPT row
    and an OpenAI row in one file read as the same conversation."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": sharegpt(*SHAREGPT_TURNS)}, {"messages": openai(*TURNS)}] * 2
    parquet = tmp_path / "both.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    assert pq.read_table(parquet).to_pylist()[0]["messages"][0]["role"] is None  # the shape this holds
    same = write_jsonl(tmp_path / "same.jsonl", [{"messages": openai(*TURNS)}] * 4)
    assert prepared_tokens(parquet, "chat") == prepared_tokens(same, "chat")


def test_a_sharegpt_pair_mixing_forms_names_its_conversations_column(tmp_path):
    row = {"conversations": [{"from": "human", "value": "alice has"}, {"role": "user", "content": "a cat"}],
           "chosen": {"from": "gpt", "value": "a red cat ."}, "rejected": {"from": "gpt", "value": "the dog ."}}
    msg = user_error(*prepare(write_jsonl(tmp_path / "sgp.jsonl", [row]), "preference"))
    assert "sgp.jsonl line 1: conversations: message 1 is ShareGPT's {from, value} form and message 2 is not" in msg
