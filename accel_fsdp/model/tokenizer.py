"""The recipe's tokenizer: built in, from a local folder, or from the hub (cache). Imports no torch: `recipe validate`
and the data checks before launch use it.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import re
from pathlib import Path

from accel_fsdp.data.identity import digest, trained_tokenizer_identity
from accel_fsdp.data.shapes import as_messages, chat_field, prompt_field
from accel_fsdp.data.sources import SourceReader
from accel_fsdp.data.synthetic import BUILTIN_TOKENIZER
from accel_fsdp.data.synthetic import build_tokenizer as builtin
from accel_fsdp.errors import Problem, UserError, first_line
from accel_fsdp.files import atomic_folder
from accel_fsdp.layout import cache_dir
from accel_fsdp.model.checks import damaged_json_file, hub_cache_remove, tokenizer_files_problem


def is_local(path: str | None) -> bool:
    return bool(path) and Path(path).expanduser().is_dir()


class NotOnThisMachine(Exception):
    """A hub tokenizer asked for with `local_files_only` that the hub cache does not hold."""


def build_tokenizer(recipe, *, local_files_only: bool = False):
    """The recipe's tokenizer, with a pad token (the EOS token when the tokenizer has none). `local_files_only`: a
    hub id is read from the hub cache alone, NotOnThisMachine when it is not there."""
    m = recipe.model
    source = m.tokenizer or m.name_or_path
    if source == BUILTIN_TOKENIZER:
        tokenizer = builtin()
    elif bpe_vocab_size(source) is not None:
        tokenizer = trained_tokenizer(recipe)
    elif source is None:
        raise UserError(Problem(recipe.where("model.tokenizer"), "a model built from scratch needs a tokenizer",
                                f"set model.tokenizer to a hub id, a local folder or {BUILTIN_TOKENIZER}"))
    else:
        key = "model.tokenizer" if m.tokenizer else "model.name_or_path"
        missing = tokenizer_files_problem(Path(source).expanduser()) if is_local(source) else None
        if missing:
            raise UserError(Problem(recipe.where(key), f"{source!r} {missing}",
                                    ("restore the file (save_pretrained writes it), or " if "damaged" in missing
                                     else "") + "set model.tokenizer to a folder or hub id with a tokenizer, or "
                                    "builtin:quickstart"))
        try:
            if is_local(source) and not m.trust_remote_code and plain_tokenizer_folder(Path(source).expanduser()):
                from transformers import PreTrainedTokenizerFast

                tokenizer = PreTrainedTokenizerFast.from_pretrained(source)
            else:
                from transformers import AutoTokenizer  # imports torch (see plain_tokenizer_folder)

                tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=m.trust_remote_code,
                                                          local_files_only=local_files_only)
        except Exception as e:  # noqa: BLE001 - OSError, ValueError; KeyError for a tokenizer.json without its keys,
            # the tokenizers library's bare Exception for one it cannot read ("did not match any variant")
            if local_files_only and isinstance(e, OSError) and not is_local(source):
                raise NotOnThisMachine(source) from None  # transformers' answer for files the cache lacks
            key = "model.tokenizer" if m.tokenizer else "model.name_or_path"
            library = missing_library(e, source)
            if library:
                raise UserError(Problem(recipe.where(key), f"{source!r} has a tokenizer that needs the {library} "
                                        "library, which is not installed here",
                                        f"pip install {library} (on every machine of the run), or give a tokenizer "
                                        "with a tokenizer.json")) from None
            damaged = damaged_json_file(Path(source).expanduser()) if is_local(source) else None
            if damaged:
                raise UserError(Problem(recipe.where(key), f"{source!r} has a damaged {damaged}",
                                        "restore the file (save_pretrained writes it), or set model.tokenizer to "
                                        "another folder, a hub id, or builtin:quickstart")) from None
            if (not isinstance(e, (OSError, ValueError)) and is_local(source)
                    and (Path(source).expanduser() / "tokenizer.json").is_file()):
                raise UserError(Problem(recipe.where(key), f"{source!r} has a tokenizer.json that is not a tokenizer's "
                                        f"({first_line(e, named=True)})", "restore the file (save_pretrained writes "
                                        "it), or give another folder, a hub id, or builtin:quickstart")) from None
            if not is_local(source) and not isinstance(e, OSError):  # the hub's files, damaged in this machine's cache
                raise UserError(Problem(recipe.where(key), f"the hub cache's copy of {source!r} is not a tokenizer "
                                        f"transformers can read ({first_line(e, named=True)})",
                                        f"delete it from the hub cache (`{hub_cache_remove(source)}`) and download it "
                                        "again, or "
                                        "update transformers for a newer tokenizer format")) from None
            raise UserError(Problem(recipe.where(key), f"cannot load a tokenizer from {source!r}: "
                                    f"{first_line(e, named=not isinstance(e, (OSError, ValueError)))}",
                                    "give a folder with tokenizer files, a hub id, or builtin:quickstart")) from None
    return with_pad_token(recipe, tokenizer)


# transformers' words for a library a tokenizer needs (transformers/utils/import_utils.py SENTENCEPIECE_IMPORT_ERROR
# and its kin; tokenization_utils_base's "`tiktoken` is required to read a `tiktoken` file").
_NEEDS = (re.compile(r"requires the (\w+) library but it was not found"), re.compile(r"`(\w+)` is required to read"))


PIP_NAMES = {"google": "protobuf", "sklearn": "scikit-learn", "yaml": "pyyaml"}
"""The package to install for a module a tokenizer's code imports, where the two names differ."""


