"""Check the GPU path on a real GPU machine in a few minutes, or every part of it that runs on CPU ranks:

    python benchmarks/gpu_check.py                       # every visible GPU (1, 2, 8...)
    python benchmarks/gpu_check.py --cpu                 # 2 CPU ranks: the checks whose mechanism runs there
    python benchmarks/gpu_check.py --markdown out.md     # also write the results as a markdown table
    python benchmarks/gpu_check.py --budget-s 480        # start nothing after 8 minutes (the rest: SKIP)

It runs the real CLI (`recipe run` with a GPU accelerate config; with --cpu, that config on CPU ranks through
`recipe run --cpu`) on tiny or small models made here (no downloads), and prints one line per check, PASS / FAIL /
SKIP / INFO, with its figures; a skipped check says why. What each check proves is in docs/PERFORMANCE.md ("The GPU
path"); tests/test_gpu_path.py and tests/test_gpu_mechanisms.py hold the same properties on CPU ranks, and
tests/test_gpu_check.py runs this script with --cpu once a session (tests/conftest.py gpu_check_on_cpu_ranks), whose
runs of checks 2, 4 and 5 tests/test_gpu_path.py reads with bounds of its own.

  1  CPU offload and FULL_STATE_DICT asked for by the recipe train, and checkpoint, on the launch's process group
  2  rank-0-only loading: host memory growth of each rank while loading a model
  3  packed documents stay apart with flash_attention_2 (padding-free batches); on CPU ranks, a stand-in kernel
  4  gradients held between micro-steps: never an unsharded one unless deferred; with several ranks, the shard only
  5  activation checkpointing with dropout: the same losses with and without it
  6  more processes than GPUs: refused before launch
  7  the collective timeout and backends the process group really has
  8  the offloaded optimizer step (fused AdamW, the rank's share of the cores)
  9  the device's peak FLOP/s used for MFU, and the MFU of a short run
 10  the finite-step check: a non-finite step skipped on the device, the verdict read by the host after it, and a
     step's time with no check, with the norm read before the step, and with the skip on the device

The report is a list of sections (a title and a table), each to the terminal and to --markdown: the checks above,
then the throughput table of the speed and memory knobs (benchmarks/knob_throughput.py: eager, +compile, +chunked
loss, +activation offload, +FP8 on llama-3.2-1b and gpt2-xl; `--table-only` for it alone, `--no-table` without it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from accel_fsdp.files import write_atomic

REPO = Path(__file__).resolve().parents[1]
GPU_CONFIG = REPO / "accelerate_configs" / "fsdp_2gpu.yaml"
"""The GPU config every check runs (num_processes set to the ranks); on CPU ranks through `recipe run --cpu`."""


# ------------------------------------------------------------------------------------------- the report


@dataclass
class Result:
    check: str
    status: str
    """PASS, FAIL, SKIP (with why) or INFO (figures only)."""
    figures: str


@dataclass
class Section:
    """One table of the report."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def markdown(self) -> str:
        lines = [f"### {self.title}", "", "| " + " | ".join(self.columns) + " |",
                 "|" + "|".join("---" for _ in self.columns) + "|"]
        lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in self.rows]
        return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------- where checks run


@dataclass
class Ran:
    """One `recipe run` of a check."""

    proc: subprocess.CompletedProcess
    folder: Path

    @property
    def ok(self) -> bool:
        return self.proc.returncode == 0

    def failure(self) -> str:
        text = (self.proc.stderr or self.proc.stdout).strip().splitlines()
        return f"exit {self.proc.returncode}: " + (text[-1][:200] if text else "no output")

    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.folder / "metrics.jsonl").read_text().splitlines() if line.strip()]

    def sharding(self) -> dict:
        return json.loads((self.folder / "sharding.json").read_text())


