"""Tokenizers a user brings that we did not make: each works, or ends in one message naming the file or key, the
value and the fix, exit status 2, before anything is tokenized. A tokenizer without an EOS token packed text
documents with nothing between them and ended no answer (silently); a slow tokenizer's files alone stopped with
transformers' half sentence. In-process; nothing launches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli, user_error

from accel_fsdp.data.sources import check_messages

WORDS = ("the", "cat", "is", "red", "alice", "has", "a", "dog", ".", "[UNK]")


def word_level(folder: Path, **special) -> Path:
    """A WordLevel tokenizer of a few words, with only the special tokens given (none: no EOS, no pad, no BOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", **special).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("command", ["validate", "prepare"])
def test_a_tokenizer_without_an_eos_token_is_refused_naming_the_file_to_set_it_in(tmp_path, command):
    folder = word_level(tmp_path / "tok")
    args = ["recipe", "validate"] if command == "validate" else ["data", "prepare"]
    message = user_error(*args, "quickstart", "--set", f"model.tokenizer={folder}")
    assert "model.tokenizer" in message and "has no EOS token" in message, message
    assert f'set "eos_token" in {folder}/tokenizer_config.json' in message, message


def test_the_eos_token_set_as_the_message_says_is_taken(tmp_path):
    from accel_fsdp.config.recipe import recipe_from_text
    from accel_fsdp.model.tokenizer import build_tokenizer

    folder = word_level(tmp_path / "tok")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "."}))
    recipe = recipe_from_text(f"model: {{architecture: gpt2, tokenizer: '{folder}'}}\n"
                              "data: {path: 'builtin:quickstart'}\n", source="r.yaml")
    tok = build_tokenizer(recipe)
    assert tok.eos_token == "." and tok.pad_token == "."


def test_a_slow_tokenizers_files_alone_are_named_with_the_line_that_loads_them(tmp_path):
    from tokenizers import Tokenizer, models

    folder = tmp_path / "gpt2-files"
    folder.mkdir()
    Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")])).model.save(str(folder))  # vocab.json, merges.txt
    message = user_error("recipe", "validate", "quickstart", "--set", f"model.tokenizer={folder}")
    assert "has vocab.json and merges.txt but no tokenizer.json or tokenizer_config.json" in message, message
    assert '{"tokenizer_class": "GPT2Tokenizer"}' in message, message


@pytest.mark.parametrize("content,said", [
    ("{}", "has a tokenizer.json that is not a tokenizer's (KeyError: 'added_tokens')"),
    ('{"version": "1.0", "added_tokens": [], "model": {"type": "Nonsense"}}',
     "has a tokenizer.json that is not a tokenizer's (Exception: data did not match any variant"),
], ids=["empty-object", "unknown-model"])
def test_a_tokenizer_json_that_is_json_but_no_tokenizer_is_named(tmp_path, content, said):
    """JSON that parses but is no tokenizer stopped with transformers' KeyError or the tokenizers library's bare
    Exception, and a traceback."""
    folder = word_level(tmp_path / "tok", eos_token=".")
    (folder / "tokenizer.json").write_text(content)
    message = user_error("recipe", "validate", "quickstart", "--set", f"model.tokenizer={folder}")
    assert f"model.tokenizer: '{folder}' {said}" in message and "restore the file" in message, message


@pytest.mark.parametrize("message,hint", [
    ({"role": "tool", "content": "42"}, ("message 2 has unknown role 'tool'; a tool's call and its result are not "
                                         "trained here")),
    ({"role": "user", "content": [{"type": "text", "text": "hi"}]},
     ("message 2 content is not text (a list); a list of content parts (OpenAI's form): write the text of its parts "
      "as one string")),
])
def test_openai_style_chat_rows_are_named_with_what_to_write_instead(message, hint):
    problem = check_messages([{"role": "user", "content": "hi"}, message, {"role": "assistant", "content": "ok"}])
    assert problem is not None and problem.startswith(hint), problem


# ---------------------------------------------------------------- special tokens the tokenizer writes itself

def test_an_eos_the_tokenizer_appends_itself_is_written_once_and_never_inside_a_prompt():
    """A tokenizer whose post-processor appends its EOS (Llama 2's and Mistral's with add_eos_token): a text document
    ended in two EOS tokens, and an Alpaca prompt, or a preference prompt without a template, in one before the
    answer."""
    from test_chat_masks import bpe, examples
    from tokenizers import processors

    from accel_fsdp.model.tokenizer import BPE_SPECIAL

    tok = bpe(BPE_SPECIAL, None)
    eos = tok.eos_token_id
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", eos)])
    assert tok("the cat")["input_ids"][-1] == eos  # the tokenizer writes it
    (text_ids, _), = examples(tok, "text", [{"text": "the cat is red"}])
    answered = examples(tok, "instruction", [{"instruction": "who ?", "output": "alice ."}])
    pair = examples(tok, "preference", [{"prompt": "who ?", "chosen": "alice .", "rejected": "bob ."}])
    assert text_ids.count(eos) == 1 and text_ids[-1] == eos
    for ids, mask in [*answered, *pair]:
        assert ids.count(eos) == 1 and ids[-1] == eos and mask[-1], tok.decode(ids)


# ------------------------------------------------------------------------------- chat templates that are broken

