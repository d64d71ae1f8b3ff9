"""Checks of the recipe against its model that need the model's structure but not its weights, on a `ModelView`:
built from the model facts (GPT-2, Llama: no torch, no transformers) or from the model built on the meta device
(everything else). The same checks run in `recipe validate`, before `recipe run` launches, and in every rank."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from accel_fsdp.config.recipe import ALL_LINEAR
from accel_fsdp.data.synthetic import BUILTIN_TOKENIZER
from accel_fsdp.errors import Problem, UserError, first_line
from accel_fsdp.layout import EXPORT_RECORD, FINAL_DIR, HF_DIR, MANIFEST, RUN_FILE
from accel_fsdp.model.facts import lora_targets
from accel_fsdp.model.quantize import QuantizedLayer, block_layers, layer_problems


@dataclass(frozen=True)
class ModelView:
    """What the checks, `recipe list` and the reports need to know of a model."""
    class_name: str
    no_split_modules: list[str]
    """The model's own block class(es): the default FSDP unit."""
    module_classes: frozenset[str]
    linear_names: frozenset[str]
    """Leaf names of its Linear/Conv1D modules: what LoRA can target."""
    context: int | None
    params: int
    """All parameters, LoRA adapters included when the recipe enables them."""
    trainable: int
    quantizable: tuple[QuantizedLayer, ...] = ()
    """The layers model.quantize would hold in 4 bits (those of one decoder block suffice for the checks); empty for
    a model whose layers model/facts.py does not know."""


def view_from_facts(facts, recipe) -> ModelView:
    lora = recipe.model.lora
    adapters = facts.lora_params(lora.target_modules, lora.r) if lora.enabled else 0
    params = facts.params() + adapters
    return ModelView(facts.class_name, facts.no_split_modules, facts.module_classes, facts.linear_names,
                     facts.context, params, adapters if lora.enabled else params, tuple(block_layers(facts)))


def context_problems(recipe, context: int | None) -> list[Problem]:
    """data.seq_len, and the sample generated at the end, must fit in the model's context (position embeddings /
    rotary range)."""
    out = []
    if context is not None and recipe.data.seq_len > context:
        out.append(Problem(recipe.where("data.seq_len"), f"{recipe.data.seq_len} exceeds the model's context length "
                           f"of {context} tokens", f"use at most {context}"))
    lg = recipe.logging
    if context is not None and lg.sample_prompt and lg.sample_max_new_tokens >= context:
        out.append(Problem(recipe.where("logging.sample_max_new_tokens"), f"{lg.sample_max_new_tokens} new tokens "
                           f"do not fit in the model's context of {context} tokens with the prompt",
                           f"use fewer than {context}"))
    return out


def override_problems(recipe, config_class: str, known: frozenset[str] | set[str], overrides: dict,
                      aliases: dict[str, str] | None = None) -> list[Problem]:
    """Every model.config_overrides key must be a setting of the model's config class: transformers would keep an
    unknown one as an inert attribute, so a typo (n_layers for n_layer) would silently train another model."""
    problems = []
    for alias, target in (aliases or {}).items():
        if alias in overrides and target in overrides:
            problems.append(Problem(recipe.where(f"model.config_overrides.{alias}"),
                                    f"{alias} and {target} are the same setting of {config_class}, given twice "
                                    f"({overrides[alias]!r} and {overrides[target]!r})", "keep one of them"))
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            problems.append(Problem(recipe.where(f"model.config_overrides.{key}"),
                                    f"{config_class} has no setting {key!r}, so it would be ignored",
                                    f"did you mean {close[0]}?" if close else
                                    f"use a key of {config_class} (see its documentation)"))
    return problems


def lora_target_problems(view: ModelView, recipe) -> list[Problem]:
    lora = recipe.model.lora
    missing = ([t for t in lora_targets(lora.target_modules, view.linear_names) if t not in view.linear_names]
               if lora.enabled else [])
    if not missing:
        return []
    return [Problem(recipe.where("model.lora.target_modules"), f"{', '.join(missing)} not found in {view.class_name}",
                    f"use some of its linear layers: {', '.join(sorted(view.linear_names))} (or {ALL_LINEAR}: all "
                    "of them but the output head)")]