def missing_library(error: BaseException, source: str) -> str | None:
    """The pip package a tokenizer failed for want of, or None. transformers falls back from a SentencePiece
    tokenizer.model to tiktoken and names only tiktoken, so a tokenizer.model without the sentencepiece library is
    named for what it is."""
    if isinstance(error, ModuleNotFoundError) and error.name:
        top = error.name.split(".")[0]
        return PIP_NAMES.get(top, top)
    named = next((m.group(1).lower() for m in (p.search(str(error)) for p in _NEEDS) if m), None)
    if named is None or importlib.util.find_spec(named) is not None:
        return None
    if importlib.util.find_spec("sentencepiece") is None and _has_file(source, "tokenizer.model"):
        return "sentencepiece"
    return named


def _has_file(source: str, name: str) -> bool:
    """Whether a local folder, or the hub cache's copy of a hub id, holds the file `name`."""
    if is_local(source):
        return (Path(source).expanduser() / name).is_file()
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(source, name), str)


def with_pad_token(recipe, tokenizer):
    """The tokenizer, refused when it has no EOS token, with the EOS token as its pad token when it has none. Every
    format needs the EOS: it ends each text document and each answer without a chat template (tokenize.py), and it is
    what stops generation; without it documents would run together and answers never end, silently. The pad token
    only fills batches: its positions carry no label and attend to nothing (data/batches.py `collate`)."""
    if tokenizer.eos_token_id is None:
        m = recipe.model
        source = m.tokenizer or m.name_or_path
        where = f"{source}/tokenizer_config.json" if is_local(source) else "its tokenizer_config.json"
        raise UserError(Problem(recipe.where("model.tokenizer" if m.tokenizer else "model.name_or_path"),
                                f"the tokenizer of {source!r} has no EOS token (eos_token is unset), so text "
                                "documents would run together and answers would never end",
                                f'set "eos_token" in {where} to the token that ends a text (one of its special '
                                "tokens, such as </s> or <|endoftext|>), or use another tokenizer"))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


PLAIN_TOKENIZER_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}
"""tokenizer_config.json's `tokenizer_class` of a tokenizer that is its tokenizer.json alone (what `accel-fsdp
tokenizer train` and `bpe:N` write)."""


def plain_tokenizer_folder(folder: Path) -> bool:
    """A folder of tokenizer files alone (no config.json, whose model type could choose another class), a
    tokenizer.json, and a tokenizer_config.json naming the plain class (`PLAIN_TOKENIZER_CLASSES`) and no code of its
    own (`auto_map`). AutoTokenizer loads such a folder as that class's `from_pretrained` (models/auto/
    tokenization_auto.py `AutoTokenizer.from_pretrained`: the model config falls back to an empty one, and
    `tokenizer_class` decides; checked with 5.24.0), but it imports every model configuration first, which imports
    torch (configuration_utils -> modeling_rope_utils): 1.1 to 1.4 s of `data prepare`'s start on 2 cores, saved by
    loading the class directly (tests/test_where_users_wait.py holds both equal)."""
    if (folder / "config.json").exists() or not (folder / "tokenizer.json").is_file():
        return False
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(config, dict) and config.get("tokenizer_class") in PLAIN_TOKENIZER_CLASSES
            and "auto_map" not in config)


def built_once_per_machine(recipe) -> bool:
    """Whether making the recipe's tokenizer writes to this machine's caches, so that its first rank makes it while
    the others wait (train/setup.py `describe_model`): a `bpe:N` tokenizer is trained, a hub tokenizer downloaded, a
    tokenizer with remote code has that code copied into transformers' module cache. The built-in tokenizer and a
    local folder's are only read: every rank loads its own at once."""
    m = recipe.model
    source = m.tokenizer or m.name_or_path
    if source == BUILTIN_TOKENIZER:
        return False
    return bpe_vocab_size(source) is not None or not is_local(source) or m.trust_remote_code


def offline_tokenizer(recipe):
    """The recipe's tokenizer if it is on this machine (built-in, a local folder, the hub cache), else None."""
    try:  # a cached copy it cannot read is named as a folder's would be, not taken for one not there
        return build_tokenizer(recipe, local_files_only=True)
    except NotOnThisMachine:
        return None


# ------------------------------------------------------------------------------- a tokenizer of the user's own text

