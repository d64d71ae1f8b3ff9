"""Model and tokenizer: configs (offline when possible), weights, LoRA, and the wrap-class check.

`model_config(...)` answers "what is this model" without weights: from a local folder, from the known
architectures table, or from the local hub cache. Training then loads the real weights with
`build_model(...)`. The same meta-device model serves validation (does the wrap class exist? is seq_len within
the context?) and the dry run. Loading is the only place that may reach the hub.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import torch

from accel_fsdp.config.recipe_checks import SEED_MAX
from accel_fsdp.errors import Problem, UserError, first_line
from accel_fsdp.files import atomic_folder
from accel_fsdp.model import architectures
from accel_fsdp.model.checks import (ModelView, hub_cache_remove, lora_target_problems, not_a_model_folder,
                                     override_problems, raise_problems, tokens_past, weights_header_folder)
from accel_fsdp.model.facts import lora_targets
from accel_fsdp.model.nf4 import layers_to_quantize, quantize_model
from accel_fsdp.model.quantize import known_layers
from accel_fsdp.model.streaming_load import ModuleTensors, SafetensorsFiles, model_folder
from accel_fsdp.model.tokenizer import is_local

try:  # transformers 5 validates config fields through huggingface_hub's strict dataclasses (not a ValueError)
    from huggingface_hub.errors import StrictDataclassError
except ImportError:  # pragma: no cover - older huggingface_hub
    StrictDataclassError = ValueError


def model_config(recipe, *, tokenizer=None, offline: bool = False):
    """The transformers config of the recipe's model, with config_overrides applied.

    With `offline=True` the hub is never contacted: a hub id is answered from the known architectures table or
    the local cache, and `None` is returned when neither knows it.

    Long: the three ways to a config (an architecture, a local folder, a hub id, online or not) and what each can
    raise are kept side by side, so one message per cause is easy to check against the others.
    """
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    m = recipe.model
    overrides = dict(m.config_overrides)
    if m.architecture:
        arch = architectures.lookup(m.architecture)
        if arch is not None:
            kwargs = {**arch.config_kwargs(), **overrides}
            model_type = arch.model_type
        elif m.architecture in CONFIG_MAPPING:
            kwargs, model_type = overrides, m.architecture
        else:
            known = ", ".join(list(architectures.KNOWN) + ["or a transformers model_type such as gpt2, llama"])
            raise UserError(Problem(recipe.where("model.architecture"),
                                    f"unknown architecture {m.architecture!r}", f"use one of {known}"))
        if tokenizer is not None:
            # A model built from scratch takes its vocabulary and special tokens from its tokenizer
            # (unless config_overrides says otherwise).
            kwargs["vocab_size"] = overrides.get("vocab_size", len(tokenizer))
            for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
                value = getattr(tokenizer, key, None)
                if key == "bos_token_id" and value is None:
                    value = tokenizer.eos_token_id
                if value is not None:
                    kwargs[key] = value
        unknown_override_problems(recipe, CONFIG_MAPPING[model_type], overrides)
        try:
            config = AutoConfig.for_model(model_type, **kwargs)
            _refuse_non_decoder(recipe, config, "model.architecture")
            if tokenizer is not None and len(tokenizer) > config.vocab_size:
                raise_problems([Problem(recipe.where("model.config_overrides.vocab_size"),
                                        f"vocabulary of {config.vocab_size} is smaller than the tokenizer's "
                                        f"{len(tokenizer)} tokens{tokens_past(tokenizer, config.vocab_size)}, so its "
                                        "ids would index past the embedding",
                                        f"use at least {len(tokenizer)} (or leave vocab_size out)")])
            return config
        except (TypeError, ValueError, StrictDataclassError) as e:
            detail = " ".join(line.strip() for line in str(e).splitlines() if line.strip())[:240]
            raise UserError(Problem(recipe.where("model.config_overrides"), f"rejected by transformers: {detail}",
                                    "give each key a value of the type its config class expects")) from None
    name = m.name_or_path
    if is_local(name):
        if not (Path(name).expanduser() / "config.json").is_file():
            raise UserError(not_a_model_folder(recipe.where("model.name_or_path"), Path(name).expanduser()))
        try:
            config = AutoConfig.from_pretrained(name, trust_remote_code=m.trust_remote_code)
        except (OSError, ValueError, KeyError, TypeError, StrictDataclassError) as e:  # unreadable, untyped, unknown
            raise UserError(Problem(recipe.where("model.name_or_path"), f"transformers cannot read the config of "
                                    f"{name!r}: {first_line(e)}",
                                    "restore its config.json (save_pretrained writes it), or update transformers for "
                                    "a newer model type")) from None
    else:
        arch = architectures.lookup(name)
        if offline and arch is not None:
            config = AutoConfig.for_model(arch.model_type, **arch.config_kwargs())
        else:
            config = _hub_config(recipe, name, offline=offline)
            if config is None:
                return None
    if config is not None:
        _refuse_non_decoder(recipe, config, "model.name_or_path")
        unknown_override_problems(recipe, type(config), overrides)
    problems = []
    for key, value in overrides.items():
        try:
            setattr(config, key, value)  # transformers 5 type-checks the fields of its config classes
        except (TypeError, ValueError, StrictDataclassError) as e:
            problems.append(Problem(recipe.where(f"model.config_overrides.{key}"), f"{value!r} is rejected by "
                                    f"{type(config).__name__}: {first_line(e, 160)}",
                                    f"give {key} a value of the right type"))
    raise_problems(problems)
    if tokenizer is not None and 0 < getattr(config, "vocab_size", 0) < len(tokenizer):
        raise UserError(Problem(recipe.where("model.config_overrides.vocab_size") if "vocab_size" in overrides
                                else recipe.where("model.tokenizer"),
                                f"the model's vocabulary of {config.vocab_size} is smaller than the tokenizer's "
                                f"{len(tokenizer)} tokens{tokens_past(tokenizer, config.vocab_size)}, so its ids "
                                "would index past the embedding",
                                "use the tokenizer the model was trained with, or a larger vocab_size"))
    return config


def not_a_decoder(config) -> str | None:
    """Why `config` is not a model that predicts the next token (what every method here trains and `generate`
    samples), or None. transformers builds a causal-LM class for some encoders too (bert's BertLMHeadModel, in
    models/auto/modeling_auto.py MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, checked with 5.24.0) and only warns that it needs
    `is_decoder: true`: trained as one it fails in FSDP's loading, and sampled it continues nothing. Those are the
    types that are masked-LM models as well; a config with `is_decoder: true` is a decoder on purpose. Remote code
    (`auto_map`) is the user's own model and not judged."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    model_type = getattr(config, "model_type", None)
    if getattr(config, "auto_map", None):
        return None
    if getattr(config, "is_encoder_decoder", False):
        return f"{model_type!r} is an encoder-decoder model"
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return f"{model_type!r} has no causal language model class in transformers"
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        return f"{model_type!r} is an encoder (a masked language model; its config does not set is_decoder)"
    return None


