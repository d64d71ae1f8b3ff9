"""Per-block compilation (`training.compile`): each transformer block's forward compiled by torch.compile (inductor),
before the model is sharded; what can stop it, said before launch.

Regional compilation (torchtitan, Accelerate's `compile_regions`): the blocks of a model are one class with one
forward, so dynamo compiles that code once and every block reuses the graph (parameters are graph inputs, not
constants: torch._dynamo.config.inline_inbuilt_nn_modules, on by default since torch 2.5), in seconds rather than
the whole model's minutes. Only the block's `forward` is compiled, not the module call around it: FSDP2's hooks
(added by `fully_shard` afterwards, on the block or on its checkpoint wrapper), the checkpoint wrapper and the
activation-offload hooks run eagerly around it, so nothing of FSDP is traced (Accelerate's `compile_regions_fsdp2`
compiles `_call_impl` in place for the same reason: hooks added later must still fire; accelerate/utils/other.py,
1.15.0).

Shapes: dynamo first compiles for the shapes it sees; when a block sees another (padded batches of another length,
padding-free rows of another token count), it compiles once more with those sizes symbolic (automatic dynamic
shapes), and that graph serves every later shape. Packed rows have one shape; their attention mask is None where
every row is one document (transformers' SDPA path then attends with is_causal) and a tensor elsewhere, one graph each.
So a run of packed or padding-free batches has at most two graphs per block class, held by tests/test_compile.py
(padded rows of changing lengths, mixing micro-batches with and without padding, may add a third). Only training is
compiled: a forward without gradients (evaluation, the reference's log-probabilities, the sample) runs the block
eagerly, since grad mode is one of dynamo's guards (another graph) and generation's KV cache another input
altogether.

This module must not import torch at module level: preflight reads `compile_problems`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass

from accel_fsdp.config.settings import Source
from accel_fsdp.errors import Problem
from accel_fsdp.layout import COMPILE_CACHE_ENV, compile_cache_dir

COMPILABLE_BLOCKS = ("GPT2Block", "LlamaDecoderLayer")
"""The block classes compiled, each proven to compile without a graph break with SDPA and with a flash kernel
(tests/test_compile.py); a model whose blocks are not among them is refused before launch."""
KEY = "training.compile"


def compile_problems(recipe, settings, view) -> list[Problem]:
    """Why `training.compile: true` cannot compile this model on this machine: one problem naming every reason, or
    none. The machine is judged only when the run is for this machine (not `recipe validate` of a GPU config on a
    laptop)."""
    if not recipe.training.compile:
        return []
    reasons = []
    blocks = [c for c in view.no_split_modules if c in COMPILABLE_BLOCKS]
    if not blocks:
        reasons.append(f"{view.class_name}'s blocks ({', '.join(view.no_split_modules) or 'none named'}) are not "
                       f"ones compilation is proven on ({', '.join(COMPILABLE_BLOCKS)})")
    if settings.fsdp_version.value != 2:
        reasons.append("blocks are compiled for FSDP2, and this config uses FSDP1")
    if settings.device.source != Source.TARGET_HARDWARE:
        reasons += machine_reasons(settings.device.value)
    if not reasons:
        return []
    return [Problem(recipe.where(KEY), "cannot compile here: " + "; ".join(reasons),
                    "set training.compile: false (the same training, eager)")]


def machine_reasons(device: str) -> list[str]:
    """What this machine lacks to compile for `device`: a C++ compiler for CPU kernels, Triton for GPU kernels, a
    Python that dynamo supports."""
    reasons = []
    if device == "cpu":
        # inductor compiles CPU kernels with $CXX, else g++ (clang++ on macOS) found on PATH (torch/_inductor/config.py
        # cpp.cxx, cpp_builder.get_cpp_compiler; torch 2.13.0)
        compiler = os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")
        if shutil.which(compiler) is None:
            reasons.append(f"inductor builds CPU kernels with a C++ compiler, and {compiler!r} "
                           f"({'$CXX' if os.environ.get('CXX') else 'its default'}) is not on PATH: install g++ "
                           "(apt-get install g++) or set CXX")
    elif importlib.util.find_spec("triton") is None:
        reasons.append("inductor builds GPU kernels with Triton, which is not installed (CUDA builds of torch bring "
                       "it: pip install triton)")
    unsupported = dynamo_unsupported()
    if unsupported:
        reasons.append(unsupported)
    return reasons


def dynamo_unsupported() -> str | None:
    """torch's own answer to whether dynamo runs on this Python and platform (torch._dynamo.eval_frame,
    check_if_dynamo_supported), in its words."""
    from torch._dynamo.eval_frame import check_if_dynamo_supported

    try:
        check_if_dynamo_supported()
    except Exception as e:  # torch raises RuntimeError naming the Python version or platform
        import torch

        return f"torch {torch.__version__} cannot compile here: {e}"
    return None


@dataclass(frozen=True)
class CompiledBlocks:
    """What `compile_blocks` did, for the start summary."""

    count: int
    classes: tuple[str, ...]
    cache: str
    """The compiler's cache folder."""