@dataclass
class Machine:
    """Where the checks run: the ranks (GPUs, or CPU ranks with --cpu), a working folder, the models' sizes."""

    work: Path
    ranks: int
    cpu: bool
    device: str
    runs: dict[str, Ran] = field(default_factory=dict)
    """The runs made so far, by name: a check that reads another's run reuses it."""

    @property
    def sizes(self) -> dict[str, tuple[int, int]]:
        """(layers, width) of GPT-2 models: "tiny" for mechanisms, "big" where memory is measured (1.4 GB on GPUs;
        100 MB on CPU ranks, where both ranks' shards live in host memory too)."""
        return {"tiny": (2, 64), "big": (8, 512)} if self.cpu else {"tiny": (2, 256), "big": (24, 1024)}

    def config(self, name: str, **fsdp) -> Path:
        data = yaml.safe_load(GPU_CONFIG.read_text())
        data["num_processes"] = self.ranks
        data["fsdp_config"].pop("fsdp_transformer_layer_cls_to_wrap", None)  # the model's own block class
        data["fsdp_config"].update(fsdp)
        path = self.work / f"{name}.accelerate.yaml"
        path.write_text(yaml.safe_dump(data))
        return path

    def model(self, size: str, dropout: float = 0.0) -> Path:
        from transformers import AutoConfig, AutoModelForCausalLM

        from accel_fsdp.data.synthetic import build_tokenizer

        layers, width = self.sizes[size]
        folder = self.work / f"model-{size}-{dropout}"
        if folder.exists():
            return folder
        tok = build_tokenizer()
        # On CPU ranks as many positions as the checks' sequences have (128), as in the tests' models: with 1,024
        # the position table is 38% of the tiny model, and rank 1 was measured holding 31% of its fp32 gradient
        # bytes between micro-steps, not about half (its shard of the table, positions 512-1023, never used).
        positions = 128 if self.cpu else 1024
        cfg = AutoConfig.for_model("gpt2", n_layer=layers, n_embd=width, n_head=max(1, width // 64),
                                   n_positions=positions,
                                   vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                   bos_token_id=tok.eos_token_id, resid_pdrop=dropout, embd_pdrop=dropout,
                                   attn_pdrop=dropout)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
        tok.save_pretrained(folder)
        return folder

    def recipe(self, name: str, model_dir: Path, **sections) -> Path:
        data = {"name": name, "model": {"name_or_path": str(model_dir)},
                "data": {"path": "builtin:quickstart", "seq_len": 128, "eval_fraction": 0, "max_rows": 4000},
                "training": {"micro_batch_size": 2, "global_batch_size": 2 * self.ranks * 4, "max_steps": 4,
                             "lr": 1e-4, "warmup_steps": 0},
                "checkpoint": {"export_final": False}, "logging": {"every_steps": 1, "sample_prompt": None}}
        for section, values in sections.items():
            data.setdefault(section, {}).update(values)
        path = self.work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data))
        return path

    def run(self, name: str, recipe: Path, config: Path, *options, env=None) -> Ran:
        """`recipe run` into <work>/<name> (once per name); what it printed is kept in <work>/<name>.out (stdout,
        then stderr), for whoever reads the run afterwards (tests/test_gpu_path.py reads the start summary)."""
        if name not in self.runs:
            folder = self.work / name
            proc = cli("recipe", "run", recipe, "--accelerate-config", config, "--output-dir", folder, "--overwrite",
                       *(["--cpu"] if self.cpu else []), *options, env=env)
            write_atomic(self.work / f"{name}.out", (proc.stdout or "") + (proc.stderr or ""))
            self.runs[name] = Ran(proc, folder)
        return self.runs[name]


