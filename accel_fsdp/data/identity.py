"""The identity of what a run starts from, in one place: its data, its tokenizer and its starting weights.

Caches are keyed by it (data/prepare.py: a source's tables; model/tokenizer.py: a tokenizer trained on the data;
train/reference.py: DPO's reference log-probabilities of the starting weights), and a checkpoint records the data's
and, where it holds only against them, the starting weights' (`weights_fingerprint`), so that a resume notices a
source or a model that changed since (checkpoint/index.py `check_resume`).

  a data source         a local file: its absolute path, size and modification time; built-in data: its name and
                        the version of its generator; a hub dataset: its id, configuration, split and the commit the
                        local hub cache holds
  a tokenizer           as loaded: its serialized form, chat template and special tokens; `bpe:N` before it is
                        trained: N and each source it learns from (identity, format, fields, max_rows)
  the starting weights  a local folder's weight, config and code files (names, sizes, modification times), a hub
                        model's snapshot, or a model built from scratch: its architecture and the seed; always the
                        config overrides, trust_remote_code and the versions of torch, transformers and peft (they
                        change what a forward computes)

On the data floor, the lowest that knows where a source's rows come from (sources.py `locate`). It reads file
metadata, package versions (importlib.metadata) and, for `weights_fingerprint`, a few KiB of each weight tensor: it
imports no torch.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

from accel_fsdp.config.methods import METHODS
from accel_fsdp.data.sources import locate, source_key
from accel_fsdp.data.synthetic import VERSION as BUILTIN_VERSION

FORWARD_LIBRARIES = ("torch", "transformers", "peft")
"""The libraries whose version changes what a forward of the same weights computes (kernels, model code)."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".json", ".py", ".model", ".txt")
"""The files of a local model folder that make its weights, config, code and tokenizer."""


def digest(*parts) -> str:
    """A short, stable hash of JSON-able parts (a cache folder's name)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


# ------------------------------------------------------------------------------------------------------ data


def source_identity(recipe, index: int, source) -> dict:
    """Which rows source `index` (a resolved SourceConfig) holds right now, as far as metadata can tell."""
    where = locate(recipe, source, source_key(recipe, index))
    if where.kind == "builtin":
        return {"builtin": source.path, "version": BUILTIN_VERSION}
    if where.kind == "hub":
        return {"hub": where.name, "config": source.hub_config, "split": source.split,
                "revision": hub_revision(where.name, "dataset")}
    path = Path(where.path).absolute()
    if not path.is_file():
        return {"file": str(path), "missing": True}
    stat = path.stat()
    return {"file": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def source_reading(source) -> dict:
    """The settings of a source that decide which rows and texts are read: its format, field names and max_rows."""
    return {k: v for k, v in asdict(source).items() if k.endswith("_field") or k in ("format", "max_rows")}


def data_identity(recipe) -> dict[str, dict]:
    """Every source of the recipe: its name -> {"key": the recipe key of its path, "identity": source_identity}."""
    return {source.name: {"key": source_key(recipe, i), "identity": source_identity(recipe, i, source)}
            for i, source in enumerate(recipe.data.resolved_sources())}


def data_changes(saved: dict, current: dict) -> list[str]:
    """What changed between two `data_identity` records, one line per source: "data.path (d.jsonl): 1,200 -> 1,500
    bytes, modified ...". Sources that are new or gone are the recipe's to tell (the mixture is compared there)."""
    out = []
    for name, now in current.items():
        before = saved.get(name)
        if not isinstance(before, dict) or not isinstance(before.get("identity"), dict):
            continue
        old, new = before["identity"], now["identity"]
        if old == new:
            continue
        out.append(f"{now['key']} ({name}): {'; '.join(_differences(old, new))}")
    return out


def _differences(old: dict, new: dict) -> list[str]:
    if new.get("missing"):
        return [f"{new['file']} is gone"]
    what = []
    where_old, where_new = (x.get("file") or x.get("hub") or x.get("builtin") for x in (old, new))
    if where_old != where_new:
        what.append(f"was {where_old}, now {where_new}")
    if old.get("size") != new.get("size"):
        what.append(f"{old.get('size', 0):,} -> {new.get('size', 0):,} bytes")
    elif old.get("mtime_ns") != new.get("mtime_ns"):  # the same size, written again
        what.append(f"modified {_when(old.get('mtime_ns'))} -> {_when(new.get('mtime_ns'))}")
    for key, label in (("version", "built-in data version"), ("revision", "hub revision"), ("config", "hub_config"),
                       ("split", "split")):
        if old.get(key) != new.get(key):
            what.append(f"{label} {old.get(key)} -> {new.get(key)}")
    return what or ["changed"]


def _when(ns) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9)) if isinstance(ns, int) else "?"


# ------------------------------------------------------------------------------------------------- tokenizer


def tokenizer_identity(tokenizer) -> dict:
    """A loaded tokenizer, by what it does: its serialized form (vocabulary, merges, normalizer, pre-tokenizer...),
    chat template and special tokens."""
    serialized = tokenizer.backend_tokenizer.to_str() if hasattr(tokenizer, "backend_tokenizer") else repr(tokenizer)
    return {"tokenizer": hashlib.sha256(serialized.encode()).hexdigest(), "chat_template": tokenizer.chat_template,
            "special": [tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id]}