def quantize_problems(view: ModelView, recipe, shards: int, *, remote_code: bool = False) -> list[Problem]:
    """model.quantize needs a model whose decoder layers we know (GPT-2, Llama: model/facts.py), and 4-bit weights
    that split evenly over the `shards` ranks of a shard group."""
    m = recipe.model
    if not m.quantize:
        return []
    where = recipe.where("model.quantize")
    if remote_code or not view.quantizable:
        blocks = ", ".join(view.no_split_modules) or view.class_name
        return [Problem(where, f"{m.quantize} quantizes the decoder layers of GPT-2 and Llama models (GPT2Block, "
                        f"LlamaDecoderLayer), and this model's are {blocks}{' (remote code)' if remote_code else ''}",
                        "leave model.quantize out (LoRA on a base in the compute dtype), or use a GPT-2 or Llama "
                        "model")]
    return layer_problems(list(view.quantizable), shards, where)


HUB_LOGIN = "hf auth login"
"""The hub's own CLI as the fixes name it: huggingface_hub's `hf` (2.x; `huggingface-cli` is gone since 1.0, and `hf
cache` removes with `rm`). tests/test_hub_commands_named_exist.py parses each command with that CLI."""


def hub_download(repo: str, kind: str = "model") -> str:
    """The command that downloads a hub repository into this machine's hub cache."""
    return f"hf download {'--repo-type dataset ' if kind == 'dataset' else ''}{repo}"


def hub_cache_remove(repo: str, kind: str = "model") -> str:
    """The command that removes a hub repository's copy from this machine's hub cache."""
    return f"hf cache rm {kind}/{repo}"


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt", "tiktoken.model")


TOKENIZER_JSON = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")
"""The small JSON files of a tokenizer folder, parsed whole by the check; tokenizer.json (megabytes) is only
looked at where it starts."""


def tokenizer_files_problem(folder: Path) -> str | None:
    """A local folder without any vocabulary file: transformers 5 would build an empty tokenizer from it silently
    (one token, every text encoded as nothing; checked with 5.23.0). A JSON file of it that is empty or not JSON: the
    loader's own message ("Expecting value: line 1 column 1") does not say which file."""
    import json

    folder = Path(folder)
    if not folder.is_dir():
        return None
    if not any((folder / name).exists() for name in TOKENIZER_FILES):
        return f"has no tokenizer files (none of {', '.join(TOKENIZER_FILES)})"
    if not any((folder / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "config.json")):
        # Files of a "slow" tokenizer alone: AutoTokenizer has nothing to choose its class by, and fails with
        # "Couldn't instantiate the backend tokenizer" (tokenization_auto.py; checked with 5.24.0).
        present = " and ".join(name for name in (*TOKENIZER_FILES, "merges.txt") if (folder / name).exists())
        gpt2 = (folder / "vocab.json").exists() and (folder / "merges.txt").exists()
        return (f"has {present} but no tokenizer.json or tokenizer_config.json, so which tokenizer they make is "
                "unknown (" + ('GPT-2\'s vocab.json and merges.txt: write {"tokenizer_class": "GPT2Tokenizer"} into '
                              "tokenizer_config.json" if gpt2 else "save the tokenizer with save_pretrained, which "
                              "writes both") + ")")
    for name in TOKENIZER_JSON:
        try:
            if (folder / name).exists() and not isinstance(json.loads((folder / name).read_text()), dict):
                return f"has a damaged {name} (not a JSON object)"
        except (OSError, UnicodeDecodeError, ValueError) as e:
            return f"has a damaged {name} ({first_line(e, 120, named=True)})"
    if (folder / "tokenizer.json").is_file():
        with open(folder / "tokenizer.json", "rb") as f:
            start = f.read(64).lstrip()
        if not start.startswith(b"{"):
            return "has a damaged tokenizer.json (" + ("empty" if not start else "not a JSON object") + ")"
    return None


def damaged_json_file(folder: Path) -> str | None:
    """The first JSON file of `folder` that does not parse, with why: asked after a tokenizer failed to load (each
    file read whole, which the check before loading spares tokenizer.json), so that the message names the file."""
    import json

    for path in sorted(Path(folder).glob("*.json")):
        try:
            json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            return f"{path.name} ({first_line(e, 120, named=True)})"
    return None


def raise_problems(problems: list[Problem]) -> None:
    if problems:
        raise UserError(problems)


def human_count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}" if n < 10 * div else f"{n / div:.1f}{unit}"
    return str(n)


