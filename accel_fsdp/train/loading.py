"""How a rank gets its weights: streamed from global rank 0 into the shards it holds, or read whole by every rank; and
the record of a 4-bit base (model.quantize), agreed on by every rank.

Under FSDP2 with fsdp_cpu_ram_efficient_loading every rank builds the model unwritten, `accelerator.prepare` shards
it, and model/streaming_load.py fills the shards (Accelerate's own rank-0 loading stays off: train/accelerator.py).
Under FSDP1 Accelerate's `sync_module_states` broadcast remains (train/setup.py checks the layouts first).
"""

from __future__ import annotations

import re

import torch

from accel_fsdp.config.settings import FsdpSettings, shard_group_size
from accel_fsdp.model.build import weight_source
from accel_fsdp.model.nf4 import NF4Linear, digests_of
from accel_fsdp.model.quantize import QuantizedBase
from accel_fsdp.model.streaming_load import BLOCK_ELEMENTS, stream_adapters, stream_weights


def streams_weights(settings: FsdpSettings) -> bool:
    """Rank 0 streams the weights to the shards (FSDP2 with fsdp_cpu_ram_efficient_loading)."""
    return bool(settings.cpu_ram_efficient_loading.value) and settings.fsdp_version.value == 2


def leave_nf4_unsharded(accelerator, model: torch.nn.Module, settings: FsdpSettings) -> None:
    """Before `prepare`, where each shard group is one rank: the 4-bit layers stay out of FSDP2 (model/nf4.py says
    why), as Accelerate's ignored modules. A pattern of their names, not the modules: Accelerate moves the modules a
    pattern names to the rank's device (accelerate/utils/fsdp_utils.py, get_parameters_from_modules; 1.15.0)."""
    if shard_group_size(settings) > 1:
        return
    names = [name for name, module in model.named_modules() if isinstance(module, NF4Linear)]
    if names:
        accelerator.state.fsdp_plugin.ignored_modules = "|".join(re.escape(name) for name in names)


def load_streamed(accelerator, model: torch.nn.Module, recipe, config, dtype: torch.dtype,
                  block_elements: int | None = None, adapters: dict | None = None) -> dict[str, bytes]:
    """After `prepare`: every rank's shards filled from global rank 0's reads, large tensors a block of rows of at
    most `block_elements` at a time (None: streaming_load.py's BLOCK_ELEMENTS; collective), then the LoRA adapters
    rank 0 drew (`adapters`, from streaming_load.py `adapters_to_send` before `prepare`; None elsewhere). The digests
    of the 4-bit weights, on rank 0."""
    source = weight_source(recipe, config, dtype) if accelerator.is_main_process else None
    digests = stream_weights(model, source, where=recipe.where("model.name_or_path"), block_elements=block_elements)
    if recipe.model.lora.enabled:
        stream_adapters(model, adapters, block_elements or BLOCK_ELEMENTS)
    return digests


def read_digests(accelerator, model: torch.nn.Module, recipe) -> dict[str, bytes] | None:
    """Before `prepare`, when every rank read the weights itself: the main process's digests of its whole 4-bit
    weights (None where there is none to record)."""
    if not recipe.model.quantize or not accelerator.is_main_process:
        return None
    return digests_of(model)


def agreed_base(accelerator, recipe, digests, dtype: torch.dtype) -> QuantizedBase | None:
    """The record of the run's 4-bit base on every rank: made by the main process from the digests of its 4-bit
    weights (read whole, or streamed), sent to the others. Collective."""
    if not recipe.model.quantize:
        return None
    import torchao
    from accelerate.utils import broadcast_object_list

    box = [None]
    if accelerator.is_main_process:
        box = [QuantizedBase.of(recipe.model.quantize, digests or {}, torchao.__version__,
                                   str(dtype).removeprefix("torch.")).to_dict()]
    if accelerator.num_processes > 1:
        broadcast_object_list(box, from_process=0)
    return QuantizedBase.from_dict(box[0])
