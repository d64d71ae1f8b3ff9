"""Consolidation: a checkpoint -> a Hugging Face model folder that `from_pretrained` loads directly.

Streaming, so memory stays bounded by the largest output shard plus a fixed overhead, whatever the model size:
the tensors are grouped into output shards of at most `max_shard_size` bytes, and each group alone is read out
of the torch.distributed.checkpoint shards (a partial DCP load reads only those byte ranges), converted to the
output dtype, written as safetensors and dropped before the next group. (`accelerate merge-weights` loads the
whole state dict at once.) FULL_STATE_DICT checkpoints are one torch file, memory-mapped and read likewise.

GPT-2's and Llama-3.2's tied embeddings: the tied output weight is not written; transformers re-ties it.
LoRA checkpoints become a PEFT adapter folder (`PeftModel.from_pretrained`), optionally also merged.
The output is written to a temporary folder and renamed at the end: an interrupted run leaves nothing half-done,
and an existing folder is replaced only if it is a previous export.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from accel_fsdp.checkpoint.index import CheckpointInfo
from accel_fsdp.checkpoint.merge import (adapter_deltas, adapter_misfit, merge_streaming, natural_key,
                                        tied_head_of)
from accel_fsdp.checkpoint.records import damaged_if_unreadable
from accel_fsdp.config.precision import PRECISIONS, TRANSFORMERS, compute_dtype
from accel_fsdp.config.recipe import read_saved_recipe
from accel_fsdp.data.identity import folder_fingerprint
from accel_fsdp.errors import Problem, UserError, first_line, read_json_object
from accel_fsdp.files import atomic_folder
from accel_fsdp.hardware import PeakMemory
from accel_fsdp.layout import EXPORT_RECORD, HF_DIR, MODEL_DIR, MODEL_FILE, RECIPE_FILE, dangling_link_problem
from accel_fsdp.model.build import load_pretrained, meta_model
from accel_fsdp.model.checks import looks_like_path, model_folder_problems, raise_problems

DTYPES = {p: compute_dtype(p) for p in PRECISIONS}
MERGE_FIX = ("put the base back, or give the one it was trained over with --base-model PATH, or export the adapter "
             "alone (without --merge); nothing was written")


@dataclass
class ExportReport:
    out_dir: Path
    files: list[str]
    tensors: int
    bytes: int
    largest_shard_bytes: int
    peak_rss_bytes: int
    baseline_rss_bytes: int
    seconds: float
    adapter: bool
    merged: bool = False
    """--merge: the merged model is in out_dir/merged, which the summary names (it is no part of the counts)."""

    def summary(self) -> str:
        mb = 1 << 20
        return (f"wrote {self.tensors} tensors, {self.bytes / mb:,.1f} MB in {len(self.files)} file(s) to "
                f"{self.out_dir} in {self.seconds:.1f}s; peak memory {self.peak_rss_bytes / mb:,.0f} MB "
                f"({(self.peak_rss_bytes - self.baseline_rss_bytes) / mb:,.0f} MB above the "
                f"{self.baseline_rss_bytes / mb:,.0f} MB held before reading weights; largest shard "
                f"{self.largest_shard_bytes / mb:,.1f} MB)"
                + (f"; the merged model: {self.out_dir / 'merged'}" if self.merged else ""))


def consolidate(info: CheckpointInfo, out_dir: Path, *, dtype: str = "fp32", max_shard_size: int = 2 << 30,
                merge_lora: bool = False, base_model: str | None = None,
                during: Callable[[], None] | None = None) -> ExportReport:
    """Write a Hugging Face folder (or a PEFT adapter folder for LoRA checkpoints) from a complete checkpoint.
    `during`: called once the weights are written, before the folder is complete (a test's fault, train/faults.py)."""
    start = time.perf_counter()
    out_dir = Path(out_dir)
    _check_destination(out_dir, info.manifest.run_id)
    adapter = bool(info.manifest.lora)
    base = adapter_base(info) if adapter else None
    if merge_lora and not base_model:
        raise_problems([p for p in [changed_base_problem(str(info.path), base, MERGE_FIX)] if p])
    try:
        reader = _TensorSource(info)
        keys = _output_keys(info, reader, adapter)
    except (ValueError, KeyError, UnicodeDecodeError, OSError, RuntimeError) as e:  # damaged with its CRC updated
        raise UserError(Problem(str(info.path), f"its metadata cannot be read ({first_line(e, 160, named=True)})",
                                "use an earlier checkpoint (see `accel-fsdp checkpoint inspect` on the run)")) from None
    monitor = PeakMemory()  # from here on: reading and writing weights
    try:
        # An interrupted export leaves nothing (and the next one sweeps what a killed one left); a previous one is
        # replaced whole; a full disk is an OSError naming out_dir (files.failing_write).
        with atomic_folder(out_dir) as tmp:
            prefix = "adapter_model" if adapter else "model"
            files, total, largest = _write_shards(reader, keys, tmp, prefix, DTYPES[dtype], max_shard_size)
            if during is not None:
                during()
            _copy_hf_files(info, tmp, dtype, adapter)
            (tmp / RECIPE_FILE).write_bytes((info.path / RECIPE_FILE).read_bytes())
            if adapter and merge_lora and info.manifest.quantized_base:  # QLoRA: streamed (checkpoint/merge.py)
                merge_streaming(tmp, tmp / "merged", base=_adapter_base(tmp, base_model), dtype=dtype,
                                quantized_base=None if base_model else info.manifest.quantized_base,
                                max_shard_size=max_shard_size, where=str(info.path),
                                base_where="--base-model" if base_model else None)
            elif adapter and merge_lora:
                _merge_lora(tmp, tmp / "merged", dtype, base_model)
            written = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
            _readable_as_umask_says(tmp)
            (tmp / EXPORT_RECORD).write_text(json.dumps({"checkpoint": str(info.path), "step": info.manifest.step,
                                                  "dtype": dtype, "adapter": adapter, "files": written,
                                                  "run_id": info.manifest.run_id, "base": base}, indent=1))
    except (ValueError, KeyError, UnicodeDecodeError) as e:  # a checkpoint file damaged with its checksum updated
        raise UserError(Problem(str(info.path), f"a file of this checkpoint cannot be read "
                                f"({first_line(e, 160, named=True)})",
                                "use an earlier checkpoint (see `accel-fsdp checkpoint inspect` on the run)")) from None
    finally:
        monitor.stop()
    return ExportReport(out_dir, files, len(keys), total, largest, monitor.peak, monitor.baseline,
                        time.perf_counter() - start, adapter, merged=adapter and merge_lora)


def adapter_base(info: CheckpointInfo) -> dict | None:
    """Of a LoRA checkpoint whose base is a local model folder: {"path", "fingerprint"} of the weights the adapters
    were trained over (the manifest's `starting_weights`, data/identity.py). An adapter export records it, and what
    puts the adapters over that folder again (`--merge`, `generate`) checks it: the SFT run they started from,
    resumed since, leaves other weights in the same folder, and adapters over them are another model, said nowhere.
    None where there is nothing to check (a base built from scratch: QLoRA's record checks it)."""
    if not info.manifest.lora or not info.manifest.starting_weights:
        return None
    saved = read_saved_recipe(info.path / RECIPE_FILE, then=", so the base the adapters were trained over is unknown",
                              fix="merge with --base-model PATH, or export the adapter alone (without --merge)")
    model = saved.get("model", {})
    if model.get("architecture") or not model.get("name_or_path"):
        return None
    return {"path": str(model["name_or_path"]), "fingerprint": info.manifest.starting_weights}


def changed_base_problem(where: str, base: dict | None, fix: str) -> Problem | None:
    """The problem of a base folder (`adapter_base`) that holds other weights now, or None."""
    folder = Path((base or {}).get("path", "")).expanduser()
    if not base or not folder.is_dir():
        return None
    now = folder_fingerprint(folder)
    if now is None or now == base.get("fingerprint"):
        return None
    return Problem(where, f"its LoRA adapters were trained over {base['path']!r} as it was then (fingerprint "
                          f"{base.get('fingerprint')}); that folder holds other weights now (fingerprint {now})", fix)


def _readable_as_umask_says(folder: Path) -> None:
    """Files as the user's umask allows (0644 by default): safetensors' save_file creates them 0600 (safetensors
    0.8), which hides an export from the other users of a shared cluster."""
    mask = os.umask(0)
    os.umask(mask)
    for p in folder.rglob("*"):
        if p.is_file():
            os.chmod(p, 0o666 & ~mask)


def _check_destination(out_dir: Path, run_id: str | None = None) -> None:
    """A new folder, or an earlier export of the same run (`run_id`: the checkpoint's) that holds nothing but what the
    export wrote (its marker lists it): an export replaces only its own files, never the user's or another run's."""
    if out_dir.parent.exists() and not out_dir.parent.is_dir():
        raise UserError(Problem(str(out_dir), f"{out_dir.parent} is a file", "choose a folder (nothing was written)"))
    if not out_dir.exists():
        return
    ours, theirs = None, None
    if out_dir.is_dir() and (out_dir / EXPORT_RECORD).is_file():
        try:
            marker = json.loads((out_dir / EXPORT_RECORD).read_text())
            ours, theirs = set(marker.get("files", [])) | {EXPORT_RECORD}, marker.get("run_id")
        except (OSError, ValueError, AttributeError, TypeError):
            ours = None
    if theirs and run_id and theirs != run_id:
        raise UserError(Problem(str(out_dir), f"holds an export of another run (run {theirs}; this checkpoint is of "
                                f"run {run_id})", "choose a new folder, or delete that export first (nothing was "
                                "written)"))
    if not out_dir.is_dir() or (any(out_dir.iterdir()) and ours is None):
        raise UserError(Problem(str(out_dir), "exists and is not an earlier export of accel-fsdp",
                                "choose a new folder (nothing was written)"))
    extra = sorted(str(p.relative_to(out_dir)) for p in out_dir.rglob("*") if p.is_file()
                   and str(p.relative_to(out_dir)) not in ours)
    if extra:
        raise UserError(Problem(str(out_dir), f"is an earlier export, but also holds files it did not write "
                                f"({', '.join(extra[:3])})", "move them out, or choose a new folder (nothing was "
                                "written)"))


class _TensorSource:
    """Reads selected tensors of a checkpoint's model state without loading the rest."""
    def __init__(self, info: CheckpointInfo):
        self.info = info
        sharded = info.path / MODEL_DIR
        if sharded.is_dir():
            import torch.distributed.checkpoint as dcp

            self.dcp_dir = sharded
            with damaged_if_unreadable(info.path, f"{MODEL_DIR}/.metadata"):
                metadata = dcp.FileSystemReader(str(sharded)).read_metadata()
            self.meta = {k: (tuple(v.size), v.properties.dtype) for k, v in metadata.state_dict_metadata.items()
                         if hasattr(v, "size")}
            self.full = None
        else:
            self.dcp_dir = None
            # mmap: tensors are read from the page cache on demand, not loaded up front.
            with damaged_if_unreadable(info.path, MODEL_FILE):
                self.full = torch.load(info.path / MODEL_FILE, mmap=True, weights_only=True, map_location="cpu")
            self.meta = {k: (tuple(v.shape), v.dtype) for k, v in self.full.items() if isinstance(v, torch.Tensor)}

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        if self.full is not None:
            return {k: self.full[k] for k in keys}
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        wanted = {k: torch.empty(self.meta[k][0], dtype=self.meta[k][1]) for k in keys}
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        with damaged_if_unreadable(self.info.path, f"a shard of {MODEL_DIR}"):
            dcp.load(wanted, storage_reader=dcp.FileSystemReader(str(self.dcp_dir)),
                     planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
        return wanted


WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
"""What activation checkpointing, compile and FSDP1 insert into a parameter's name."""


def plain_name(name: str) -> str:
    """A parameter's name as the model defines it, without the wrappers' parts (a checkpoint's keys, a live model's
    named_parameters)."""
    for part in WRAPPERS:
        name = name.replace(part, "")
    return name


def _canonical(key: str, dcp: bool) -> str:
    """The model's own parameter name: without DCP's top-level "model." entry and FSDP/AC/compile wrappers."""
    return plain_name(key.removeprefix("model.") if dcp else key)


def _output_keys(info: CheckpointInfo, reader: _TensorSource, adapter: bool) -> list[tuple[str, str]]:
    """(checkpoint key, output name) pairs in a stable, layer-ordered sequence; tied copies left out."""
    pairs = [(k, _canonical(k, reader.dcp_dir is not None)) for k in reader.meta]
    if adapter:
        # PEFT's files name adapter weights without the adapter name ("...lora_A.weight").
        pairs = [(k, n.replace(".default.", ".")) for k, n in pairs]
    else:
        config = read_json_object(info.path / HF_DIR / "config.json", what="cannot be read",
                                  then=", so the model it describes is unknown",
                                  fix="use an earlier checkpoint (see `accel-fsdp checkpoint inspect` on the run)")
        if config.get("tie_word_embeddings", True):
            tied = _tied_output_keys(info)
            pairs = [(k, n) for k, n in pairs if n not in tied]
    return sorted(pairs, key=lambda p: natural_key(p[1]))


def _tied_output_keys(info: CheckpointInfo) -> set[str]:
    from transformers import AutoConfig


    config = AutoConfig.from_pretrained(info.path / HF_DIR)
    tied = getattr(meta_model(config), "_tied_weights_keys", None) or {}
    return set(tied) if isinstance(tied, dict) else set(tied)


def _write_shards(reader: _TensorSource, keys, folder: Path, prefix: str, dtype: torch.dtype, max_bytes: int):
    from safetensors.torch import save_file

    size = lambda k: _numel(reader.meta[k][0]) * torch.empty((), dtype=dtype).element_size()  # noqa: E731
    groups: list[list[tuple[str, str]]] = [[]]
    used = 0
    for k, n in keys:
        b = size(k)
        if groups[-1] and used + b > max_bytes:
            groups.append([])
            used = 0
        groups[-1].append((k, n))
        used += b
    names = ([f"{prefix}.safetensors"] if len(groups) == 1 else
             [f"{prefix}-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    weight_map, total, largest = {}, 0, 0
    for group, fname in zip(groups, names):
        tensors = reader.read([k for k, _ in group])
        out = {n: tensors[k].to(dtype).contiguous() for k, n in group}
        del tensors
        save_file(out, str(folder / fname), metadata={"format": "pt"})
        shard_bytes = sum(t.numel() * t.element_size() for t in out.values())
        total += shard_bytes
        largest = max(largest, shard_bytes)
        weight_map.update({n: fname for n in out})
        del out
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / f"{prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return names, total, largest


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _copy_hf_files(info: CheckpointInfo, folder: Path, dtype: str, adapter: bool) -> None:
    src = info.path / HF_DIR
    for f in src.iterdir():
        if f.is_file() and not (adapter and f.name == "config.json"):
            shutil.copy2(f, folder / f.name)
    if not adapter:
        config = json.loads((folder / "config.json").read_text())
        config["dtype"] = TRANSFORMERS[dtype]
        (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _adapter_base(adapter_dir: Path, base_model: str | None) -> str:
    """The base a merge reads: --base-model, else the one the adapter names."""
    from peft import PeftConfig

    base = base_model or PeftConfig.from_pretrained(adapter_dir).base_model_name_or_path
    if not base:
        raise UserError(Problem(str(adapter_dir), "the adapter does not name its base model",
                                "pass --base-model with the hub id or folder of the base model"))
    where = "--base-model" if base_model else f"{adapter_dir.name}/adapter_config.json: base_model_name_or_path"
    folder = Path(base).expanduser()
    if (dangling := dangling_link_problem(folder)) is not None:
        raise UserError(Problem(where, dangling.message, dangling.fix))
    if folder.is_file() or (not folder.exists() and looks_like_path(base)):
        raise UserError(Problem(where, f"{base!r} " + ("is a file" if folder.is_file() else "does not exist"),
                                "give the folder of the base model (a save_pretrained folder) or its hub id"))
    if folder.is_dir():  # read as `recipe validate` reads a model folder: the same damage, the same words
        raise_problems(model_folder_problems(where, folder))
    return base


def _base_where(base_model: str | None) -> str:
    return "--base-model" if base_model else "the adapter's base model"


def _merge_lora(adapter_dir: Path, out: Path, dtype: str, base_model: str | None) -> None:
    from peft import PeftModel
    from transformers import AutoTokenizer

    base = _adapter_base(adapter_dir, base_model)
    model = load_pretrained(base, dtype=torch.float32, where=f"{_base_where(base_model)} {base}",
                            fix="merge into the base model the adapters were trained on, its files complete")
    weights = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    deltas, _ = adapter_deltas(adapter_dir)
    for module, (a, b) in sorted(deltas.items()):  # before PEFT, whose refusals would blame the checkpoint
        if (misfit := adapter_misfit(module, a, b, weights.get(f"{module}.weight"), _base_where(base_model),
                                     base)) is not None:
            raise misfit
    _untie_an_adapted_head(model, deltas)
    merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    merged.to(DTYPES[dtype]).save_pretrained(out)
    AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(out)


def _untie_an_adapted_head(model, deltas: dict) -> None:
    """An adapted output projection tied to the input embeddings (GPT-2's lm_head, Llama 3.2 1B's; merge.py
    `tied_head_of`, the streamed merge's rule too) gets a weight of its own before the merge, and the merged model says
    tie_word_embeddings false. PEFT's merge adds (alpha / r) B A to the one tensor both share (peft 0.21.2 only warns
    of it: tuners_utils.py, _check_tied_modules), so the embeddings moved with the head: a model nobody trained, whose
    logits differed from the trained adapters' by up to 3.7 on a tiny GPT-2 with lm_head adapted."""
    if tied_head_of(model, deltas) is not None:
        head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
        head.weight = torch.nn.Parameter(embeddings.weight.detach().clone())
        model.config.tie_word_embeddings = False