BPE_PREFIX = "bpe:"
"""model.tokenizer: bpe:N trains a byte-level BPE tokenizer of N tokens on the recipe's data (cached)."""
BPE_SPECIAL = ("<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
BPE_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
BPE_MAX_EXAMPLES = 200_000
"""Examples the tokenizer is trained on (the first ones read): plenty for a vocabulary, bounded in time."""
BPE_VERSION = 2
"""2: preference sources are read (prompt, chosen, rejected); version 1 learned nothing from them."""


def bpe_vocab_size(source: str | None) -> int | None:
    """N of "bpe:N", or None when `source` is not a trained-tokenizer spec."""
    if not source or not source.startswith(BPE_PREFIX):
        return None
    text = source.removeprefix(BPE_PREFIX)
    return int(text) if text.isdigit() else -1


def trained_tokenizer(recipe, out_dir: Path | None = None):
    """The byte-level BPE tokenizer of the recipe's data: from the cache, else trained now (and cached, or written
    to `out_dir`). Byte-level: every text is covered, no <unk>."""
    from transformers import PreTrainedTokenizerFast

    vocab = bpe_vocab_size(recipe.model.tokenizer) or 8192
    folder = out_dir or _bpe_cache_folder(recipe, vocab)
    if out_dir is None and (folder / "tokenizer.json").exists():
        try:
            return PreTrainedTokenizerFast.from_pretrained(folder)
        except Exception:  # noqa: BLE001 - our cache entry, damaged since (JSONDecodeError, or the Rust
            pass  # library's bare Exception): trained again and replaced, never blamed on the user's data
    tokenizer = _train_bpe(recipe, vocab)
    with atomic_folder(folder) as temporary:  # a concurrent reader never sees half a tokenizer
        tokenizer.save_pretrained(temporary)
        if out_dir is not None:
            written = sorted(str(p.relative_to(temporary)) for p in temporary.rglob("*") if p.is_file())
            (temporary / TOKENIZER_MARKER).write_text(json.dumps({"files": written, "vocab_size": vocab}, indent=1))
    return PreTrainedTokenizerFast.from_pretrained(folder)


TOKENIZER_MARKER = "accel_fsdp_tokenizer.json"
"""In a folder `tokenizer train` wrote: the files it wrote. A rerun replaces such a folder whole (the same command
again, after it finished or was killed just after publishing), and never a folder holding anything else."""


def earlier_trained_tokenizer(folder: Path) -> bool:
    """`folder` is one `tokenizer train` wrote and holds nothing it did not write (its marker lists them)."""
    try:
        listed = set(json.loads((folder / TOKENIZER_MARKER).read_text())["files"]) | {TOKENIZER_MARKER}
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return all(str(p.relative_to(folder)) in listed for p in folder.rglob("*") if not p.is_dir())


def _bpe_cache_folder(recipe, vocab: int) -> Path:
    """Keyed by what the tokenizer learns from (data/identity.py: each source's identity, built-in data by its
    version, and the fields read) and how (BPE_VERSION, N)."""
    identity = trained_tokenizer_identity(recipe, vocab)
    return cache_dir() / "tokenizers" / f"bpe-{vocab}-{digest(BPE_VERSION, identity)}"


def _texts(recipe, limit: int):
    """The texts of the recipe's sources a tokenizer learns from: up to `limit` rows, shared out over the sources."""
    sources = recipe.data.resolved_sources()
    share = max(1, limit // len(sources))
    for i, source in enumerate(sources):
        reader = SourceReader(recipe, source, i).open()
        read = 0
        for _, rows in reader.batches(1000):
            for row in rows[:share - read]:
                yield from (v for v in _row_texts(row, source) if isinstance(v, str) and v)
            read += len(rows)
            if read >= share:
                break


def _row_texts(row: dict, source) -> list:
    """The texts of one row of a source, by its format: every field a model reads (prompts and answers alike)."""
    if source.format == "text":
        return [row.get(source.text_field)]
    if source.format == "instruction":
        return [row.get(source.instruction_field), row.get(source.input_field), row.get(source.output_field)]
    if source.format == "chat":
        fields = [row.get(chat_field(row, source))]
    else:  # preference: prompt, chosen and rejected, each a text or a conversation (or one message)
        prompt = prompt_field(row, source)
        fields = [row.get(prompt), row.get(source.chosen_field), row.get(source.rejected_field)]
    out = []
    for value in fields:
        value = [value] if isinstance(value, dict) else value
        if isinstance(value, list):
            messages = as_messages(value)[0] or []  # ShareGPT's {from, value} read as {role, content}
            out += [m.get("content") for m in messages if isinstance(m, dict)]
        else:
            out.append(value)
    return out


def _train_bpe(recipe, vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(BPE_SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = _texts(recipe, BPE_MAX_EXAMPLES)
    first = next(texts, None)
    if first is None:
        raise UserError(Problem(recipe.where("model.tokenizer"), f"{recipe.model.tokenizer}: the recipe's data has no "
                                "text to learn a vocabulary from (every row's fields are empty or missing)",
                                "check the data's field names (accel-fsdp data show), or use a pretrained tokenizer"))
    tok.train_from_iterator(itertools.chain([first], texts), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=BPE_SPECIAL[0], pad_token=BPE_SPECIAL[1],
                                        model_max_length=1 << 20)
    tokenizer.chat_template = BPE_CHAT_TEMPLATE
    return tokenizer