def _refuse_non_decoder(recipe, config, key: str) -> None:
    why = not_a_decoder(config)
    if why:
        raise UserError(_non_decoder_problem(recipe.where(key), why))


def _non_decoder_problem(where: str, why: str) -> Problem:
    return Problem(where, f"{why}: accel-fsdp trains and samples decoder-only language models that predict the next "
                   "token", "use a decoder model (GPT-2, Llama, Mistral, Qwen, ...)")


def _hub_config(recipe, name: str, *, offline: bool):
    """The config of a hub id: downloaded, or with `offline` from the hub cache alone (None when the cache lacks it:
    transformers' OSError). A copy transformers cannot read (a model type newer than it, a damaged config.json in the
    cache) is one message, online and offline alike."""
    from transformers import AutoConfig

    m = recipe.model
    try:
        return AutoConfig.from_pretrained(name, trust_remote_code=m.trust_remote_code, local_files_only=offline)
    except OSError as e:
        cached = _cached_file(name, "config.json")
        if cached is not None:  # transformers' OSError for a config.json that is not JSON; offline, for a missing one
            raise UserError(Problem(recipe.where("model.name_or_path"), f"the hub cache's copy of {name!r} cannot be "
                                    f"read ({first_line(e)})", f"delete it from the hub cache "
                                    f"(`{hub_cache_remove(name)}`) and download it again")) from None
        if offline:
            return None
        raise UserError(Problem(recipe.where("model.name_or_path"), f"cannot load {name!r}: {first_line(e)}",
                                "check the hub id and your network or HF_TOKEN (gated models such as Llama need an "
                                "accepted licence), or give a local folder")) from None
    except (ValueError, KeyError, TypeError, StrictDataclassError) as e:  # JSONDecodeError is a ValueError
        if "trust_remote_code" in str(e):
            raise UserError(Problem(recipe.where("model.trust_remote_code"), f"{name!r} ships its own model code",
                                    "set model.trust_remote_code: true if you trust that repository")) from None
        raise UserError(Problem(recipe.where("model.name_or_path"), f"transformers cannot read the config of "
                                f"{name!r}: {first_line(e)}", "update transformers for a newer model type, or delete "
                                f"the hub cache's copy (`{hub_cache_remove(name)}`) and download it again")) from None


