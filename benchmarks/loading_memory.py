"""Host memory while a pretrained model is loaded and sharded on CPU ranks: each rank's growth (sharding.json) and the
whole machine's, sampled every 0.1 s over every rank process, against the size of one copy of the weights.

    python benchmarks/loading_memory.py [--ranks 2 4] [--quantize | --lora] [--every-rank] [--workdir DIR]

It saves a GPT-2 of gpt2-medium's shape (24 blocks, width 1024, 355M parameters, fp32 safetensors) built from its
config with random weights (no download), then runs `accel-fsdp recipe run` on it for one step with
fsdp_cpu_ram_efficient_loading (rank 0 reads) or, with --every-rank, without it, under `--benchmark` (no final
checkpoint). `--quantize` makes it QLoRA (model.quantize: nf4, LoRA on c_attn): one copy is then the quantized base;
`--lora` the same LoRA on a bf16 base.

What it prints, per rank count: one copy of the weights as the ranks hold them (the sum of every rank's weight bytes
from sharding.json: fp32, or NF4 blocks plus bf16 embeddings and norms), each rank's peak growth while loading, the
machine's (the sampled peak of the ranks' summed resident memory less their sum when loading began) and its ratio to
one copy. A benchmark command, not a test: the figures depend on the machine (docs/PERFORMANCE.md has ours).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def save_model(folder: Path) -> int:
    """A gpt2-medium-shaped GPT-2 with the built-in tokenizer, saved like a hub model; its parameter count."""
    from accel_fsdp.quiet import quiet_libraries

    quiet_libraries()  # transformers imports torchao when it is installed: its C-extension lines on CPU
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from accel_fsdp.data.synthetic import build_tokenizer

    if (folder / "config.json").exists():
        return json.loads((folder / "parameters.json").read_text())
    tok = build_tokenizer()
    config = AutoConfig.for_model("gpt2", n_layer=24, n_embd=1024, n_head=16, n_positions=1024, vocab_size=50257,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                  bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    parameters = sum(p.numel() for p in model.parameters())
    (folder / "parameters.json").write_text(json.dumps(parameters))
    return parameters


def rank_processes(root: int) -> dict[int, int]:
    """pid -> resident bytes of every FSDP rank launched under process `root` (a descendant whose environment has
    LOCAL_RANK)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    family, grew = {root}, True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in family and pid not in family:
                family.add(pid)
                grew = True
    out = {}
    page = os.sysconf("SC_PAGE_SIZE")
    for pid in family - {root}:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if b"\0LOCAL_RANK=" not in b"\0" + f.read():
                    continue
            with open(f"/proc/{pid}/statm") as f:
                out[pid] = int(f.read().split()[1]) * page
        except OSError:
            continue
    return out


def run(model: Path, work: Path, ranks: int, quantize: bool, rank0: bool, lora: bool = False) -> dict:
    """One launch; the machine's sampled peak and what sharding.json says."""
    name = f"{'nf4' if quantize else 'lora' if lora else 'full'}-{ranks}-{'rank0' if rank0 else 'every'}"
    config = yaml.safe_load((REPO / "accelerate_configs" / "fsdp_cpu.yaml").read_text())
    config["num_processes"] = ranks
    config["fsdp_config"]["fsdp_cpu_ram_efficient_loading"] = rank0
    (work / f"{name}.yaml").write_text(yaml.safe_dump(config))
    recipe = {"name": name, "model": {"name_or_path": str(model)},
              "data": {"path": "builtin:quickstart", "seq_len": 32, "eval_fraction": 0, "max_rows": 200},
              "training": {"micro_batch_size": 1, "global_batch_size": ranks, "max_steps": 1, "warmup_steps": 0,
                           "mixed_precision": "bf16" if quantize or lora else "fp32"},
              "checkpoint": {"keep_last": None}, "logging": {"every_steps": 1, "sample_prompt": None}}
    if quantize or lora:
        recipe["model"].update(lora={"enabled": True, "target_modules": ["c_attn"]})
    if quantize:
        recipe["model"].update(quantize="nf4")
    (work / f"{name}-recipe.yaml").write_text(yaml.safe_dump(recipe))
    out = work / name
    shutil.rmtree(out, ignore_errors=True)  # its sharding.json ends the sampling
    # glibc keeps freed mid-size blocks in its heap once its mmap threshold has grown: a fixed threshold returns
    # them, so resident memory shows live memory only (as in tests/test_gpu_path.py).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    proc = subprocess.Popen([sys.executable, "-m", "accel_fsdp", "recipe", "run", str(work / f"{name}-recipe.yaml"),
                             "--accelerate-config", str(work / f"{name}.yaml"), "--output-dir", str(out),
                             "--overwrite", "--benchmark"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    peak, samples = 0, 0
    while proc.poll() is None and not (out / "sharding.json").exists():
        peak = max(peak, sum(rank_processes(proc.pid).values()))
        samples += 1
        time.sleep(0.1)
    output = proc.communicate()[0]
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{output[-4000:]}")
    record = json.loads((out / "sharding.json").read_text())
    return {"name": name, "peak": peak, "samples": samples, "record": record}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--quantize", action="store_true", help="QLoRA: model.quantize nf4 with LoRA")
    parser.add_argument("--lora", action="store_true", help="LoRA on a bf16 base (what --quantize holds in 4 bits)")
    parser.add_argument("--every-rank", action="store_true", help="every rank reads the weights (no rank-0 loading)")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="loading-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    parameters = save_model(work / "gpt2-medium-shape")
    file_bytes = sum(f.stat().st_size for f in (work / "gpt2-medium-shape").glob("*.safetensors"))
    print(f"model: {parameters:,} parameters, {file_bytes / 2**20:,.0f} MiB of fp32 safetensors")
    for ranks in args.ranks:
        result = run(work / "gpt2-medium-shape", work, ranks, args.quantize, not args.every_rank, args.lora)
        record = result["record"]
        weights = record.get("weight_bytes")
        copy = sum(weights) if weights else file_bytes
        growth = record["loading_peak_rss_growth_bytes"]
        baseline = record.get("loading_rss_baseline_bytes") or []
        machine = result["peak"] - sum(baseline) if baseline else None
        print(f"{result['name']}: one copy {copy / 2**20:,.0f} MiB"
              + (f" (ranks hold {' / '.join(f'{w / 2**20:,.0f}' for w in weights)} MiB)" if weights else ""))
        print("  each rank's peak growth while loading: "
              + " / ".join(f"{g / 2**20:,.0f} MiB ({g / copy:.2f} x copy)" for g in growth))
        if machine is not None:
            print(f"  the machine's: {machine / 2**20:,.0f} MiB = {machine / copy:.2f} x one copy "
                  f"(peak of the ranks' sum {result['peak'] / 2**20:,.0f} MiB, {result['samples']} samples)")


if __name__ == "__main__":
    main()