# ------------------------------------------------------------------------------------ where the model comes from

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def looks_like_path(name: str) -> bool:
    """A name meant as a local path, not a hub id (owner/name): it starts like a path, has a file extension, or has
    more than one slash."""
    import re

    return (name.startswith(("/", "./", "../", "~")) or name.count("/") > 1
            or bool(re.search(r"\.(bin|json|safetensors|pt|pth|model|txt|yaml)$", name)))


def source_problems(recipe) -> list[Problem]:
    """model.name_or_path and model.tokenizer, before anything loads them: a path that does not exist or is a file,
    a model folder without a usable config.json or with missing or truncated weights, an unknown built-in."""
    m = recipe.model
    out: list[Problem] = []
    for key, name in (("model.name_or_path", m.name_or_path), ("model.tokenizer", m.tokenizer)):
        if not name or (key == "model.tokenizer" and name.startswith("bpe:")):
            continue
        where = recipe.where(key)
        if name.startswith("builtin:"):
            if key == "model.name_or_path" or name != BUILTIN_TOKENIZER:
                out.append(Problem(where, f"unknown built-in {name!r}",
                                   f"the built-in tokenizer is {BUILTIN_TOKENIZER}" +
                                   ("; a model built from scratch is model.architecture" if key.endswith("path")
                                    else "")))
            continue
        path = Path(name).expanduser()
        if path.is_file():
            out.append(Problem(where, f"{name!r} is a file",
                               "give the folder that holds it (a save_pretrained folder)"))
        elif not path.exists() and looks_like_path(name):
            out.append(Problem(where, f"folder {name!r} does not exist", "check the path (relative paths start at the "
                               "working directory), or give a hub id such as owner/name"))
        elif path.is_dir() and key == "model.name_or_path":
            out += model_folder_problems(where, path)
    return out


def weights_header_folder(recipe) -> Path | None:
    """The recipe's model folder when its weight files say every tensor's name and shape without their data being
    read, else None: safetensors files (their headers), or pytorch_model*.bin files in torch.save's zip format (their
    pickle alone: torch.load onto the meta device makes storages without reading them, torch/serialization.py
    `_load`, `is_meta_map_location`; torch 2.13.0). A .bin of the legacy (pre-1.6) format is read whole by any load:
    left to the run."""
    import zipfile

    m = recipe.model
    folder = Path(m.name_or_path or "").expanduser()
    if m.architecture or not m.name_or_path or not folder.is_dir():
        return None
    if any(folder.glob("*.safetensors")):
        return folder
    bins = sorted(folder.glob("pytorch_model*.bin"))
    return folder if bins and all(zipfile.is_zipfile(b) for b in bins) else None


def model_folder_problems(where: str, folder: Path) -> list[Problem]:
    """What makes a local model folder unloadable, read without torch or transformers: config.json missing, not a
    JSON object, without a model_type, with a size that is not a positive whole number (transformers 5 would stop
    with its own traceback, from whichever reader of config.json comes first: the tokenizer's, the config's); weight
    files missing, cut short or not of their format. `recipe validate`, the launch and `generate` read a folder
    through here, so each names the same file with the same words."""
    import json

    config = folder / "config.json"
    if not config.is_file():
        return [not_a_model_folder(where, folder)]
    try:
        values = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return [Problem(where, f"{config} is not valid JSON ({type(e).__name__})", "restore the file")]
    if not isinstance(values, dict) or not values.get("model_type") or not isinstance(values["model_type"], str):
        return [Problem(where, f"{config} names no model_type", "restore the file (save_pretrained writes it)")]
    bad = [f"{key} is {values[key]!r}" for key in SIZE_KEYS if values.get(key) is not None
           and (isinstance(values[key], bool) or not isinstance(values[key], int) or values[key] < 1)]
    if bad:
        return [Problem(where, f"{config}: {', '.join(bad)}, not a positive whole number",
                        "restore the file (save_pretrained writes it), or correct the value")]
    wrong_id = token_id_problem(config, values, values.get("vocab_size"))
    if wrong_id:  # transformers 5 stopped on a type ("Validation error for field"), blamed on the tokenizer
        return [Problem(where, wrong_id, "restore the file (save_pretrained writes it), or correct the value")]
    generation = generation_config_problem(folder, values.get("vocab_size"))
    if generation:
        return [Problem(where, generation, "restore the file (save_pretrained writes it), correct the value, or "
                        "delete generation_config.json (transformers' defaults are used then)")]
    present = [name for name in WEIGHT_FILES if (folder / name).is_file()]
    if not present and folder.name == HF_DIR and (folder.parent / MANIFEST).is_file():
        return [not_a_model_folder(where, folder.parent)]  # a checkpoint's config and tokenizer, without its weights
    if not present:
        return [Problem(where, f"folder {str(folder)!r} has no weights (none of {', '.join(WEIGHT_FILES)})",
                        "copy the weight files into it, or use model.architecture to train from scratch")]
    broken = [f"{p.name} ({why})" for p in _weight_shards(folder, present[0]) if (why := _damaged(p))]
    if broken:
        return [Problem(where, f"damaged weights: {', '.join(broken[:3])}", "download or export the model again")]
    return []