class Budget:
    """The wall-clock time the whole report may take (--budget-s; None: unbounded). A check or a table row that
    would start after it is spent is reported as SKIP, and a run in flight is stopped when it runs out, so a report
    made on a lent machine of limited time still comes back whole, with the rows it could not measure named."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.ends = None if seconds is None else time.monotonic() + seconds

    def left(self, cap: float) -> float:
        return cap if self.ends is None else max(1.0, min(cap, self.ends - time.monotonic()))

    def spent(self) -> str | None:
        if self.ends is not None and time.monotonic() >= self.ends:
            return f"not started: the time budget (--budget-s {self.seconds:.0f}) was spent"
        return None


BUDGET = Budget(None)


def run_within_budget(argv: list[str], cap: float, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run under the budget: a run stopped by it returns exit 124 and says so, as `timeout` would. The
    run is a process group of its own and the whole group is stopped (the launcher's ranks too, which would otherwise
    hold the GPU through the next check)."""
    limit = BUDGET.left(cap)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kwargs)
    try:
        out, err = proc.communicate(timeout=limit)
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                out, err = proc.communicate(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        return subprocess.CompletedProcess(argv, 124, "", f"stopped after {limit:.0f} s (the time budget)")


def cli(*args, env=None, timeout=900) -> subprocess.CompletedProcess:
    return run_within_budget([sys.executable, "-m", "accel_fsdp", *map(str, args)], timeout,
                             env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))


# ------------------------------------------------------------------------------------------------ checks


@dataclass(frozen=True)
class Check:
    number: int
    title: str
    run: Callable[[Machine], list[Result]]
    gpu_only: str | None = None
    """Why it cannot run on CPU ranks (None: it runs there too)."""


OFFLOAD_TIMEOUT_MINUTES = 45
"""Not the default (60): check 7 proves the recipe's value reaches every group."""


def offload_run(m: Machine) -> Ran:
    """Check 1's run, which check 7 reads too."""
    fsdp = {"cpu_offload": True, "collective_timeout_minutes": OFFLOAD_TIMEOUT_MINUTES}
    checkpoint = {"state_dict_type": "FULL_STATE_DICT", "every_steps": 2}
    return m.run("offload", m.recipe("offload", m.model("tiny"), fsdp=fsdp, checkpoint=checkpoint), m.config("full"))


def check_offload(m: Machine) -> list[Result]:
    run = offload_run(m)
    if not run.ok:
        return [Result("1 offload + FULL_STATE_DICT", "FAIL", run.failure())]
    saved = sorted(p.name for p in (run.folder / "checkpoints").glob("step-*"))
    backends = run.sharding().get("process_group", {}).get("backends")
    return [Result("1 offload + FULL_STATE_DICT", "PASS" if saved else "FAIL",
                   f"backends {backends}; checkpoints {', '.join(saved) or 'none'}")]


def check_process_group(m: Machine) -> list[Result]:
    run = offload_run(m)
    if not run.ok:
        return [Result("7 process group", "FAIL", run.failure())]
    record = run.sharding().get("process_group", {})
    # a gloo group says "cpu:gloo,cuda:gloo"; ours on GPUs, NCCL and gloo for CPU tensors (train/accelerator.py)
    want_backends = {"cpu:gloo", "cuda:gloo"} if m.cpu else {"cuda:nccl", "cpu:gloo"}
    want = OFFLOAD_TIMEOUT_MINUTES * 60
    groups = record.get("group_timeouts_s", {})
    ok = (set(str(record.get("backends")).split(",")) == want_backends and record.get("timeout_s") == want
          and all(t == want for t in groups.values()))
    return [Result("7 process group", "PASS" if ok else "FAIL",
                   f"backends {record.get('backends')} (want {','.join(sorted(want_backends))}); timeout "
                   f"{record.get('timeout_s')} s and "
                   f"{len(groups)} group(s) at {sorted(set(groups.values()))} s (recipe: {want} s)")]


