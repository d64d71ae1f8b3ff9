"""Data files in the shapes users bring: encodings and stray bytes, JSON shapes, compressed files, each format's
rows that train nothing. Each ends in a run that works, or one message naming the file and line, the value and the
fix, exit status 2, the file untouched. One process each (`data prepare`, in-process): the fast tier.
"""

from __future__ import annotations

import gzip
import json
import math
import re
from pathlib import Path

import pytest
from conftest import cli, user_error

TEXT = "alice has a cat"
ROWS = "".join(json.dumps({"text": TEXT}) + "\n" for _ in range(4))
CHAT = json.dumps({"messages": [{"role": "user", "content": "alice has"}, {"role": "assistant", "content": "a cat"}]})
PAIR = json.dumps({"prompt": "alice has", "chosen": "a cat", "rejected": "a dog"})


def prepare(path: Path, fmt: str = "text", *more: str) -> list[str]:
    """`data prepare` of the quickstart recipe on one file: a batch of one sequence, nothing held out."""
    return ["data", "prepare", "quickstart", "--set", f"data.path={path}", "--set", f"data.format={fmt}",
            "--set", "training.micro_batch_size=1", "--set", "training.global_batch_size=1",
            "--set", "data.eval_fraction=0", *more]


def messages(*turns) -> str:
    return json.dumps({"messages": [{"role": role, "content": content} for role, content in turns]})


DPO = ("--set", "training.method=dpo", "--set", "data.seq_len=64")

