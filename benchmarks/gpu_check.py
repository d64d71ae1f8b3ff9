"""Check the GPU-path fixes on a real GPU machine, in a few minutes: `python benchmarks/gpu_check.py`.

Runs the real CLI on every visible GPU (1, 2, 8...) with tiny or small models made here (no downloads), and prints
one line per check, PASS / FAIL / SKIP, with the figures. What each check proves is in docs/PERFORMANCE.md ("The
GPU path"); the same properties are held on CPU ranks by tests/test_gpu_path.py.

  1  CPU offload and FULL_STATE_DICT asked for by the recipe train on NCCL (cuda:nccl,cpu:gloo process group)
  2  rank-0-only loading: host memory growth of each rank while loading a 1.4 GB model
  3  packed documents stay apart with flash_attention_2 (padding-free batches), when flash-attn is installed
  4  gradients held between micro-steps: the rank's shard by default, the whole model when deferred
  5  activation checkpointing with dropout: the same losses with and without it
  6  more processes than GPUs: refused before launch
  7  the collective timeout and backends the process group really has
  8  the offloaded optimizer step (fused AdamW, the rank's share of the cores)
  9  the device's peak FLOP/s used for MFU, and the MFU of a short run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
RESULTS: list[tuple[str, str, str]] = []


def say(check: str, status: str, figures: str) -> None:
    RESULTS.append((check, status, figures))
    print(f"{status:<5} {check:<34} {figures}", flush=True)


def cli(*args, env=None, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "accel_fsdp", *map(str, args)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})), timeout=timeout)


def config(work: Path, name: str, gpus: int, **fsdp) -> Path:
    data = yaml.safe_load((REPO / "accelerate_configs" / "fsdp_2gpu.yaml").read_text())
    data["num_processes"] = gpus
    data["fsdp_config"].pop("fsdp_transformer_layer_cls_to_wrap", None)  # the model's own block class
    data["fsdp_config"].update(fsdp)
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def model(work: Path, name: str, layers: int, width: int, dropout: float = 0.0) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    from accel_fsdp.data.synthetic import build_tokenizer

    folder = work / name
    if folder.exists():
        return folder
    tok = build_tokenizer()
    cfg = AutoConfig.for_model("gpt2", n_layer=layers, n_embd=width, n_head=max(1, width // 64), n_positions=1024,
                               vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                               bos_token_id=tok.eos_token_id, resid_pdrop=dropout, embd_pdrop=dropout,
                               attn_pdrop=dropout)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def recipe(work: Path, name: str, model_dir: Path, gpus: int, **sections) -> Path:
    data = {"name": name, "model": {"name_or_path": str(model_dir)},
            "data": {"path": "builtin:quickstart", "seq_len": 128, "eval_fraction": 0, "max_rows": 4000},
            "training": {"micro_batch_size": 2, "global_batch_size": 2 * gpus * 4, "max_steps": 4, "lr": 1e-4,
                         "warmup_steps": 0},
            "checkpoint": {"export_final": False}, "logging": {"every_steps": 1, "sample_prompt": None}}
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def failed(proc) -> str:
    return (proc.stderr or proc.stdout).strip().splitlines()[-1][:160] if (proc.stderr or proc.stdout) else "no output"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count(), help="ranks (default: visible GPUs)")
    parser.add_argument("--work", type=Path, default=None, help="working folder (default: a temporary one)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device visible (tests/test_gpu_path.py holds these properties on CPU ranks)")
    gpus = args.gpus
    work = args.work or Path(tempfile.mkdtemp(prefix="accel-fsdp-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(0)
    print(f"accel-fsdp GPU check: {gpus} x {name}, torch {torch.__version__}, work folder {work}")
    tiny = model(work, "tiny", 2, 256)
    full = config(work, "full", gpus)

    # 1: offload and a full state dict from the recipe, on NCCL
    run = work / "offload"
    proc = cli("recipe", "run", recipe(work, "offload", tiny, gpus, fsdp={"cpu_offload": True},
                                       checkpoint={"state_dict_type": "FULL_STATE_DICT", "every_steps": 2}),
               "--accelerate-config", full, "--output-dir", run, "--overwrite")
    record = json.loads((run / "sharding.json").read_text()).get("process_group", {}) if proc.returncode == 0 else {}
    say("1 offload + FULL_STATE_DICT", "PASS" if proc.returncode == 0 else "FAIL",
        f"backends {record.get('backends')}" if proc.returncode == 0 else failed(proc))
    say("7 process group", "PASS" if record.get("timeout_s") == 3600 and "gloo" in str(record.get("backends")) else
        "FAIL", f"backends {record.get('backends')}, timeout {record.get('timeout_s')} s (recipe: 60 min)")

    # 2: loading memory
    big = model(work, "big", 24, 1024)
    size = sum(f.stat().st_size for f in big.glob("*.safetensors"))
    growth = {}
    for label, efficient in (("rank 0 reads", True), ("every rank reads", False)):
        run = work / f"load-{efficient}"
        proc = cli("recipe", "run", recipe(work, f"load{efficient}", big, gpus, training={"max_steps": 1}),
                   "--accelerate-config", config(work, f"load{efficient}", gpus,
                                                 fsdp_cpu_ram_efficient_loading=efficient),
                   "--output-dir", run, "--overwrite", "--benchmark")
        if proc.returncode:
            say(f"2 loading ({label})", "FAIL", failed(proc))
            continue
        growth[efficient] = json.loads((run / "sharding.json").read_text())["loading_peak_rss_growth_bytes"]
        say(f"2 loading ({label})", "INFO", "host RSS growth per rank " +
            ", ".join(f"{g / size:.2f}x" for g in growth[efficient]) + f" of the {size / 2**30:.2f} GiB model; "
            f"machine {sum(growth[efficient]) / size:.2f}x")
    if True in growth:
        total = sum(growth[True]) / size
        say("2 loading target", "PASS" if total <= 1.2 + 0.1 * gpus else "FAIL",
            f"{total:.2f}x one copy on the machine (target <= 1.2x plus per-process overhead)")

    # 3: flash attention with packing
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        say("3 FA2 packing isolation", "SKIP", "flash-attn is not installed (pip install flash-attn)")
    else:
        from transformers import AutoModelForCausalLM

        from accel_fsdp.data.batches import PADDING_FREE, collate

        m = AutoModelForCausalLM.from_pretrained(tiny, attn_implementation="flash_attention_2",
                                                 dtype=torch.bfloat16).cuda().eval()
        docs = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
        rows = {"input_ids": [docs[0] + docs[1], docs[2]], "labels": [docs[0] + docs[1], docs[2]],
                "position_ids": [list(range(5)) + list(range(3)), list(range(7))], "length": [8, 7]}
        batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in collate(rows, 0, True,
                                                                                         layout=PADDING_FREE).items()}
        batch.pop("labels")
        with torch.no_grad():
            packed = m(**batch, use_cache=False).logits[0]
            alone = torch.cat([m(input_ids=torch.tensor([d]).cuda()).logits[0] for d in docs])
        diff = (packed.float() - alone.float()).abs().max().item()
        say("3 FA2 packing isolation", "PASS" if diff < 5e-2 else "FAIL", f"max logit difference {diff:.2e} (bf16)")

    # 4: gradients between micro-steps
    held = {}
    for deferred in (False, True):
        run = work / f"grads-{deferred}"
        proc = cli("recipe", "run", recipe(work, f"grads{deferred}", big, gpus, training={"max_steps": 2},
                                           fsdp={"reduce_every_micro_step": not deferred}),
                   "--accelerate-config", full, "--output-dir", run, "--overwrite", "--benchmark",
                   env={"ACCEL_FSDP_PROBE": "grad-bytes"})
        if proc.returncode:
            say("4 gradients between micro-steps", "FAIL", failed(proc))
            break
        lines = (run / "trace" / "grad-bytes-rank0.jsonl").read_text().splitlines()
        held[deferred] = max(json.loads(line)["bytes"] for i, line in enumerate(lines) if i % 4)
    if len(held) == 2:
        say("4 gradients between micro-steps", "PASS" if gpus == 1 or held[False] < 0.6 * held[True] else "FAIL",
            f"{held[False] / 2**20:,.0f} MiB per rank by default, {held[True] / 2**20:,.0f} MiB deferred")

    # 5: activation checkpointing with dropout
    drop = model(work, "dropout", 2, 256, dropout=0.1)
    losses = {}
    for ac in (False, True):
        run = work / f"ac-{ac}"
        proc = cli("recipe", "run", recipe(work, f"ac{ac}", drop, gpus, training={"mixed_precision": "fp32"},
                                           model={"activation_checkpointing": ac}),
                   "--accelerate-config", full, "--output-dir", run, "--overwrite", "--benchmark")
        losses[ac] = [r["loss"] for r in metrics(run) if r["kind"] == "train"] if proc.returncode == 0 else None
    from accel_fsdp.tools.noise import equivalence_tolerance

    # fp32 GPU kernels need not add up in one order: verify's noise model for this global batch (2 x gpus x 4
    # sequences of 128 tokens, 4 micro-steps), over the 4 steps
    tol = equivalence_tolerance("fp32", 2 * gpus * 4 * 128, 4, 4)["loss"]
    ok = losses[False] and losses[True] and all(abs(a - b) <= tol * abs(a) for a, b in zip(*losses.values()))
    say("5 AC with dropout", "PASS" if ok else "FAIL", f"losses {losses[False]} vs {losses[True]}")

    # 6: more processes than GPUs
    proc = cli("recipe", "validate", "quickstart")  # warms the data cache
    proc = cli("recipe", "run", "quickstart", "--accelerate-config", config(work, "toomany", gpus + 1),
               "--output-dir", work / "toomany", "--overwrite")
    say("6 processes > GPUs", "PASS" if proc.returncode == 2 and "GPU(s)" in proc.stderr else "FAIL",
        failed(proc))

    # 8: the offloaded optimizer step
    proc = subprocess.run(["torchrun", "--nproc_per_node", str(gpus), str(REPO / "benchmarks" /
                                                                          "offload_optimizer_step.py")],
                          capture_output=True, text=True)
    say("8 offloaded optimizer step", "INFO" if proc.returncode == 0 else "FAIL",
        " | ".join(line.strip() for line in proc.stdout.splitlines()[1:]) or failed(proc))

    # 9: MFU
    from accel_fsdp.hardware import peak_flops

    run = work / "mfu"
    proc = cli("recipe", "run", recipe(work, "mfu", big, gpus, training={"max_steps": 6, "mixed_precision": "bf16"}),
               "--accelerate-config", full, "--output-dir", run, "--overwrite", "--benchmark")
    mfu = [r["mfu"] for r in metrics(run) if "mfu" in r] if proc.returncode == 0 else []
    say("9 MFU", "INFO" if mfu else "FAIL", f"{name}: bf16 peak {peak_flops(name, half=True)}, fp32 peak "
        f"{peak_flops(name, half=False)}; MFU of the last step {mfu[-1]:.1%}" if mfu else failed(proc))
    print(f"{sum(s == 'PASS' for _, s, _ in RESULTS)} passed, {sum(s == 'FAIL' for _, s, _ in RESULTS)} failed")
    sys.exit(1 if any(s == "FAIL" for _, s, _ in RESULTS) else 0)


if __name__ == "__main__":
    main()