def check_loading(m: Machine) -> list[Result]:
    """GPUs: the machine holds about one copy while loading (the shards go to GPU memory). CPU ranks hold their
    shards in host memory too, so there: each other rank grows by its shard plus a parameter in flight (1/ranks of
    the model plus a few percent), never by a copy of its own."""
    big = m.model("big")
    size = sum(f.stat().st_size for f in big.glob("*.safetensors"))
    growth, out = {}, []
    for label, efficient in (("rank 0 reads", True), ("every rank reads", False)):
        # 2 steps: the second step's loss shows that the shards received train like the ones read
        run = m.run(f"load-{efficient}", m.recipe(f"load-{efficient}", big, training={"max_steps": 2}),
                    m.config(f"load-{efficient}", fsdp_cpu_ram_efficient_loading=efficient), "--benchmark",
                    env={"MALLOC_MMAP_THRESHOLD_": "131072"})  # glibc returns freed broadcast buffers at once
        if not run.ok:
            out.append(Result(f"2 loading ({label})", "FAIL", run.failure()))
            continue
        growth[efficient] = run.sharding()["loading_peak_rss_growth_bytes"]
        out.append(Result(f"2 loading ({label})", "INFO", "host RSS growth per rank " + ", ".join(
            f"{g / size:.2f}x" for g in growth[efficient]) + f" of the {size / 2**20:,.0f} MiB model; machine "
            f"{sum(growth[efficient]) / size:.2f}x"))
    if True in growth:
        if m.cpu:
            others = max(growth[True][1:], default=0) / size
            bound = 1 / m.ranks + 0.25
            out.append(Result("2 loading target", "PASS" if others <= bound else "FAIL",
                              f"the other ranks grow by {others:.2f}x at most (target <= 1/{m.ranks} shard + 0.25)"))
        else:
            total = sum(growth[True]) / size
            out.append(Result("2 loading target", "PASS" if total <= 1.2 + 0.1 * m.ranks else "FAIL",
                              f"{total:.2f}x one copy on the machine (target <= 1.2x plus per-process overhead)"))
    return out


def check_packing(m: Machine) -> list[Result]:
    """Logits of packed documents in one padding-free row, laid out by the trainer's own collate, against each
    document alone (SDPA). Two computations of one logit that add up in other orders: each of the 2 x layers + 1
    matmuls on the way (layer norms keep the scale) adds one output rounding and a reordered fp32 sum of its inputs,
    so the logits agree within (2 L + 1) x (reordered(4 x width) + roundoff) of their scale; a document that sees
    another's tokens moves them by a large share of it."""
    from transformers import AutoModelForCausalLM

    from accel_fsdp.data.batches import batch_layout, collate
    from accel_fsdp.data.store import Sequence
    from accel_fsdp.tools.noise import ROUNDOFF, reordered

    if m.cpu:
        sys.path.insert(0, str(REPO / "tests"))
        from flash_standin import NAME, install

        calls, kernel, device, precision = install(), NAME, "cpu", "fp32"
    else:
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            return [Result("3 FA2 packing isolation", "SKIP", "flash-attn is not installed (pip install flash-attn)")]
        calls, kernel, device, precision = None, "flash_attention_2", "cuda", "bf16"
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    tiny = m.model("tiny")
    model = AutoModelForCausalLM.from_pretrained(tiny, attn_implementation=kernel, dtype=dtype).to(device).eval()
    alone_model = AutoModelForCausalLM.from_pretrained(tiny, attn_implementation="sdpa", dtype=dtype).to(device).eval()
    docs = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
    ids = [t for d in docs for t in d]
    packed = Sequence(torch.tensor(ids).numpy(), torch.tensor(ids).numpy(),
                      torch.tensor([i for d in docs for i in range(len(d))]).numpy())
    batch = collate([packed], 0, True, layout=batch_layout(model.config._attn_implementation, True))
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        logits = model(**batch, use_cache=False).logits[0].float()
        alone = torch.cat([alone_model(input_ids=torch.tensor([d], device=device)).logits[0] for d in docs]).float()
    layers, width = m.sizes["tiny"]
    scale = float(alone.abs().max())
    tolerance = (2 * layers + 1) * (reordered(4 * width) + ROUNDOFF[precision]) * scale
    diff = float((logits - alone).abs().max())
    seen = f"; the kernel got boundaries {calls[0]}" if calls else ""
    return [Result("3 FA2 packing isolation" + (" (CPU stand-in)" if m.cpu else ""), "PASS" if diff <= tolerance
                   else "FAIL", f"max logit difference {diff:.2e} ({precision}; tolerance {tolerance:.2e}){seen}")]


