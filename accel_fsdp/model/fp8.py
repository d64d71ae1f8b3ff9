"""FP8 training (`training.mixed_precision: fp8`): the linear layers of a Llama's blocks multiply in float8 (torchao
0.18's float8 training, tensorwise scales: e4m3 in the forward, e5m2 for the gradients), everything else computes in
bf16 with fp32 master weights, and FSDP2 all-gathers the converted weights in float8 (half the bytes of bf16).

Which layers (`fp8_layer_names`): torch `nn.Linear` modules whose two dimensions are multiples of 16 (what the float8
matrix kernels take), never the output head (its logits feed the loss directly, and a 128K-wide head in float8 moves
the loss by more than the rest together; torchtitan leaves it out too). GPT-2 has none: its projections are
transformers' `Conv1D`, which torchao does not convert, so fp8 is refused for it, as for models we do not know, CPUs
and GPUs below compute capability 8.9 (`fp8_problems`, before launch).

The order in a rank (train/knobs.py): convert, compile, checkpoint, shard; after each optimizer step the weights'
scales for the next all-gather are computed in one all-reduce (`precompute_scales`, torchao's
`precompute_float8_dynamic_scale_for_fsdp`).

This module must not import torch or torchao at module level: preflight reads `fp8_problems`.
"""

from __future__ import annotations

import importlib.util

from accel_fsdp.config.precision import FP8
from accel_fsdp.config.settings import Source
from accel_fsdp.errors import Problem

CAPABILITY = (8, 9)
"""The first compute capability with float8 tensor cores (Ada; Hopper is 9.0)."""
FP8_BLOCKS = ("LlamaDecoderLayer",)
"""The models fp8 is offered for, by their block class."""
TORCHAO = "torchao==0.18.0"
KEY = "training.mixed_precision"


def fp8_problems(recipe, settings, view, capability: tuple[int, int] | None) -> list[Problem]:
    """Why fp8 cannot train this recipe here: one problem naming every reason, or none. `capability`: the GPUs'
    lowest compute capability, None when not known (no GPU here, or a config judged for other hardware)."""
    if settings.mixed_precision.value != FP8:
        return []
    reasons = []
    if "GPT2Block" in view.no_split_modules:
        reasons.append("GPT-2's projections are transformers' Conv1D layers, not torch Linear layers, so torchao "
                       "converts none of them")
    elif not any(c in FP8_BLOCKS for c in view.no_split_modules):
        reasons.append(f"fp8 is offered for Llama blocks ({', '.join(FP8_BLOCKS)}), and {view.class_name}'s are "
                       f"{', '.join(view.no_split_modules) or 'not named'}")
    here = settings.device.source != Source.TARGET_HARDWARE
    if settings.device.value == "cpu":
        reasons.append("this run is on CPU, and float8 matrix products need a GPU of compute capability 8.9 or newer "
                       "(Ada, Hopper, Blackwell)")
    elif capability is not None and tuple(capability) < CAPABILITY:
        reasons.append(f"the GPU's compute capability is {capability[0]}.{capability[1]}, and float8 matrix products "
                       f"need {CAPABILITY[0]}.{CAPABILITY[1]} or newer (Ada, Hopper, Blackwell)")
    if settings.fsdp_version.value != 2:
        reasons.append("the float8 all-gather is FSDP2's, and this config uses FSDP1")
    if recipe.model.lora.enabled:
        reasons.append("fp8 trains full fine-tunes: LoRA's frozen base would stay bf16")
    if here and importlib.util.find_spec("torchao") is None:
        reasons.append(f"torchao is not installed (pip install {TORCHAO})")
    if not reasons:
        return []
    return [Problem(settings.mixed_precision.where(recipe, KEY, "mixed_precision"), "fp8 cannot train here: "
                    + "; ".join(reasons), "use training.mixed_precision: bf16")]


def fp8_layer_names(model) -> list[str]:
    """The names of the linear layers fp8 converts: torch Linear modules (not a subclass: LoRA's and torchao's own
    layers are not), both dimensions multiples of 16, not the output head."""
    import torch

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [name for name, module in model.named_modules()
            if type(module) is torch.nn.Linear and module is not head
            and module.in_features % 16 == 0 and module.out_features % 16 == 0]


def convert_to_fp8(model) -> list[str]:
    """Swap the layers of `fp8_layer_names` for torchao's Float8Linear in place (before compiling and sharding), with
    the float8 all-gather of FSDP2; returns their names."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = set(fp8_layer_names(model))
    convert_to_float8_training(model, module_filter_fn=lambda module, name: name in names,
                               config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    return sorted(names)


def precompute_scales(model) -> None:
    """After an optimizer step: the float8 scales of every converted weight for the next all-gather, in one
    all-reduce (torchao/float8/fsdp_utils.py, precompute_float8_dynamic_scale_for_fsdp; 0.18.0)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