GENERATION_TOKEN_KEYS = ("eos_token_id", "bos_token_id", "pad_token_id")
"""Token ids of generation_config.json that generate uses; a pad id is only checked for its type (some published
models write -1, and `accel-fsdp generate` passes its own)."""


def generation_config_problem(folder: Path, vocab_size) -> str | None:
    """What is wrong with a model folder's generation_config.json, or None. transformers reads it as the model loads
    and, when it does not parse, drops it with a log line (modeling_utils.py `from_pretrained`: the defaults, so an
    eos_token_id list such as Llama 3 Instruct's is lost and generation never stops; checked with 5.24.0); a token
    id that is not a whole number stops `generate` with a traceback deep in generation/utils.py
    (`_tensor_or_none`), one past the vocabulary never comes. Read as JSON alone (no transformers: the checks before a
    launch import none)."""
    import json

    path = folder / "generation_config.json"
    if not path.is_file():
        return None
    try:
        values = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"{path} is damaged ({first_line(e, 120, named=True)})"
    if not isinstance(values, dict):
        return f"{path} is damaged (not a JSON object)"
    return token_id_problem(path, values, vocab_size)


def token_id_problem(path: Path, values: dict, vocab_size) -> str | None:
    """A special token's id in config.json or generation_config.json (`values`, read from `path`) that is not a
    whole number, or (EOS, BOS) not an id of the vocabulary, or None."""
    for key in GENERATION_TOKEN_KEYS:
        value = values.get(key)
        ids = value if isinstance(value, list) else [value]
        whole = all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        if value is None or (whole and (key == "pad_token_id" or all(
                0 <= i and not (isinstance(vocab_size, int) and i >= vocab_size) for i in ids))):
            continue
        within = f" from 0 to {vocab_size - 1}" if isinstance(vocab_size, int) else ""
        return f"{path}: {key} is {value!r}, not a token id{within} (or a list of them)"
    return None


def not_a_model_folder(where: str, folder: Path) -> Problem:
    """A folder without config.json, named for what it is, with the command that makes a model folder from it: what
    accel-fsdp writes in a chain of runs (SFT, then DPO from it) is a run folder, a checkpoint, a LoRA adapter; each
    needs a different next step, and "not a Hugging Face model folder" alone left the user to guess which."""
    named = "" if Path(where) == folder else f"folder {str(folder)!r} "  # the message names it once
    final = folder / FINAL_DIR
    if (folder / "adapter_config.json").is_file():
        merged = folder / "merged"
        if (merged / "config.json").is_file():
            fix = f"use {str(merged)!r}: this adapter merged into its base"
        else:
            source = _exported_from(folder) or "RUN"
            fix = (f"merge it into its base with `accel-fsdp checkpoint consolidate {source} OUT --merge` and use "
                   "OUT/merged; or train on its base model (adapter_config.json's base_model_name_or_path)")
        return Problem(where, f"{named}holds a LoRA adapter (adapter_config.json), not a whole model", fix)
    if (folder / MANIFEST).is_file():
        return Problem(where, f"{named}is a training checkpoint (sharded state, no config.json), not a model folder",
                       f"export it with `accel-fsdp checkpoint consolidate {folder} OUT` (add --merge for a LoRA "
                       "run) and use OUT")
    if (folder / RUN_FILE).is_file() or final.is_dir():
        if (final / "config.json").is_file():
            fix = f"use its exported model, {str(final)!r}"
        else:
            fix = (f"export its newest checkpoint with `accel-fsdp checkpoint consolidate {folder} OUT` (add --merge "
                   "for a LoRA run) and use OUT (OUT/merged with --merge)")
        return Problem(where, f"{named}is a run folder, not a model folder", fix)
    if folder.is_file():  # a weights file or the data given for the folder: "has no config.json" misread it
        file_named = f"{str(folder)!r} " if named else ""
        return Problem(where, f"{file_named}is a file, not a model folder",
                       "give the folder that holds config.json (written by save_pretrained or `accel-fsdp checkpoint "
                       "consolidate`), or a hub id")
    return Problem(where, f"{named}has no config.json, so it is not a Hugging Face model folder",
                   "point it at a folder written by save_pretrained (or `accel-fsdp checkpoint consolidate`), or at a "
                   "hub id")