# (case, file name, its bytes, format, recipe settings, what the message says)
MISTAKES = [
    # a JSON escape of half a surrogate pair is no character: the encoder raised TypeError (a traceback)
    ("lone-surrogate-jsonl", "d.jsonl", ROWS + '{"text": "alice \\ud800 has"}\n', "text", (),
     "line 5: field 'text' holds \\ud800, half of a UTF-16 surrogate pair"),
    ("lone-surrogate-in-a-chat-turn", "d.jsonl", CHAT + "\n" + CHAT.replace("a cat", "a \\udc00") + "\n", "chat", (),
     "line 2: field 'messages.1.content' holds \\udc00"),
    ("lone-surrogate-json-list", "d.json", "[\n" + ",\n".join([json.dumps({"text": TEXT})] * 3
                                                            + ['{"text": "a \\udbff b"}']) + "\n]", "text", (),
     "line 5: field 'text' holds \\udbff"),
    ("lone-surrogate-json-lines", "d.json", ROWS + '{"text": "a \\udc00 b"}\n', "text", (),
     "line 5: field 'text' holds \\udc00"),
    # NUL bytes: UTF-16 without its byte-order mark is UTF-8 to a decoder, and was read as text with a NUL every
    # other character; a NUL pasted into a CSV went to the tokenizer
    ("utf16-without-bom-txt", "d.txt", ((TEXT + "\n\n") * 3).encode("utf-16-le"), "text", (),
     ("line 1 holds a NUL byte (0x00 at column 2), every other byte; the file is probably UTF-16 without a "
     "byte-order mark")),
    ("utf16-without-bom-jsonl", "d.jsonl", ROWS.encode("utf-16-le"), "text", (), "probably UTF-16 without a"),
    ("nul-in-a-csv", "d.csv", "text\n" + (TEXT + "\n") * 3 + "ali\x00ce\n", "text", (),
     "line 5 holds a NUL byte (0x00 at column 4); text has none"),
    ("nul-in-a-jsonl", "d.jsonl", ROWS.encode() + b'{"text": "a\x00"}\n', "text", (),
     "line 5 holds a NUL byte (0x00 at column 12)"),
    # a .json list whose element is not a row: datasets said "'int' object is not iterable", no line
    ("json-list-element-a-number", "d.json", "[\n" + ",\n".join([json.dumps({"text": TEXT})] * 3 + ["3"]) + "\n]",
     "text", (), "line 5: element 4 of the list is a number, not an object (a row)"),
    ("json-list-element-a-string", "d.json", json.dumps([{"text": TEXT}, "alice"]), "text", (),
     "line 1: element 2 of the list is a string, not an object"),
    ("json-list-element-a-list", "d.json", json.dumps([{"text": TEXT}, [1]]), "text", (),
     "element 2 of the list is a list"),
    ("json-list-with-bom", "d.json", "\ufeff" + json.dumps([{"text": TEXT}, 3]), "text", (),
     "element 2 of the list is a number"),
    ("json-empty-list", "d.json", "[]", "text", (), "d.json): holds no rows"),
    # compressed files that are not whole
    ("gzip-not-gzip", "d.jsonl.gz", ROWS, "text", (), "cannot decompress it as gzip (BadGzipFile"),
    ("gzip-cut-short", "d.jsonl.gz", gzip.compress(ROWS.encode() * 500)[:-40], "text", (),
     "cannot decompress it as gzip (EOFError"),
    ("gzip-parquet", "d.parquet.gz", gzip.compress(b"PAR1"), "text", (), "unsupported file type '.parquet.gz'"),
    ("gzip-latin1", "d.txt.gz", gzip.compress("a\n\ncaf\u00e9\n".encode("latin-1")), "text", (),
     "line 3 is not UTF-8 (byte 0xe9 at column 4)"),
    # a file that is not text under a text file's name: its first bytes were "not UTF-8, probably Latin-1"
    ("gzip-named-jsonl", "d.jsonl", gzip.compress(ROWS.encode()), "text", (),
     "the file is gzip-compressed, not .jsonl text"),
    ("workbook-named-csv", "d.csv", b"PK\x03\x04" + bytes(40), "text", (), "the file is a zip archive (an .xlsx"),
    ("parquet-named-json", "d.json", b"PAR1" + bytes(40), "text", (), "the file is a Parquet file, not .json text"),
    ("jsonl-holding-an-indented-list", "d.jsonl", json.dumps([{"text": TEXT}] * 2, indent=2), "text", (),
     ("line 1: invalid JSON (Expecting value at column 1)\n    fix: the file looks like one JSON document over several "
     "lines (a list, or objects written with an indent): name it .json")),
    ("jsonl-holding-indented-objects", "d.jsonl", json.dumps({"text": TEXT}, indent=1), "text", (),
     "name it .json, or write one object per line"),
    ("jsonl-holding-a-list", "d.jsonl", json.dumps([{"text": TEXT}] * 2), "text", (), ("found a list\n    fix: the "
     "file looks like one JSON document")),
    ("jsonl-with-carriage-returns-alone", "d.jsonl", ROWS.replace("\n", "\r"), "text", (),
     "line 1: invalid JSON (Extra data at column 29)\n    fix: its lines end in a carriage return alone"),
    # rows one level down, columns split by another separator: the fix says so (it said: set text_field to them)
    ("json-one-object-holding-the-rows", "d.json", json.dumps({"data": [{"text": TEXT}] * 3}), "text", (),
     "its field 'data' holds the rows: write them one per line (.jsonl), or as the file's JSON list"),
    ("csv-separated-by-semicolons", "d.csv", f"text;id\n{TEXT};1\n", "text", (),
     "its first line looks separated by ';'"),
    # rows of another format than the recipe's: the fix names the format (it said: set text_field to a field)
    ("chat-rows-read-as-text", "d.jsonl", CHAT + "\n", "text", (),
     "has no field 'text' (its fields: messages)\n    fix: the rows look like chat data: set data.format: chat"),
    ("pairs-read-as-instructions", "d.jsonl", PAIR + "\n", "instruction", (),
     "the rows look like preference data: set data.format: preference"),
    ("a-dotted-field-name", "d.jsonl", json.dumps({"data": {"text": TEXT}}) + "\n", "text",
     ("--set", "data.text_field=data.text"), ("a field name is a key of the row, not a path into 'data': write the rows "
     "with the text at the top (e.g. jq -c '{text: .data.text}' FILE)")),
    # a message in another library's shape says which
    ("chat-sharegpt-turn-without-value", "d.jsonl", json.dumps({"conversations": [{"from": "human", "text": "a"},
                                                                {"from": "gpt", "value": "b"}]}) + "\n", "chat", (),
     "line 1: message 1 is ShareGPT's form without a value (its keys: from, text)"),
    ("chat-content-null", "d.jsonl", messages(("user", None), ("assistant", "a")) + "\n", "chat", (),
     "message 1 content is not text (null)"),
]