def trained_tokenizer_identity(recipe, vocab: int) -> dict:
    """A `bpe:N` tokenizer before it is trained: N and every source it learns from (built-in data by its version)."""
    return {"vocab": vocab, "sources": [[source_identity(recipe, i, source), source_reading(source)]
                                        for i, source in enumerate(recipe.data.resolved_sources())]}


# ------------------------------------------------------------------------------------------ starting weights


def weights_identity(recipe) -> dict:
    """The starting weights of the recipe's model, and what changes the forward computed from them."""
    m = recipe.model
    if m.architecture:
        out: dict = {"architecture": m.architecture, "seed": recipe.training.seed}
    elif Path(m.name_or_path).expanduser().is_dir():
        folder = Path(m.name_or_path).expanduser().resolve()
        files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
        out = {"folder": str(folder), "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}
    else:
        out = {"hub": m.name_or_path, "snapshot": hub_revision(m.name_or_path, "model")}
    out.update(config_overrides=m.config_overrides, trust_remote_code=m.trust_remote_code,
               versions=library_versions())
    return out


def starting_weights_record(recipe) -> str | None:
    """What a checkpoint records of the starting weights: their fingerprint where its weights hold only against them
    (LoRA adapters are saved without their base; a DPO policy was trained against the reference computed from them),
    else None (a full fine-tune's checkpoint holds every weight, wherever it started)."""
    if recipe.model.lora.enabled or METHODS[recipe.training.method].reference:
        return weights_fingerprint(recipe)
    return None


SAMPLE_BYTES = 4096
"""Of each tensor's bytes, the first and the last this many go into `weights_fingerprint`."""


def weights_fingerprint(recipe) -> str | None:
    """What the starting weights hold, from the files' content rather than their times (a copy of the same model
    keeps it, a model trained again, with the same shapes, does not): of a local folder, every safetensors file's
    header and the first and last SAMPLE_BYTES of each tensor (a fine-tune changes every tensor it trains; two reads
    a tensor, not the whole file); other weight files, blocks spread over them; a hub model, its snapshot; a
    model built from scratch, the architecture and the seed. None when a file cannot be read (nothing to compare).
    A checkpoint of a run that holds only against its starting weights (LoRA adapters, a DPO reference) records it:
    checkpoint/index.py `check_resume` compares it with the model files as they are now."""
    m = recipe.model
    if m.architecture:
        return digest({"architecture": m.architecture, "seed": recipe.training.seed}, m.config_overrides)
    if Path(m.name_or_path).expanduser().is_dir():
        return folder_fingerprint(Path(m.name_or_path).expanduser())
    return digest({"hub": m.name_or_path, "snapshot": hub_revision(m.name_or_path, "model")})


def folder_fingerprint(folder: Path) -> str | None:
    """`weights_fingerprint` of a local model folder's weight files (also of the base an adapter is merged into or
    loaded over: `checkpoint consolidate --merge`, `generate`). None when one cannot be read."""
    try:
        files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in (".safetensors", ".bin", ".pt"))
        return digest([[p.name, p.stat().st_size, _content_sample(p)] for p in files])
    except OSError:
        return None


def _content_sample(path: Path) -> str:
    """A hash of a weight file's samples (`weights_fingerprint`). The safetensors layout: 8 bytes of header length
    (little-endian), the JSON header with each tensor's `data_offsets` from the end of the header, then the data."""
    import struct

    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f:
        spans = []
        if path.suffix == ".safetensors" and size >= 8:
            length = struct.unpack("<Q", f.read(8))[0]
            header = f.read(min(length, size - 8))
            h.update(header)
            try:
                tensors = json.loads(header)
                spans = sorted((8 + length + t["data_offsets"][0], 8 + length + t["data_offsets"][1])
                               for name, t in tensors.items() if name != "__metadata__")
            except (ValueError, TypeError, KeyError, IndexError, AttributeError):
                spans = []  # not one we can read: sampled as any other file
        if not spans:
            step = max(1, size // 64)
            spans = [(start, min(size, start + SAMPLE_BYTES)) for start in range(0, size, step)]
        for start, end in spans:
            f.seek(start)
            h.update(f.read(min(SAMPLE_BYTES, end - start)))
            if end - start > SAMPLE_BYTES:
                f.seek(max(start + SAMPLE_BYTES, end - SAMPLE_BYTES))
                h.update(f.read(end - max(start + SAMPLE_BYTES, end - SAMPLE_BYTES)))
    return h.hexdigest()[:20]


def library_versions() -> dict[str, str | None]:
    """The installed versions of FORWARD_LIBRARIES (from their metadata: nothing is imported)."""
    out = {}
    for name in FORWARD_LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def hub_revision(repo_id: str, repo_type: str) -> str | None:
    """The commit of a hub repository's main branch that the local hub cache holds (what `from_pretrained` and
    `load_dataset` read from it), or None when it is not there. The cache layout is huggingface_hub's:
    `<HF_HUB_CACHE>/<type>s--<owner>--<name>/refs/main` holds the commit (file_download.py, repo_folder_name and
    the refs written by hf_hub_download)."""
    try:
        from huggingface_hub import constants
        from huggingface_hub.file_download import repo_folder_name

        folder = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type=repo_type)
        return (folder / "refs" / "main").read_text().strip() or None
    except (ImportError, OSError, ValueError):
        return None