def _exported_from(folder: Path) -> str | None:
    """The checkpoint an export of ours was made from (its EXPORT_RECORD), when the record says and it still exists."""
    import json

    try:
        checkpoint = json.loads((folder / EXPORT_RECORD).read_text()).get("checkpoint")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return None
    return checkpoint if isinstance(checkpoint, str) and Path(checkpoint).is_dir() else None


def _weight_shards(folder: Path, name: str) -> list[Path]:
    import json

    if not name.endswith(".index.json"):
        return [folder / name]
    try:
        index = json.loads((folder / name).read_text())
        return [folder / shard for shard in sorted(set(index["weight_map"].values()))]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return [folder / name]


def _damaged(path: Path) -> str | None:
    """Why a weight file cannot be complete (missing; a safetensors file shorter than its own header says)."""
    import json
    import struct

    if not path.is_file():
        return "missing"
    if path.name.endswith(".index.json"):
        return "unreadable index"
    if path.suffix == ".bin":
        return _torch_file_damage(path)
    if path.suffix != ".safetensors":
        return None
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100_000_000:
                return "not a safetensors file"
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, struct.error, KeyError, TypeError):
        return "not a safetensors file"
    if path.stat().st_size < 8 + n + end:
        return f"truncated: {path.stat().st_size:,} of {8 + n + end:,} bytes"
    return None


def _torch_file_damage(path: Path) -> str | None:
    """Why a pytorch_model.bin cannot be what torch.save wrote: since torch 1.6 a zip archive (torch/serialization.py
    `_save`, `_use_new_zipfile_serialization`), whose directory is at its end (so a file cut short has none), before
    that a pickle (its protocol byte 0x80 first). Reads the first byte and the directory, not the weights."""
    import zipfile

    try:
        with open(path, "rb") as f:
            first = f.read(1)
        if zipfile.is_zipfile(path):
            return None
    except OSError as e:
        return f"unreadable: {type(e).__name__}"
    return None if first == b"\x80" else "not a complete file torch.save wrote (cut short, or another format)"


# transformers.activations.ACT2FN's names (5.23.0; tests/test_model_facts.py compares): kept here so that checking a
# recipe does not import torch.
ACTIVATIONS = ("gelu", "gelu_10", "gelu_accurate", "gelu_fast", "gelu_new", "gelu_python", "gelu_python_tanh",
               "gelu_pytorch_tanh", "hardswish", "laplace", "leaky_relu", "linear", "mish", "prelu", "quick_gelu",
               "relu", "relu2", "relu6", "sigmoid", "silu", "sqrtsoftplus", "swish", "tanh", "xielu")
ACTIVATION_KEYS = ("activation_function", "hidden_act")  # GPT-2, Llama


MAX_PARAMETERS = 10**13
"""Ten trillion: no checkpoint this tool could train or hold is larger; above it a size is a typo."""

# Config keys that count something (layers, heads, widths, positions, tokens): whole numbers above zero.
SIZE_KEYS = ("n_layer", "num_hidden_layers", "n_embd", "hidden_size", "n_head", "num_attention_heads",
             "num_key_value_heads", "n_positions", "max_position_embeddings", "vocab_size", "n_inner",
             "intermediate_size", "head_dim", "n_ctx")


def override_value_problems(recipe) -> list[Problem]:
    """Sizes in model.config_overrides that are not positive whole numbers (2.5 layers, true heads, 0 heads):
    transformers would truncate, divide by zero, or build something else than asked."""
    out = []
    for key in SIZE_KEYS:
        value = recipe.model.config_overrides.get(key)
        if not isinstance(value, (int, float)):  # absent, or text: the type check of the facts names it
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            out.append(Problem(recipe.where(f"model.config_overrides.{key}"), f"{value!r} is not a whole number",
                               "use a positive whole number"))
        elif value < 1:
            out.append(Problem(recipe.where(f"model.config_overrides.{key}"), f"{value} is not above zero",
                               "use a positive whole number"))
    return out