def dropout_run(m: Machine, name: str, **sections) -> Ran:
    """The tiny GPT-2 with dropout 0.1, in fp32, 4 steps of 4 micro-steps a rank, the gradient bytes traced, its final
    weights exported in fp32; `sections` changes one knob of it. Check 5's runs, and on CPU ranks check 4's, so that
    the reference without a knob is one run for both; tests/test_gpu_path.py reads these runs too (their losses and
    gradient norms bit for bit or within the noise model, the gradient bytes of rank 1, the exported weights)."""
    recipe = m.recipe(name, m.model("tiny", dropout=0.1), **sections,
                      training={"mixed_precision": "fp32"}, checkpoint={"export_final": True, "export_dtype": "fp32"})
    return m.run(name, recipe, m.config("full"), env={"ACCEL_FSDP_PROBE": "grad-bytes"})


def check_gradients(m: Machine) -> list[Result]:
    """Before every forward but a step's first: no unsharded gradient unless the reduction is deferred (what one
    rank can show: its shard is the whole model), and with several ranks, the shard alone. On GPUs the big model (the
    figures are its memory), on CPU ranks check 5's runs."""
    held, unsharded = {}, {}
    for deferred in (False, True):
        reduce = {"reduce_every_micro_step": not deferred}
        if m.cpu:
            run = dropout_run(m, "dropout-deferred", fsdp=reduce) if deferred else dropout_run(m, "dropout")
        else:
            run = m.run(f"grads-{deferred}", m.recipe(f"grads-{deferred}", m.model("big"), training={"max_steps": 2},
                                                      fsdp=reduce),
                        m.config("full"), "--benchmark", env={"ACCEL_FSDP_PROBE": "grad-bytes"})
        if not run.ok:
            return [Result("4 gradients between micro-steps", "FAIL", run.failure())]
        lines = [json.loads(x) for x in (run.folder / "trace" / "grad-bytes-rank0.jsonl").read_text().splitlines()]
        between = [x for i, x in enumerate(lines) if i % 4]  # 4 micro-steps an optimizer step
        held[deferred] = max(x["bytes"] for x in between)
        unsharded[deferred] = max(x["unsharded"] for x in between)
    ok = unsharded[False] == 0 and unsharded[True] > 0 and (m.ranks == 1 or held[False] < 0.6 * held[True])
    return [Result("4 gradients between micro-steps", "PASS" if ok else "FAIL",
                   f"held per rank {held[False] / 2**20:,.2f} MiB by default, {held[True] / 2**20:,.2f} MiB deferred; "
                   f"unsharded {unsharded[False] / 2**20:,.2f} vs {unsharded[True] / 2**20:,.2f} MiB")]


def check_activation_checkpointing(m: Machine) -> list[Result]:
    from accel_fsdp.tools.noise import equivalence_tolerance

    losses = {}
    for ac in (False, True):
        run = (dropout_run(m, "dropout-ac", model={"activation_checkpointing": True}) if ac
               else dropout_run(m, "dropout"))
        if not run.ok:
            return [Result("5 AC with dropout", "FAIL", run.failure())]
        losses[ac] = [r["loss"] for r in run.metrics() if r["kind"] == "train"]
    # fp32 kernels need not add up in one order: verify's noise model for this global batch (2 x ranks x 4
    # sequences of 128 tokens, 4 micro-steps), over the 4 steps
    tol = equivalence_tolerance("fp32", 2 * m.ranks * 4 * 128, 4, 4)["loss"]
    ok = len(losses[False]) == len(losses[True]) == 4 and all(
        abs(a - b) <= tol * abs(a) for a, b in zip(losses[False], losses[True]))
    return [Result("5 AC with dropout", "PASS" if ok else "FAIL",
                   f"losses {losses[False]} vs {losses[True]} (relative tolerance {tol:.1e})")]


