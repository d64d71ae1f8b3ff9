"""Silence what a user can do nothing about: library progress bars in every rank, and deprecation notices raised
inside torch, Accelerate, transformers and PEFT about their own internals; and what a stream that is not a live
terminal cannot show (a redrawn progress bar, colours)."""

from __future__ import annotations

import logging
import warnings

_INTERNAL_NOTICES = (
    "TypedStorage is deprecated", ".*FSDP.state_dict_type.*", ".*set_state_dict_type.*", ".*_get_pg_default_device.*",
    ".*torch.distributed.checkpoint.*", "Multiple backends are registered", "Please use DTensor instead",
    ".*torch.distributed is disabled.*", ".*is_gradient_checkpointing.*",
)


_HANDLED_HERE = (
    # LoRA targets of both kinds (GPT-2's Conv1D blocks and a Linear head): PEFT sets fan_in_fan_out right for each
    # layer as it wraps it, and warns for the layers of the other kind (peft 0.21.2 tuners/lora/layer.py,
    # dispatch_default), on every rank and on every load of the adapter.
    "fan_in_fan_out is set to",
    # An adapted tied head: the "complications when merging" it warns of are handled by the merge, which writes the
    # head apart from the embeddings (checkpoint/consolidate.py `_untie_an_adapted_head`, checkpoint/merge.py).
    "Model has `tie_word_embeddings=True` and a tied layer is part of",
    # An adapted head: Accelerate's adapter-only checkpoint takes PEFT's adapter state dict with save_embedding_layers
    # left "auto" (accelerate 1.15 utils/fsdp_utils.py, _get_model_state_dict), and PEFT saves the head's base weight
    # with its adapters, saying so at every save of every rank (peft 0.21.2 utils/save_and_load.py); resume, export
    # and merge read that weight.
    "Setting `save_embedding_layers` to `True` as embedding layers found in `target_modules`",
    # FSDP1's NO_SHARD (one rank, or asked for) saves whole tensors where SHARDED_STATE_DICT was asked, and says so at
    # every save of every rank (torch/distributed/fsdp/_state_dict_utils.py, _pre_state_dict_hook; torch 2.13.0): the
    # start summary names NO_SHARD, and distributed checkpointing loads those tensors on any number of ranks.
    "When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict will be returned",
    # FSDP1's NO_SHARD on several ranks: torch calls it deprecated and points to DistributedDataParallel
    # (torch/distributed/fsdp/_init_utils.py, _init_core_state; torch 2.13.0), which is not a choice here. It stays
    # FSDP1's DDP-like mode, the one `accel-fsdp estimate` offers as the least communication where the model fits.
    "The `NO_SHARD` sharding strategy is deprecated",
)
"""Library warnings about what this package already handles: nothing for the user to do."""


def quiet_warnings() -> None:
    """The warning filters and loggers alone; cheap (imports nothing). Every command sets them through
    `quiet_libraries` (cli/main.py)."""
    for pattern in _INTERNAL_NOTICES + _HANDLED_HERE:
        warnings.filterwarnings("ignore", message=pattern)
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    # "sharding_strategy is deprecated in favor of reshard_after_forward": we name FSDP1's strategy on purpose.
    logging.getLogger("accelerate.utils.dataclasses").setLevel(logging.ERROR)
    # torchao (imported for model.quantize, and by transformers when it is installed) says "Failed to load
    # .../_C_mxfp8...so" for each C extension a CPU-only torch cannot load (torchao/__init__.py, logger.warning;
    # 0.18.0): NF4 is pure PyTorch and needs none of them. Its registrations make torch's pytree say that Enum
    # subclasses no longer need register_constant (torch/utils/_pytree.py, torch 2.13.0).
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)


def quiet_libraries() -> None:
    """Also the libraries' own loggers and progress bars: through the environment variables and loggers they read,
    so that silencing a library does not import it (datasets costs half a second); a library already imported is
    told directly."""
    import os
    import sys

    quiet_warnings()
    # transformers reads TRANSFORMERS_VERBOSITY at import (transformers/utils/logging.py, _get_default_logging_level);
    # its progress bars and the hub's follow HF_HUB_DISABLE_PROGRESS_BARS; datasets' its own variable
    # (datasets/utils/tqdm.py). Checked with transformers 5.24.0, datasets 5.2.0.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    for name in ("transformers", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if "transformers" in sys.modules:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    if "datasets" in sys.modules:
        import datasets

        datasets.logging.set_verbosity_error()
        datasets.disable_progress_bars()


def live_terminal(stream) -> bool:
    """`stream` is a terminal that redraws a line in place: not a file, a pipe or a CI log (where a progress bar's
    carriage returns pile up as one long line of garbage), not TERM=dumb (Emacs' shell, some CI runners)."""
    import os

    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # no such method, or closed
        return False
    return tty and os.environ.get("TERM", "") != "dumb"


def colour_allowed(stream) -> bool:
    """Colours on `stream`: a live terminal, and NO_COLOR not set to anything (no-color.org)."""
    import os

    return live_terminal(stream) and not os.environ.get("NO_COLOR")


class _OutlivesItsReader:
    """A text stream whose reader may go away (`recipe run ... | head`, a `| tee` that was killed): the first write or
    flush that finds the pipe closed points the stream's file descriptor at /dev/null, and it and every later write
    succeed there. Python ignores SIGPIPE and raises BrokenPipeError instead, in whatever wrote: a rank's progress
    line in the middle of a training step ended the run."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()
            self._stream.flush()  # what was buffered goes to /dev/null now

    def _to_devnull(self) -> None:
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def outlive_closed_output() -> None:
    """stdout and stderr of this process go on into /dev/null once their reader is gone, instead of raising
    BrokenPipeError into a training step (`_OutlivesItsReader`). For a process whose work matters more than its
    output: a rank, the launcher waiting for its ranks."""
    import sys

    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _OutlivesItsReader):
            setattr(sys, name, _OutlivesItsReader(stream))