@pytest.mark.parametrize("case,name,content,fmt,settings,expected", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_data_file_users_bring_gets_one_message_naming_file_line_and_fix(tmp_path, case, name, content, fmt,
                                                                           settings, expected):
    path = tmp_path / name
    data = content.encode() if isinstance(content, str) else content
    path.write_bytes(data)
    msg = user_error(*prepare(path, fmt, *settings))
    assert expected in msg, msg
    assert str(path) in msg and "fix:" in msg and msg.count("error:") == 1, msg
    assert path.read_bytes() == data  # nothing the user had is changed


def _train_tables(output: str) -> dict[str, bytes]:
    folder = Path(re.findall(r"(/\S+/tokenized/\w+)", output)[-1])
    return {f.name: f.read_bytes() for f in sorted((folder / "train").iterdir()) if f.suffix == ".bin"}


@pytest.mark.parametrize("name,content", [
    ("stories.jsonl", ROWS + json.dumps({"text": "alice has a dog"}) + "\n"),
    ("stories.json", json.dumps([{"text": TEXT}, {"text": "alice has a dog"}])),
    ("stories.csv", f"text\n{TEXT}\nalice has a dog\n"),
    ("stories.txt", f"{TEXT}\n\nalice has a dog\n"),
], ids=["jsonl", "json", "csv", "txt"])
def test_a_gzip_compressed_file_reads_as_the_file_it_compresses(tmp_path, name, content):
    """name.jsonl.gz (and .json, .csv, .txt) is read as name.jsonl: the same tables, the source named `stories`."""
    plain = tmp_path / name
    plain.write_text(content)
    packed = tmp_path / "packed" / (name + ".gz")
    packed.parent.mkdir()
    packed.write_bytes(gzip.compress(content.encode()))
    code, out_plain = cli(*prepare(plain))
    assert code == 0, out_plain
    code, out_packed = cli(*prepare(packed))
    assert code == 0, out_packed
    assert f"stories (text, {packed})" in out_packed, out_packed
    assert _train_tables(out_packed) == _train_tables(out_plain)


def test_a_suffix_in_capitals_reads_as_its_type(tmp_path):
    """DATA.PARQUET is Parquet (it was opened as Parquet, then read line by line as JSON Lines), and a row of
    DATA.JSONL is named by its line."""
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    upper = tmp_path / "DATA.PARQUET"
    pq.write_table(pyarrow.table({"text": [TEXT] * 4}), upper)
    code, out = cli(*prepare(upper))
    assert code == 0 and "4 rows read" in out, out
    lines = tmp_path / "DATA.JSONL"
    lines.write_text(ROWS + '{"text": 3}\n')
    msg = user_error(*prepare(lines))
    assert "DATA.JSONL line 5: field 'text' is not text (int)" in msg, msg


def test_rows_that_teach_answering_nothing_are_warned_about_by_line(tmp_path):
    """An assistant turn without text (or a pair's prompt without text) trains the model to answer nothing, or answers
    to no question: most often a field named wrong or a conversation cut. Such rows are trained as they are (their
    tokens do not change) and named in a warning; before, nothing was said."""
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join([CHAT + "\n"] * 3 + [messages(("user", "alice"), ("assistant", " "), ("user", "has"),
                                                           ("assistant", "a cat")) + "\n"]))
    code, out = cli(*prepare(chat, "chat"))
    assert code == 0, out
    assert "warning: 1 rows (4) have an empty assistant turn (or only whitespace)" in out, out
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join([PAIR + "\n"] * 6 + [json.dumps({"prompt": "", "chosen": "a", "rejected": "b"}) + "\n"]
                             * 7))
    code, out = cli(*prepare(pairs, "preference", *DPO))
    assert code == 0, out
    assert "warning: 7 rows (7, 8, 9, 10, 11, ...) have an empty prompt, or an assistant turn" in out, out


@pytest.mark.parametrize("name,content", [
    ("d.txt", f"\ufeff{TEXT}\r\n\r\n{TEXT}\r\n"),
    ("d.jsonl", "\ufeff" + ROWS.replace("\n", "\r\n")),
    ("d.json", "\ufeff" + json.dumps([{"text": TEXT}] * 2)),
    ("d.csv", f"\ufefftext\r\n{TEXT}\r\n{TEXT}\r\n"),
], ids=["txt", "jsonl", "json", "csv"])
def test_a_byte_order_mark_and_crlf_line_ends_are_not_text(tmp_path, name, content):
    """A file saved by Windows tools: the mark is not the first example's first character (in a .txt file it was),
    and a CR is not part of any example."""
    from accel_fsdp.config.recipe import recipe_from_text
    from accel_fsdp.data.sources import SourceReader

    path = tmp_path / name
    path.write_bytes(content.encode())
    recipe = recipe_from_text(f"model: {{architecture: gpt2, tokenizer: 'builtin:quickstart'}}\n"
                              f"data: {{path: '{path}', format: text}}\n", source="r.yaml")
    reader = SourceReader(recipe, recipe.data.resolved_sources()[0], 0).open()
    texts = [row["text"] for _, rows in reader.batches(100) for row in rows]
    assert texts and all(text.strip() == TEXT and "\ufeff" not in text and "\r" not in text for text in texts), texts


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_train_on_a_gzip_compressed_corpus(tmp_path, tiny_gpt2, stories):
    """The ranks prepare and read a .jsonl.gz source as the single process does: a run of 2 CPU ranks trains on it and
    reports the source under the name of the file it compresses."""
    from conftest import read_metrics, run_cli, tiny_recipe

    packed = tmp_path / "stories.jsonl.gz"
    packed.write_bytes(gzip.compress(stories.read_bytes()))
    recipe = tiny_recipe(tmp_path / "r.yaml", tiny_gpt2, packed, training={"max_steps": 3})
    proc = run_cli("recipe", "run", recipe, "--output-dir", tmp_path / "run", check=0)
    assert "stories" in proc.stdout and str(packed) in proc.stdout, proc.stdout
    steps = [row for row in read_metrics(tmp_path / "run") if "loss" in row]
    assert [row["step"] for row in steps][-1] == 3 and all(math.isfinite(row["loss"]) for row in steps)


