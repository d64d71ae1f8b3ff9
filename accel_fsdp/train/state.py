"""The training state: what the loop advances each optimizer step and a checkpoint saves. The loop (train/loop.py)
owns it; the logger and evaluator only read it; only the checkpointer's resume builds one, from disk."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainingState:
    step: int = 0
    """Optimizer steps done."""
    tokens_seen: int = 0
    """Training tokens (padding excluded) of those steps, over all ranks."""

    def advance(self, tokens: int) -> None:
        """One more optimizer step, over a global batch of `tokens` tokens."""
        self.step += 1
        self.tokens_seen += tokens