def check_too_many_processes(m: Machine) -> list[Result]:
    cli("recipe", "validate", "quickstart")  # warms the data cache
    proc = cli("recipe", "run", "quickstart", "--accelerate-config", m.config("toomany"), "--num-processes",
               m.ranks + 1, "--output-dir", m.work / "toomany", "--overwrite")
    ok = proc.returncode == 2 and "GPU(s)" in proc.stderr
    return [Result("6 processes > GPUs", "PASS" if ok else "FAIL", Ran(proc, m.work).failure())]


def check_offloaded_step(m: Machine) -> list[Result]:
    size = ["--params", "4e6", "--steps", "5"] if m.cpu else []
    proc = run_within_budget([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(m.ranks),
                              str(REPO / "benchmarks" / "offload_optimizer_step.py"), *size], 900)
    figures = " | ".join(line.strip() for line in proc.stdout.splitlines()[1:])
    return [Result("8 offloaded optimizer step", "INFO" if proc.returncode == 0 and figures else "FAIL",
                   figures or Ran(proc, m.work).failure())]


def check_finite_read(m: Machine) -> list[Result]:
    size = ["--cpu", "--steps", "2", "--rounds", "1"] if m.cpu else []
    proc = run_within_budget([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(m.ranks),
                              str(REPO / "benchmarks" / "finite_check_cost.py"), *size], 600)
    figures = " | ".join(line.strip() for line in proc.stdout.splitlines()[1:] if line.startswith("  "))
    return [Result("10 finite-step check", "PASS" if proc.returncode == 0 and figures else "FAIL",
                   figures or Ran(proc, m.work).failure())]


def check_mfu(m: Machine) -> list[Result]:
    from accel_fsdp.hardware import peak_flops

    run = m.run("mfu", m.recipe("mfu", m.model("big"), training={"max_steps": 6, "mixed_precision": "bf16"}),
                m.config("full"), "--benchmark")
    mfu = [r["mfu"] for r in run.metrics() if r.get("mfu") is not None] if run.ok else []
    if not mfu:
        return [Result("9 MFU", "FAIL", run.failure() if not run.ok else "no MFU in the metrics")]
    half, full = peak_flops(m.device, half=True), peak_flops(m.device, half=False)
    return [Result("9 MFU", "INFO", f"{m.device}: dense peak {half / 1e12:,.0f} TFLOP/s bf16, {full / 1e12:,.0f} fp32; "
                                    f"MFU of the last step {mfu[-1]:.1%} (4 micro-steps of 2 x 128 tokens a rank: "
                                    "launch-bound by design; the throughput table measures MFU at training sizes)")]


CHECKS = [
    Check(1, "offload + FULL_STATE_DICT", check_offload),
    Check(2, "rank-0-only loading", check_loading),
    Check(3, "FA2 packing isolation", check_packing),
    Check(4, "gradients between micro-steps", check_gradients),
    Check(5, "AC with dropout", check_activation_checkpointing),
    Check(6, "processes > GPUs", check_too_many_processes,
          gpu_only="it counts visible GPUs, and CPU ranks have none to count (tests/test_gpu_path.py simulates them)"),
    Check(7, "process group", check_process_group),
    Check(8, "offloaded optimizer step", check_offloaded_step),
    Check(9, "MFU", check_mfu, gpu_only="MFU is measured against a GPU's peak FLOP/s; CPU ranks report none"),
    Check(10, "finite-step check", check_finite_read),
]


def checks_section(m: Machine) -> Section:
    return Section(f"GPU-path checks: {m.ranks} x {m.device}", ["check", "result", "figures"])