class TrainingForward:
    """A block's forward: compiled while gradients are recorded, eager otherwise (see the module docstring)."""

    def __init__(self, eager, *, skew: float = 0.0):
        import torch

        self.eager = eager
        self.compiled = torch.compile(_skewed(eager, skew) if skew else eager, backend="inductor")
        self.is_grad_enabled = torch.is_grad_enabled

    def __call__(self, *args, **kwargs):
        return (self.compiled if self.is_grad_enabled() else self.eager)(*args, **kwargs)


def _skewed(forward, relative: float):
    """`forward` whose hidden-state output is off by `relative` (a scale, which inductor keeps, where it would drop a
    round trip through a narrower dtype): only for `verify`'s proof that its check can fail."""

    def skewed(*args, **kwargs):
        out = forward(*args, **kwargs)
        first = (out[0] if isinstance(out, tuple) else out) * (1 + relative)
        return (first, *out[1:]) if isinstance(out, tuple) else first

    return skewed


def compile_blocks(model, *, skew: float = 0.0) -> CompiledBlocks:
    """Compile the forward of every block of `model` (the classes of COMPILABLE_BLOCKS) in place, before FSDP wraps
    them; the compiler's cache goes to `compile_cache_dir` (kept between runs). Compilation itself happens at the
    first forward with gradients. `skew`: see `_skewed`."""
    cache = compile_cache_dir()
    os.environ[COMPILE_CACHE_ENV] = str(cache)  # before the first compile, which reads it
    blocks = [m for m in model.modules() if type(m).__name__ in COMPILABLE_BLOCKS]
    for block in blocks:
        block.forward = TrainingForward(block.forward, skew=skew)
    return CompiledBlocks(len(blocks), tuple(sorted({type(b).__name__ for b in blocks})), str(cache))


def compiled_forwards(model) -> list:
    """The `TrainingForward` of every compiled block of `model`."""
    return [m.forward for m in model.modules() if isinstance(m.__dict__.get("forward"), TrainingForward)]


def compile_statistics() -> dict[str, int]:
    """This process's compiler counters: graphs compiled, graph breaks, the cache's hits and misses
    (torch._dynamo.utils.counters; names as torch 2.11 to 2.13 spell them)."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "cache_hits": int(counters["inductor"].get("fxgraph_cache_hit", 0)),
            "cache_misses": int(counters["inductor"].get("fxgraph_cache_miss", 0))}


def describe(compiled: CompiledBlocks, seconds: float, statistics: dict[str, int]) -> str:
    """The start summary's line."""
    cache = (f"cache {compiled.cache}: {statistics['cache_hits']} hit(s), {statistics['cache_misses']} miss(es)")
    return (f"  compile   {compiled.count} {'/'.join(compiled.classes)} blocks compiled (inductor) in {seconds:.1f} s "
            f"(the first micro-step, forward and backward; {statistics['graphs']} graph(s)); {cache}")
