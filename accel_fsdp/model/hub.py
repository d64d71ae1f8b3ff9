"""Hub ids in a recipe (model, tokenizer, dataset) that this machine cannot get, found once before launching.

Without this, every rank would find out by itself, through huggingface_hub's retries: over a minute of "Retrying"
lines from each rank before one confusing error. Here the parent process looks in the local cache and, where the id
is not there, asks the hub once (no retries, a short timeout) and turns any failure into one message: which id, and
the fix (a local folder, HF_TOKEN for gated models, or HF_HUB_OFFLINE with a copy in the cache).
"""

from __future__ import annotations

import os

from accel_fsdp.data.sources import locate, source_key
from accel_fsdp.errors import Problem, UserError, first_line
from accel_fsdp.layout import folder_from_environment
from accel_fsdp.model.checks import HUB_LOGIN, hub_download
from accel_fsdp.model.tokenizer import BUILTIN_TOKENIZER, bpe_vocab_size, is_local

TIMEOUT_S = 10
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_ids(recipe) -> list[tuple[str, str, str, tuple[str, ...]]]:
    """(dotted key, repo id, repo type, files a run needs from it) for every hub id of the recipe."""
    m = recipe.model
    out = []
    if m.name_or_path and not is_local(m.name_or_path):
        out.append(("model.name_or_path", m.name_or_path, "model", ("config.json",) + WEIGHT_FILES))
    if (m.tokenizer and m.tokenizer != BUILTIN_TOKENIZER and not is_local(m.tokenizer)
            and bpe_vocab_size(m.tokenizer) is None):
        out.append(("model.tokenizer", m.tokenizer, "model", ("tokenizer_config.json",)))
    for i, source in enumerate(recipe.data.resolved_sources()):
        where = locate(recipe, source, source_key(recipe, i))
        if where.kind == "hub":
            out.append((source_key(recipe, i), where.name, "dataset", (source.hub_config or "",)))
    return out


def in_cache(repo: str, kind: str, files: tuple[str, ...]) -> bool:
    """The local Hugging Face cache holds what a run needs of `repo` (config and any one weight file)."""
    from huggingface_hub import try_to_load_from_cache

    if kind == "dataset":
        return False  # the datasets library keeps its own cache; ask the hub (or trust HF_HUB_OFFLINE)

    def cached(name: str) -> bool:
        return isinstance(try_to_load_from_cache(repo, name, repo_type=kind), str)

    if not cached(files[0]):
        return False
    return len(files) == 1 or any(cached(name) for name in files[1:])


HUB_CACHE_ENV = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE")
"""The variables that move the Hugging Face libraries' caches (huggingface_hub/constants.py, datasets/config.py)."""


def hub_cache_problems(env) -> list[Problem]:
    """A Hugging Face cache variable that names a file (or lies below one): one problem naming it, where the hub
    libraries would fail with "Not a directory" about a path below it, which the check of the hub read as "the hub
    cannot be reached" and answered "fix the network"."""
    problems = []
    for variable in HUB_CACHE_ENV:
        if env.get(variable):
            try:
                folder_from_environment(variable, env[variable])
            except UserError as e:
                problems += e.problems
    return problems


def hub_problems(recipe) -> list[Problem]:
    """One problem per hub id this machine cannot get; asks the hub at most once per id."""
    from huggingface_hub.errors import HFValidationError

    ids = hub_ids(recipe)
    if ids and (problems := hub_cache_problems(os.environ)):
        return problems
    problems = []
    for key, repo, kind, files in ids:
        where = recipe.where(key)
        try:
            if in_cache(repo, kind, files):
                continue
        except HFValidationError:
            problems.append(Problem(where, f"{repo!r} is neither a local {'file' if kind == 'dataset' else 'folder'} "
                                    "nor a valid hub id", f"give {_local_copy(kind)}, or a hub id such as owner/name"))
            continue
        if offline():
            if kind == "dataset":
                problem = _dataset_offline_problem(repo, files[0] or None)
                if problem:
                    problems.append(Problem(where, *problem))
                continue
            problems.append(Problem(where, f"{repo!r} is not in the local Hugging Face cache, and HF_HUB_OFFLINE=1 "
                                    "forbids downloading it", f"download it once where the hub is reachable "
                                    f"({hub_download(repo, kind)}), give a local folder, or unset "
                                    "HF_HUB_OFFLINE"))
            continue
        problem = _ask_hub(repo, kind)
        if problem:
            problems.append(Problem(where, *problem))
    return problems


def _dataset_offline_problem(repo: str, config: str | None) -> tuple[str, str] | None:
    """HF_HUB_OFFLINE: is the dataset in the datasets library's cache (what load_dataset will use)?"""
    try:
        import datasets

        datasets.load_dataset_builder(repo, config)
    except Exception as e:  # datasets raises a different type for each way of not finding it
        return (f"dataset {repo!r} (config {config!r}) is not in the local datasets cache, and "
                f"HF_HUB_OFFLINE=1 forbids downloading it ({type(e).__name__})",
                "download it once where the hub is reachable, or point data.path at a local file")
    return None


def _ask_hub(repo: str, kind: str) -> tuple[str, str] | None:
    """(message, fix) when the hub says no or cannot be reached; one request, no retries."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    api = HfApi()
    try:
        (api.dataset_info if kind == "dataset" else api.model_info)(repo, timeout=TIMEOUT_S)
    except GatedRepoError:
        return (f"{repo!r} is a gated repository and this machine is not allowed to read it",
                f"accept its licence on huggingface.co and set HF_TOKEN (or `{HUB_LOGIN}`)")
    except RepositoryNotFoundError:
        return (f"no {kind} {repo!r} on the hub (or it is private)",
                f"check the id (owner/name), or set HF_TOKEN for a private repository, or give {_local_copy(kind)}")
    except HfHubHTTPError as e:
        return (f"the hub refused {repo!r} ({first_line(e, 120)})", f"try again later, or give {_local_copy(kind)}")
    except Exception as e:  # connection refused, DNS, timeouts, proxies: every transport error means "unreachable"
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
        return (f"{repo!r} is not in the local cache and the hub ({endpoint}) cannot be reached "
                f"({first_line(e, 100, named=True)})",
                f"give {_local_copy(kind)}, or fix the network; with a copy in the cache, HF_HUB_OFFLINE=1 skips "
                "this check")
    return None


def _local_copy(kind: str) -> str:
    """What to give instead of a hub id: data.path reads files, not folders (a dataset's save_to_disk is no source)."""
    return ("a local data file (.jsonl, .json, .csv, .parquet, .txt)" if kind == "dataset"
            else "a local folder (a save_pretrained copy)")