BROKEN_TEMPLATE = "{% for m in messages %}{{ m['content'] }{% endfor %}"
FAILING_TEMPLATE = "{% for m in messages %}{{ m['content'] + 1 }}{% endfor %}"  # a Python error inside it
REFUSING_TEMPLATE = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message is required') }}"
                     "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")


def prepare_one_conversation(tmp_path, template: str) -> None:
    """Tokenize a chat file of one conversation with the built-in tokenizer under `template`, as the ranks would."""
    from conftest import write_jsonl

    from accel_fsdp.config.recipe import recipe_from_text
    from accel_fsdp.data.prepare import prepare_data
    from accel_fsdp.data.synthetic import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = template
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                               {"role": "assistant", "content": "alice ."}]}])
    r = recipe_from_text(f"model: {{architecture: gpt2, tokenizer: 'builtin:quickstart'}}\n"
                         f"data: {{path: '{path}', format: chat}}\n"
                         "training: {micro_batch_size: 1, global_batch_size: 1}\n", source="r.yaml")
    prepare_data(r, tok)


def test_a_chat_template_that_is_not_jinja_is_named_as_the_tokenizers_not_a_rows(tmp_path):
    """It was reported as the first row's conversation that the template refuses, with the fix to change the row."""
    from accel_fsdp.errors import UserError

    with pytest.raises(UserError, match=r"model.tokenizer: the chat template of 'builtin:quickstart' is not valid "
                                        r"Jinja: unexpected '}' \(line 1\)"):
        prepare_one_conversation(tmp_path, BROKEN_TEMPLATE)


@pytest.mark.parametrize("template,said", [
    (BROKEN_TEMPLATE, "is not valid Jinja: unexpected '}'"),
    (REFUSING_TEMPLATE, "refuses a conversation of one user message: a system message is required"),
    (FAILING_TEMPLATE, "fails on a conversation of one user message: TypeError: can only concatenate str"),
], ids=["not-jinja", "refuses", "fails"])
def test_generate_chat_names_a_template_that_fails(tiny_gpt2, tmp_path, template, said):
    """Each stopped `generate --chat` with jinja's traceback."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_gpt2, folder)
    (folder / "chat_template.jinja").write_text(template)
    message = user_error("generate", folder, "--chat", "--prompt", "who has a cat ?", "--max-new-tokens", "2")
    assert f"--chat: the chat template of this model {said}" in message and "drop --chat" in message, message


def test_a_chat_template_that_fails_on_a_row_names_the_row_and_the_error(tmp_path):
    """A Python error inside the template (not jinja's own TemplateError) stopped the build with a traceback."""
    from accel_fsdp.errors import UserError

    with pytest.raises(UserError, match=r"chat.jsonl line 1: the chat template fails on this conversation \(TypeError: "
                                        r"can only concatenate str"):
        prepare_one_conversation(tmp_path, FAILING_TEMPLATE)


@pytest.mark.skipif(__import__("importlib").util.find_spec("sentencepiece") is not None,
                    reason="the case is a machine without the sentencepiece library")
@pytest.mark.parametrize("where", ["folder", "hub cache"])
def test_a_sentencepiece_tokenizer_without_its_library_names_the_library(tmp_path, where):
    """A Llama-2-style tokenizer (tokenizer.model alone) where sentencepiece is not installed: transformers falls back
    to tiktoken and names only tiktoken, and from the hub cache it read as a damaged copy to delete."""
    folder = (tmp_path / "hf" / "hub" / "models--org--sp" / "snapshots" / "abc") if where == "hub cache" else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizer", "eos_token": "</s>"}')
    (folder / "tokenizer.model").write_bytes(bytes(range(256)) * 4)  # never parsed: the library is missing
    if where == "hub cache":  # as a hub repository has it, with its model's config
        (folder / "config.json").write_text('{"model_type": "llama"}')
        (folder.parent.parent / "refs").mkdir()
        (folder.parent.parent / "refs" / "main").write_text("abc")
        proc = run_cli("recipe", "validate", "quickstart", "--set", "model.tokenizer=org/sp", cwd=tmp_path,
                       env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}, check=2)
        said, source = proc.stderr, "'org/sp'"
    else:
        said, source = user_error("recipe", "validate", "quickstart", "--set", f"model.tokenizer={folder}"), repr(str(folder))
    assert (f"model.tokenizer: {source} has a tokenizer that needs the sentencepiece library, which is not installed "
            "here\n    fix: pip install sentencepiece") in said, said
    assert "hub cache" not in said.split("fix:")[1] and "Traceback" not in said, said


@pytest.mark.parametrize("error,library", [
    (ModuleNotFoundError("No module named 'google.protobuf'", name="google.protobuf"), "protobuf"),  # not "google"
    (ModuleNotFoundError("No module named 'tiktoken'", name="tiktoken"), "tiktoken"),
    (ValueError("LlamaTokenizer requires the protobuf library but it was not found in your environment."), "protobuf"),
    (ValueError("a tokenizer.json without its keys"), None),
])
def test_the_library_a_tokenizer_needs_is_named_as_pip_installs_it(tmp_path, error, library):
    from accel_fsdp.model.tokenizer import missing_library

    assert missing_library(error, str(tmp_path)) == library