def run_checks(m: Machine, only: set[int] | None = None, section: Section | None = None,
               on_row: Callable[[], None] = lambda: None) -> Section:
    """The checks, each row added to `section` (a new one if None) and `on_row` called after each check."""
    section = section or checks_section(m)
    for check in CHECKS:
        if only and check.number not in only:
            continue
        started = time.monotonic()
        if BUDGET.spent():
            results = [Result(f"{check.number} {check.title}", "SKIP", BUDGET.spent())]
        elif m.cpu and check.gpu_only:
            results = [Result(f"{check.number} {check.title}", "SKIP", f"on CPU ranks: {check.gpu_only}")]
        else:
            try:
                results = check.run(m)
            except Exception as e:  # a check that cannot run says why, and the others still run
                results = [Result(f"{check.number} {check.title}", "FAIL", f"{type(e).__name__}: {e}"[:300])]
        for r in results:
            print(f"{r.status:<5} {r.check:<34} {r.figures}", flush=True)
            section.rows.append([r.check, r.status, r.figures])
        print(f"      ({time.monotonic() - started:.0f} s)", flush=True)
        on_row()
    return section


# ------------------------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="run on CPU ranks the checks whose mechanism runs there "
                        "(the GPU config through `recipe run --cpu`); the others are named as skipped")
    parser.add_argument("--ranks", type=int, default=None, help="ranks (default: the visible GPUs; 2 with --cpu)")
    parser.add_argument("--only", type=int, action="append", help="only this check (repeatable)")
    parser.add_argument("--work", type=Path, default=None, help="working folder (default: a temporary one)")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the report as markdown here")
    parser.add_argument("--table-only", action="store_true", help="only the knobs' throughput table")
    parser.add_argument("--no-table", action="store_true", help="only the checks, not the throughput table")
    parser.add_argument("--table-steps", type=int, default=None, help="optimizer steps of each row of the table "
                        "(default: knob_throughput.STEPS; at least 2, the first is warm-up)")
    parser.add_argument("--budget-s", type=float, default=None, help="start no check or table row after this many "
                        "seconds (they are reported as SKIP) and stop a run in flight when they are spent; the "
                        "markdown is rewritten after every row, so a report cut short still has what it measured")
    args = parser.parse_args()
    if args.table_steps is not None and args.table_steps < 2:
        parser.error("--table-steps must be at least 2 (tokens/s is measured after the first step)")
    global BUDGET
    BUDGET = Budget(args.budget_s)
    from accel_fsdp.quiet import quiet_libraries

    quiet_libraries()  # transformers' progress bars while the models are written and read
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device visible; --cpu runs the checks whose mechanism runs on CPU ranks")
    ranks = args.ranks or (2 if args.cpu else torch.cuda.device_count())
    work = args.work or Path(tempfile.mkdtemp(prefix="accel-fsdp-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    device = (f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)" if args.cpu
              else torch.cuda.get_device_name(0))
    machine = Machine(work=work, ranks=ranks, cpu=args.cpu, device=device)
    print(f"accel-fsdp GPU check: {ranks} x {device}, torch {torch.__version__}, work folder {work}", flush=True)
    sections: list[Section] = []

    def write_markdown() -> None:
        if args.markdown:
            # Whole or not at all: the lease can end the script between two rows' writes.
            write_atomic(args.markdown, "\n".join(s.markdown() for s in sections))

    if not args.table_only:
        sections.append(checks_section(machine))
        run_checks(machine, set(args.only or ()), sections[-1], on_row=write_markdown)
    if not args.no_table and not args.only:
        from knob_throughput import STEPS, throughput_section  # benchmarks/ is this script's folder, first on sys.path

        # The section joins the report as it begins, so that the markdown written after each row holds it.
        throughput_section(work, args.cpu, 2 if args.cpu else 1, device, Section, steps=args.table_steps or STEPS,
                           budget=BUDGET, run=run_within_budget, on_row=write_markdown, on_start=sections.append)
    results = [row[s.columns.index("result")] for s in sections for row in s.rows]
    print(f"{results.count('PASS')} passed, {results.count('FAIL')} failed, {results.count('SKIP')} skipped")
    write_markdown()
    if args.markdown:
        print(f"markdown: {args.markdown}")
    sys.exit(1 if "FAIL" in results else 0)


if __name__ == "__main__":
    main()
