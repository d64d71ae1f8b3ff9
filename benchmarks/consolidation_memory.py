"""Peak memory of consolidating a sharded checkpoint: `accel-fsdp checkpoint consolidate` (streaming) against
`accelerate merge-weights` (loads the whole state dict), on a model large enough to see the difference.

    python benchmarks/consolidation_memory.py [--layers 24] [--width 1024] [--shard-size 100MB] [--workdir DIR]

It trains a GPT-2-shaped model from scratch for one step on 2 CPU ranks (so the checkpoint is a real one, written
by the real save path), then runs both tools in fresh processes and prints each one's peak resident memory
next to the size of the weights. A benchmark command, not a test: the figures depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def peak_of(command: list[str]) -> tuple[int, float]:
    """Run `command` in a child of a fresh wrapper process; return (exit status, peak RSS in MB of the child)."""
    wrapper = ("import resource, subprocess, sys, json; rc = subprocess.call(sys.argv[1:]); "
               "print(json.dumps([rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024]))")
    out = subprocess.run([sys.executable, "-c", wrapper, *command], capture_output=True, text=True)
    rc, mb = json.loads(out.stdout.strip().splitlines()[-1])
    return rc, mb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--shard-size", default="100MB")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="consolidation-bench-"))
    run = work / "run"
    overrides = [f"model.config_overrides.n_layer={args.layers}", f"model.config_overrides.n_embd={args.width}",
                 "model.config_overrides.n_head=16", "training.max_steps=1", "training.warmup_steps=0",
                 "training.micro_batch_size=1", "training.global_batch_size=2", "data.seq_len=64",
                 "training.eval_every_steps=null", "data.eval_fraction=0", "checkpoint.export_final=false",
                 "logging.sample_prompt=null"]
    if not (run / "checkpoints").exists():
        cmd = [sys.executable, "-m", "accel_fsdp", "recipe", "run", "quickstart", "--output-dir", str(run),
               "--overwrite"]
        for o in overrides:
            cmd += ["--set", o]
        subprocess.run(cmd, check=True, capture_output=True)
    ckpt = sorted((run / "checkpoints").glob("step-*"))[-1]
    weights = sum(f.stat().st_size for f in (ckpt / "pytorch_model_fsdp_0").glob("*.distcp"))
    ours_rc, ours = peak_of([sys.executable, "-m", "accel_fsdp", "checkpoint", "consolidate", str(ckpt),
                             str(work / "ours"), "--max-shard-size", args.shard_size, "--dtype", "fp32"])
    theirs_rc, theirs = peak_of([sys.executable, "-m", "accelerate.commands.accelerate_cli", "merge-weights",
                                 str(ckpt / "pytorch_model_fsdp_0"), str(work / "merged")])
    baseline_rc, baseline = peak_of([sys.executable, "-c", "import torch, transformers, torch.distributed.checkpoint"])
    params = json.loads((ckpt / "manifest.json").read_text())["parameters"]
    print(f"model: {params:,} parameters, {weights / 2**20:,.0f} MB of fp32 weights in the sharded checkpoint")
    print(f"python + torch + transformers alone:              {baseline:8,.0f} MB peak")
    print(f"accel-fsdp checkpoint consolidate ({args.shard_size} shards): {ours:8,.0f} MB peak (exit {ours_rc})")
    print(f"accelerate merge-weights:                         {theirs:8,.0f} MB peak (exit {theirs_rc})")
    print(f"above the bare interpreter: ours {ours - baseline:,.0f} MB, merge-weights {theirs - baseline:,.0f} MB")


if __name__ == "__main__":
    main()