def _texts(path: Path, fmt: str = "text", field: str = "text") -> list:
    from accel_fsdp.config.recipe import recipe_from_text
    from accel_fsdp.data.sources import SourceReader

    recipe = recipe_from_text(f"model: {{architecture: gpt2, tokenizer: 'builtin:quickstart'}}\n"
                              f"data: {{path: '{path}', format: {fmt}}}\n", source="r.yaml")
    reader = SourceReader(recipe, recipe.data.resolved_sources()[0], 0).open()
    return [row[field] for _, rows in reader.batches(100) for row in rows]


def test_a_csv_cell_is_the_text_it_holds(tmp_path):
    """pandas made "NA", "None", "null" and "NaN" missing (a story of that text skipped as empty, an answer "None"
    refused as missing) and a column of numbers numbers (an answer "42" refused as not text, "1.50" read as 1.5)."""
    words = tmp_path / "words.csv"
    words.write_text("text\nNA\nNone\nnull\nNaN\nalice has a cat\n")
    assert _texts(words) == ["NA", "None", "null", "NaN", "alice has a cat"]
    answers = tmp_path / "answers.csv"
    answers.write_text("instruction,input,output\nhow many?,,42\nhow much?,,1.50\nwhich?,,None\n")
    assert _texts(answers, "instruction", "output") == ["42", "1.50", "None"]
    assert _texts(answers, "instruction", "input") == ["", "", ""]
    code, out = cli(*prepare(answers, "instruction"))
    assert code == 0 and "3 rows read; 3 train" in out, out


def test_a_txt_files_example_is_named_as_its_paragraph(tmp_path, monkeypatch):
    """An example of a .txt file is a paragraph: a message counts paragraphs, and says so (it said "row 2", which a
    person looks for as the second line)."""
    from accel_fsdp.data import sources

    monkeypatch.setattr(sources, "MAX_ROW_BYTES", 1000)
    path = tmp_path / "t.txt"
    path.write_text(f"{TEXT}\n{TEXT}\n\n" + "bob " * 400 + "\n")
    msg = user_error(*prepare(path))
    assert "t.txt): paragraph 2 holds 0 MiB of text, more than the 0 MiB a row may hold" in msg, msg


def test_a_mixture_names_the_source_whose_file_is_bad(tmp_path):
    """One source fine, the other holding a lone surrogate: the message names the second by its key and file."""
    good, bad = tmp_path / "good.jsonl.gz", tmp_path / "bad.jsonl"
    good.write_bytes(gzip.compress(ROWS.encode()))
    bad.write_text(ROWS + '{"text": "a \\ud800"}\n')
    recipe = tmp_path / "mix.yaml"
    recipe.write_text(f"model: {{architecture: gpt2, tokenizer: 'builtin:quickstart'}}\n"
                      f"data:\n  sources:\n    - {{path: '{good}', weight: 0.5}}\n"
                      f"    - {{path: '{bad}', weight: 0.5}}\n"
                      f"  eval_fraction: 0\ntraining: {{micro_batch_size: 1, global_batch_size: 1}}\n")
    msg = user_error("data", "prepare", recipe)
    assert f"mix.yaml:5: data.sources.1.path ({bad}): line 5: field 'text' holds \\ud800" in msg, msg


def test_many_rows_without_text_are_warned_about_by_row(tmp_path):
    """A .json list whose rows hold their text under two keys: datasets fills the missing one with null, so those rows
    read as empty and were skipped with a count alone. From 5% of the rows, a warning names them and the key."""
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"text": TEXT}] * 3 + [{"body": TEXT}] * 2))
    code, out = cli(*prepare(path))
    assert code == 0, out
    assert "warning: 2 of 5 rows (4, 5) have no text (the field empty, null, or missing from the row)" in out, out
    assert "data.text_field" in out
    few = tmp_path / "few.jsonl"
    few.write_text(ROWS * 10 + '{"text": ""}\n')
    code, out = cli(*prepare(few))
    assert code == 0 and "1 empty rows skipped" in out and "have no text" not in out, out


def test_a_folder_of_shards_is_named_with_what_it_holds(tmp_path):
    """A folder is not a source (HF-style data/train-0000N.jsonl shards): the message counts the data files in it
    and says how to give them."""
    shards = tmp_path / "my data"
    shards.mkdir()
    for k in range(3):
        (shards / f"train-{k:05d}.jsonl.gz").write_bytes(gzip.compress(ROWS.encode()))
    msg = user_error(*prepare(shards))
    assert "my data' is a folder, holding 3 data files (train-00000.jsonl.gz, ...)" in msg, msg
    assert "one entry of data.sources each" in msg