def tokens_past(tokenizer, vocab: int, shown: int = 3) -> str:
    """For a message: the tokens of `tokenizer` whose ids a vocabulary of `vocab` lacks (often ones transformers added
    itself, `<|endoftext|>` to a GPT-2 tokenizer whose tokenizer_config.json lost its special tokens)."""
    if tokenizer is None or len(tokenizer) <= vocab:
        return ""
    ids = list(range(vocab, len(tokenizer)))
    try:
        names = tokenizer.convert_ids_to_tokens(ids[:shown])
    except (IndexError, KeyError, TypeError, ValueError, OverflowError):
        return ""
    more = f" and {len(ids) - shown} more" if len(ids) > shown else ""
    return f" (past it: {', '.join(repr(name) for name in names)}{more})"


def structure_problems(recipe, facts, tokenizer_size: int | None = None, tokenizer=None) -> list[Problem]:
    """Shapes that cannot make a model (heads that do not divide the width) or cannot run it (a vocabulary smaller
    than the tokenizer's: its ids would index past the embedding), named by the override that set them."""
    out = []
    m = recipe.model

    def where(*keys):
        for key in keys:
            if key in m.config_overrides:
                return recipe.where(f"model.config_overrides.{key}")
        return recipe.where("model.config_overrides") if m.config_overrides else recipe.where("model")

    sizes = {"layers": (facts.layers, "n_layer", "num_hidden_layers"),
             "width": (facts.hidden, "n_embd", "hidden_size"),
             "heads": (facts.heads, "n_head", "num_attention_heads"),
             "key/value heads": (facts.kv_heads, "num_key_value_heads"),
             "context": (facts.context, "n_positions", "max_position_embeddings"),
             "vocabulary": (facts.vocab, "vocab_size")}
    for what, (value, *keys) in sizes.items():
        if value < 1:
            out.append(Problem(where(*keys), f"the model's {what} would be {value}", "use a positive value"))
    whole = not out
    for key in ACTIVATION_KEYS:
        value = m.config_overrides.get(key)
        if value is not None and value not in ACTIVATIONS:
            close = difflib.get_close_matches(str(value), ACTIVATIONS, n=1)
            out.append(Problem(where(key), f"{value!r} is not an activation transformers knows",
                               f"did you mean {close[0]}?" if close else f"use one of {', '.join(ACTIVATIONS)}"))
    if whole and facts.heads >= 1 and facts.kv_heads >= 1:
        explicit_head_dim = facts.model_type == "llama" and "head_dim" in m.config_overrides
        if facts.hidden % facts.heads and not explicit_head_dim:
            out.append(Problem(where("n_head", "num_attention_heads", "n_embd", "hidden_size"),
                               f"width {facts.hidden} is not divisible by {facts.heads} attention heads",
                               f"use a number of heads that divides {facts.hidden}"))
        if facts.heads % facts.kv_heads:
            out.append(Problem(where("num_key_value_heads", "num_attention_heads"),
                               f"{facts.heads} attention heads cannot share {facts.kv_heads} key/value heads",
                               "num_attention_heads must be a multiple of num_key_value_heads"))
    if whole and tokenizer_size and facts.vocab < tokenizer_size:
        pretrained = not m.architecture and "vocab_size" not in m.config_overrides  # its embedding is its weights'
        out.append(Problem(recipe.where("model.tokenizer" if m.tokenizer else "model.name_or_path") if pretrained
                           else where("vocab_size"), f"vocabulary of {facts.vocab} is smaller than the tokenizer's "
                           f"{tokenizer_size} tokens{tokens_past(tokenizer, facts.vocab)}, so its ids would index past "
                           "the embedding",
                           "use the tokenizer the model was trained with (tokens added since need a resized "
                           "embedding: model.resize_token_embeddings, then save_pretrained)" if pretrained else
                           f"use at least {tokenizer_size} (or leave vocab_size out: it follows the tokenizer)"))
    if whole and not out and facts.params() > MAX_PARAMETERS:
        given = sorted((k for k in SIZE_KEYS if k in m.config_overrides), key=lambda k: -m.config_overrides[k])
        out.append(Problem(where(*given), f"the model would have {facts.params():.2e} parameters, more than any "
                           f"machine holds (over {MAX_PARAMETERS:.0e})",
                           f"check {given[0] if given else 'the model sizes'} (a typo of a few digits?)"))
    return out