def _cached_file(repo_id: str, filename: str) -> str | None:
    """The path of a hub repository's file in this machine's hub cache, or None."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, filename)
    except ValueError:  # an id that is no repository name (huggingface_hub's HFValidationError, a ValueError)
        return None
    return found if isinstance(found, str) else None


def load_pretrained(folder, *, where: str, fix: str, **kwargs):
    """AutoModelForCausalLM.from_pretrained(folder), refusing weights that do not fit the model its config builds:
    transformers 5 initializes a tensor the files lack at random with a log line (a run would train, and `generate`
    sample, a partly random model) and stops a shape mismatch with a RuntimeError pointing at a table it logged
    (modeling_utils.py `_load_pretrained_model` and its loading report, checked with 5.24.0). Both become one
    message naming the tensors; so does a file it cannot read (safetensors' and pickle's own error types)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if kwargs.get("config") is None:  # the recipe's path has one, checked (model_config); a folder given alone not
        try:
            kwargs["config"] = AutoConfig.from_pretrained(folder, trust_remote_code=kwargs.get("trust_remote_code",
                                                                                               False))
        except Exception as e:  # ValueError (an unknown model_type), StrictDataclassError, OSError...
            raise UserError(Problem(where, f"transformers cannot read its config.json ({first_line(e)})",
                                    "restore its config.json (save_pretrained writes it), or update transformers for "
                                    "a newer model type")) from None
        why = not_a_decoder(kwargs["config"])
        if why:
            raise UserError(_non_decoder_problem(where, why))
    try:
        model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True,
                                                           ignore_mismatched_sizes=True, **kwargs)
    except (UserError, MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as e:  # OSError, ValueError, SafetensorError, UnpicklingError, EOFError, RuntimeError...
        raise UserError(Problem(where, f"its weights cannot be loaded ({first_line(e, named=True)})", fix)) from None
    wrong = [f"{name} is missing" for name in sorted(info["missing_keys"])]
    wrong += [f"{name} is {list(stored)} in the files but {list(built)} in the model config.json builds"
              for name, stored, built in sorted(info["mismatched_keys"], key=str)]
    if wrong:
        raise UserError(Problem(where, "the weights do not fit the model its config.json describes: "
                                + "; ".join(wrong[:4]) + (f" (and {len(wrong) - 4} more)" if len(wrong) > 4 else ""),
                                fix))
    return model


def weights_fit_problems(recipe) -> list[Problem]:
    """`recipe validate` of a model in a local folder (safetensors, or pytorch_model.bin in torch.save's zip format):
    the files' tensors against the model its config (with config_overrides) builds, read on the meta device, so only
    the files' headers are read (checks.py `weights_header_folder`). The same judgement as a run's loading
    (`load_pretrained`), which would otherwise find a missing or misshapen tensor only after the launch, in every
    rank."""
    m = recipe.model
    folder = weights_header_folder(recipe)
    if folder is None:
        return []
    config = model_config(recipe, offline=True)
    kwargs: dict[str, Any] = {"trust_remote_code": m.trust_remote_code}
    try:
        load_pretrained(folder, config=config, device_map="meta", where=recipe.where("model.name_or_path"),
                        fix="download or export the model again (its weights and config.json together)", **kwargs)
    except UserError as e:
        return e.problems
    return []


def unknown_override_problems(recipe, config_class, overrides: dict) -> None:
    """Raise for model.config_overrides keys the (transformers) config class does not have."""
    try:
        known = set(config_class().to_dict()) | set(getattr(config_class, "attribute_map", {}) or {})
    except Exception:  # a config class that cannot be built without arguments: nothing to check against
        return
    raise_problems(override_problems(recipe, config_class.__name__, known, overrides,
                                     getattr(config_class, "attribute_map", None)))


def context_length(config) -> int | None:
    for key in ("n_positions", "max_position_embeddings", "seq_length", "n_ctx"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def meta_model(config, trust_remote_code: bool = False):
    """The model built on the meta device: its structure and parameter count, with no memory and no weights."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def view_of(model: torch.nn.Module, config=None) -> ModelView:
    """A model (real or on the meta device) as the checks see it."""
    linears = {_target_name(n) for n, m in model.named_modules() if (isinstance(m, torch.nn.Linear)
               or type(m).__name__ == "Conv1D") and not any(p.startswith("lora_") for p in n.split("."))}
    classes = frozenset(type(m).__name__ for m in model.modules())
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return ModelView(type(model).__name__, no_split_modules(model), classes, frozenset(linears),
                     context_length(config if config is not None else model.config), count_parameters(model),
                     count_parameters(model, trainable_only=True), tuple(layers_to_quantize(base)))


def _target_name(name: str) -> str:
    """The name LoRA's target_modules matches: a layer PEFT has wrapped keeps its own as `<name>.base_layer`
    (peft 0.21, tuners/lora/layer.py, LoraLayer.base_layer)."""
    parts = name.split(".")
    return parts[-2] if parts[-1] == "base_layer" and len(parts) > 1 else parts[-1]


def no_split_modules(model: torch.nn.Module) -> list[str]:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return sorted(getattr(base, "_no_split_modules", None) or [])


def load_model_code(recipe, config, dtype: torch.dtype) -> None:
    """Build a one-block copy of the model unwritten (nothing read, nothing allocated but its adapters) and drop it,
    before the loading's memory is measured: it imports and first runs the code the real build needs (the model
    class's module, torchao's NF4, PEFT's model for causal LMs), about 70 MiB a process holds whatever the model's
    size (measured on the 355M GPT-2 with QLoRA, 2026-11-26), the per-process overhead the loading target excludes
    (issue 24). The loading figures (`PeakMemory` in train/setup.py, benchmarks/loading_memory.py) then count what
    the model allocates. Only for the model types model/facts.py knows (a remote-code model's config may not take
    another depth)."""
    if recipe.model.trust_remote_code or known_layers(getattr(config, "model_type", None)) is None:
        return
    one_block = copy.deepcopy(config)
    one_block.num_hidden_layers = 1
    build_model(recipe, one_block, dtype=dtype, empty=True)


def build_model(recipe, config, *, dtype: torch.dtype = torch.float32, empty: bool = False, draw: bool = True):
    """Weights: pretrained (hub id or folder) or freshly initialized from `config` under the recipe's seed.

    `empty`: build the structure with its parameters allocated but never written, and load nothing: the rank will
    receive its shards from global rank 0 once the model is sharded (`fsdp_cpu_ram_efficient_loading`: streamed,
    model/streaming_load.py, under FSDP2; Accelerate's broadcast under FSDP1). Buffers are real (rotary frequencies
    and the like are computed, not loaded) and LoRA adapters are initialized as usual. transformers 5.x would
    otherwise read every weight on every rank (modeling_utils.py, `_load_pretrained_model`, checked with 5.23.0):
    N copies of the model in the host memory of one machine.

    `draw` False (with `empty`): the LoRA adapters are left unwritten too; the reading rank sends them
    (model/streaming_load.py `stream_adapters`), so no other rank holds every adapter whole.

    `model.quantize`: the decoder blocks' linear weights become 4-bit (model/nf4.py), quantized from `dtype`.
    """
    from transformers import AutoModelForCausalLM

    m = recipe.model
    kwargs: dict[str, Any] = {"trust_remote_code": m.trust_remote_code}
    if m.attn_implementation:
        kwargs["attn_implementation"] = m.attn_implementation
    # Every rank draws the same fresh weights (from-scratch models, LoRA adapters): their shards must fit together.
    torch.manual_seed(recipe.training.seed)
    if empty:
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
        # init_empty_weights re-creates every registered parameter on meta (accelerate/big_modeling.py,
        # register_empty_parameter), so `lm_head.weight = wte.weight` no longer shares one object: tie again.
        model.tie_weights()
    elif m.architecture:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    else:
        model = load_pretrained(m.name_or_path, config=config, dtype=dtype, where=recipe.where("model.name_or_path"),
                                fix="download or export the model again (its weights and config.json together)",
                                **kwargs)
    model.config.use_cache = False  # the KV cache is for generation; in training it only costs memory
    if m.quantize:
        quantize_model(model, dtype, empty=empty)  # before LoRA: PEFT wraps the 4-bit layers like any Linear
    if m.lora.enabled:
        model = apply_lora(model, recipe, draw=draw or not empty, on_meta=empty)
    return _unwritten_parameters(model) if empty else model


def weight_source(recipe, config, dtype: torch.dtype):
    """What global rank 0 streams the weights from (model/streaming_load.py): the model files, tensor by tensor; for
    a model built from scratch, the model initialized in its memory under the recipe's seed (what every rank would
    draw: there are no files to read)."""
    m = recipe.model
    if m.architecture:
        return ModuleTensors(scratch_model(recipe, config, dtype).state_dict())
    return SafetensorsFiles(model_folder(m.name_or_path))


def scratch_model(recipe, config, dtype: torch.dtype):
    """The model built from scratch under the recipe's seed, as `build_model` draws it on every rank."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(recipe.training.seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=recipe.model.trust_remote_code)


def write_scratch_base(recipe, config, dtype: torch.dtype, tokenizer, folder: Path) -> Path:
    """A 4-bit base built from scratch (model.architecture with model.quantize) written as a model folder, in the
    dtype it was quantized from: what `checkpoint consolidate --merge` quantizes again and merges into (its
    fingerprint checked), since no model files exist otherwise. Kept when it is there already (a resumed run)."""
    if (folder / "config.json").exists():
        return folder
    with atomic_folder(folder) as tmp:
        scratch_model(recipe, config, dtype).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return folder


def layout_of(model: torch.nn.Module) -> dict:
    """What rank 0's weight broadcast pairs up, tensor by tensor: the state dict's names in order with their shapes and
    dtypes, and which parameters are tied (one tensor under several names)."""
    ties: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        ties.setdefault(id(parameter), []).append(name)
    return {"tensors": [(n, list(t.shape), str(t.dtype)) for n, t in model.state_dict(keep_vars=True).items()],
            "ties": sorted(sorted(names) for names in ties.values() if len(names) > 1)}


def layout_differences(reference: dict, mine: dict, limit: int = 5) -> list[str]:
    """How a rank's layout differs from rank 0's (`layout_of`), at most `limit` names of each kind."""
    ref = {n: (shape, dtype) for n, shape, dtype in reference["tensors"]}
    own = {n: (shape, dtype) for n, shape, dtype in mine["tensors"]}
    out = [f"{n}: only on rank 0" for n in ref if n not in own][:limit]
    out += [f"{n}: not on rank 0" for n in own if n not in ref][:limit]
    out += [f"{n}: rank 0 {ref[n][1]} {ref[n][0]}, here {own[n][1]} {own[n][0]}"
            for n in ref if n in own and ref[n] != own[n]][:limit]
    if not out and [n for n, *_ in reference["tensors"]] != [n for n, *_ in mine["tensors"]]:
        out.append("the same names in another order")
    if reference["ties"] != mine["ties"]:
        out.append(f"tied parameters: rank 0 {reference['ties']}, here {mine['ties']}")
    return out


def _unwritten_parameters(model: torch.nn.Module) -> torch.nn.Module:
    """Replace meta parameters by CPU tensors that are allocated but never written (tied ones stay shared).

    Accelerate's FSDP2 `prepare` maps the optimizer's parameters to the sharded ones by `data_ptr()`
    (accelerator.py, _prepare_fsdp2 and fsdp2_switch_optimizer_parameters, checked with 1.15.0), and every meta
    tensor's is 0. Untouched allocations are virtual: the kernel maps their pages only when written, so resident
    memory does not grow; `prepare` then moves the model to meta and fills it from rank 0's broadcast."""
    fresh: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.device.type != "meta":
                continue
            if id(param) not in fresh:
                fresh[id(param)] = torch.nn.Parameter(torch.empty_like(param, device="cpu"),
                                                      requires_grad=param.requires_grad)
            module._parameters[name] = fresh[id(param)]
    return model


DROPOUT_KEY = re.compile(r"dropout|pdrop|layerdrop")
"""How transformers configs spell a dropout probability: GPT-2 resid_pdrop, embd_pdrop, attn_pdrop,
summary_first_dropout; Llama, Mistral, Qwen2 attention_dropout; OPT dropout, activation_dropout, layerdrop; BERT
hidden_dropout_prob."""


def turn_off_dropout(config) -> dict[str, float]:
    """Set every dropout probability of a transformers config to 0, before a model is built from it (the layers read
    them when they are built, or at each forward). Returns those that were above 0, with their values."""
    off = {}
    for key, value in config.to_dict().items():
        if DROPOUT_KEY.search(key) and isinstance(value, float) and value > 0 and hasattr(config, key):
            setattr(config, key, 0.0)
            off[key] = value
    return off


def turn_off_dropout_layers(model: torch.nn.Module) -> dict[str, float]:
    """Set p = 0 on every torch Dropout layer still above 0 once the model is built: LoRA's (model.lora.dropout),
    and any a config key did not reach. Returns what they were, by what sets them."""
    off = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            off["model.lora.dropout" if "lora_dropout" in name else f"{type(module).__name__} layers"] = module.p
            module.p = 0.0
    return off


def apply_lora(model, recipe, *, draw: bool = True, on_meta: bool = False):
    """PEFT's LoRA on the model, its adapters drawn from the recipe's seed (`draw` False: left as PEFT makes them,
    on the meta device over an unwritten base, to be sent by the reading rank). `on_meta`: PEFT creates the adapters
    on the meta device (over an unwritten base): it would otherwise initialize each on the CPU before moving it to
    its base layer's meta device (peft 0.21.2 lora/layer.py update_layer), freed blocks of up to 96 KiB that the
    heap keeps (6 MiB a rank of the 355M GPT-2's, measured while streaming)."""
    from contextlib import nullcontext

    from accelerate import init_empty_weights
    from peft import LoraConfig, get_peft_model

    lora = recipe.model.lora
    view = view_of(model)
    raise_problems(lora_target_problems(view, recipe))
    names = lora_targets(lora.target_modules, view.linear_names)  # all-linear as the model's own names
    # The adapters' first values from the recipe's seed alone, whatever building the base drew before: each rank of
    # a run builds them itself, with the base read or not (model/streaming_load.py sends the base only). A stream of
    # their own (seed + 1), not the one a from-scratch base's initialization began with.
    # GPT-2's Conv1D layers hold their weight as in x out: PEFT needs fan_in_fan_out for them, and said so in a
    # warning on every rank when left to find out itself (peft 0.21.2 tuners/lora/layer.py, dispatch_default). Only
    # where every target is a Conv1D: a 4-bit base has replaced them by Linear layers.
    targets = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in names]
    fan_in_fan_out = bool(targets) and all(type(m).__name__ == "Conv1D" for m in targets)
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, fan_in_fan_out=fan_in_fan_out,
                        target_modules=names, task_type="CAUSAL_LM")
    with init_empty_weights(include_buffers=False) if on_meta else nullcontext():
        model = get_peft_model(model, config)
    if draw:
        draw_adapters(model, (recipe.training.seed + 1) % (SEED_MAX + 1))
    return model


def draw_adapters(model, seed: int) -> None:
    """Give every LoRA adapter its first values, drawn from `seed` in module order, on a model whose base was read
    or was built unwritten alike. PEFT creates an adapter on its base layer's device (peft 0.21.2 lora/layer.py,
    `_move_adapter_to_device_of_base_layer`): on an unwritten (meta) base the adapters are meta too, and would
    otherwise become memory that nothing ever wrote (NaN losses under streamed loading). Drawn again here on every
    path, the values do not depend on how the base was loaded."""
    from peft.tuners.lora import LoraLayer

    torch.manual_seed(seed)
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        for adapter in list(module.lora_A):
            for part in (module.lora_A[adapter], module.lora_B[adapter]):
                if any(p.device.type == "meta" for p in part.parameters()):
                    part.to_empty(device="cpu")
            module.reset_lora_parameters(adapter, True)  # A as nn.Linear's default (Kaiming), B zeros


def count_parameters(model: torch.nn.Module, trainable_only: bool = False) -> int:
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) in seen or (trainable_only and not p.requires_grad):
            continue
        seen.add(id(p))
        n += p.numel()
    return n
