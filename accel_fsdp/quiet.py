"""Silence what a user can do nothing about: library progress bars in every rank, and deprecation notices raised
inside torch, Accelerate, transformers and PEFT about their own internals."""

from __future__ import annotations

import logging
import warnings

_INTERNAL_NOTICES = (
    "TypedStorage is deprecated", ".*FSDP.state_dict_type.*", ".*set_state_dict_type.*", ".*_get_pg_default_device.*",
    ".*torch.distributed.checkpoint.*", "Multiple backends are registered", "Please use DTensor instead",
    ".*torch.distributed is disabled.*", ".*is_gradient_checkpointing.*",
)


def quiet_warnings() -> None:
    """Cheap (imports nothing): for every command."""
    for pattern in _INTERNAL_NOTICES:
        warnings.filterwarnings("ignore", message=pattern)
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    # "sharding_strategy is deprecated in favor of reshard_after_forward": we name FSDP1's strategy on purpose.
    logging.getLogger("accelerate.utils.dataclasses").setLevel(logging.ERROR)


def quiet_libraries() -> None:
    """Also the libraries' own loggers and progress bars (imports them): for commands that use them anyway."""
    quiet_warnings()
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    try:
        import datasets

        datasets.logging.set_verbosity_error()
        datasets.disable_progress_bars()
    except ImportError:  # pragma: no cover
        pass
