"""What a run reports: the metrics JSONL file, trackers, peak memory per rank, throughput and MFU.

One row per logged optimizer step in `<run>/metrics.jsonl` (written by the main process):
    {"kind": "train", "step", "loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_rank", "step_time_s",
     "peak_memory_bytes": [one per rank], "tokens_seen", "mfu" (GPU only)}
    {"kind": "eval", "step", "eval_loss", "eval_ppl", "eval_tokens"}
The same numbers go to the trackers (tensorboard, wandb) through `accelerator.log`.
"""

from __future__ import annotations

import json
import math
import resource
from pathlib import Path

import torch

# Dense bf16 peak of common accelerators (FLOP/s), for MFU. Matched by substring of the device name.
BF16_PEAK_FLOPS = {
    "H200": 989e12, "H100": 989e12, "H800": 989e12, "GH200": 989e12, "A100": 312e12, "A800": 312e12,
    "L40S": 362e12, "L40": 181e12, "L4": 121e12, "A10G": 70e12, "A10": 125e12, "RTX 4090": 165e12,
    "RTX 3090": 71e12, "V100": 125e12, "T4": 65e12, "MI300X": 1307e12, "MI250X": 383e12, "B200": 2250e12,
}


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: CUDA allocator peak on GPU, peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def device_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(BF16_PEAK_FLOPS, key=len, reverse=True):
        if key in name:
            return BF16_PEAK_FLOPS[key]
    return None


def flops_per_token(config, seq_len: int, trainable_fraction: float = 1.0) -> float:
    """Training FLOPs per token: 6 x dense parameters (forward 2N, backward 4N) plus attention 12 x L x H x S
    (the PaLM appendix B accounting; embeddings excluded). LoRA skips the weight-gradient half of the
    backward of frozen weights: about 4N instead of 6N."""
    from accel_fsdp.memory import shape_of

    s = shape_of(config)
    head_dim = s.hidden // s.heads
    attn = s.hidden * s.heads * head_dim * 2 + s.hidden * s.kv_heads * head_dim * 2
    mlp = (3 if s.gated_mlp else 2) * s.hidden * s.intermediate
    dense = s.layers * (attn + mlp) + s.vocab * s.hidden  # the output projection counts, the embedding lookup not
    per_param = 6.0 if trainable_fraction >= 0.5 else 4.0
    return per_param * dense + 12.0 * s.layers * s.heads * head_dim * seq_len


class MetricsWriter:
    """Appends rows to metrics.jsonl (main process only) and forwards them to the trackers."""

    def __init__(self, accelerator, path: Path, start_step: int):
        self.accelerator = accelerator
        self.path = path
        if accelerator.is_main_process and path.exists():
            # A resumed run repeats the steps after its checkpoint: drop their rows from the interrupted attempt.
            kept = [r for r in read_metrics(path) if r.get("step", 0) <= start_step] if start_step else []
            path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def write(self, row: dict, step: int) -> None:
        if self.accelerator.is_main_process:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        scalars = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        if self.accelerator.trackers:
            self.accelerator.log({f"{row['kind']}/{k}": v for k, v in scalars.items()}, step=step)


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


def read_metrics(path: Path) -> list[dict]:
    """The rows of a metrics file. A last line cut short (the run was killed while writing it) is skipped."""
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise
    return rows
