"""Shared fixtures: tiny models saved with save_pretrained, generated data, and a runner for the real CLI.

Nothing here downloads: the models are built from configs and saved into temporary folders, the tokenizer is
the project's built-in one, the data is generated. Multi-process tests run `accel-fsdp` in a subprocess, which
launches 2 real FSDP ranks on the CPU over gloo.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from accel_fsdp.config.accelerate import CONFIG_PATH_ENV
from accel_fsdp.layout import COMPILE_CACHE_ENV
from accel_fsdp.quiet import quiet_warnings

REPO = Path(__file__).resolve().parents[1]

SHARED_RUN_MODULES = {"tests/test_gpu_check.py": "gpu_check_on_cpu_ranks",
                      "tests/test_gpu_path.py": "gpu_check_on_cpu_ranks"}
"""Test files that read one session fixture's runs (a launch of 2-rank runs; the other session fixtures are cheap: a
tiny model, a data file): under pytest-xdist they go to one worker, which makes the runs once."""


def _share_the_cores_among_workers() -> None:
    """Under pytest-xdist (README's test command: `-n auto`) every worker launches 2-rank runs of its own: each rank
    gets its share of the cores, as the launcher gives them when it is alone (launch/launcher.py, one thread a rank on
    2 cores), instead of every worker's ranks using all the cores. A user's OMP_NUM_THREADS is kept."""
    from accel_fsdp.hardware import usable_cores

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and not os.environ.get("OMP_NUM_THREADS"):
        os.environ["OMP_NUM_THREADS"] = str(max(1, usable_cores() // (2 * workers)))


_share_the_cores_among_workers()


def pytest_configure(config):
    """The library warnings every command silences (accel_fsdp/quiet.py), silenced around the tests' own calls into
    the libraries too (PEFT's notes when a test adapts a model itself), so that pytest's summary shows what a user
    would see. Here, not at import: pytest imports this file inside a warnings.catch_warnings of its own, which would
    drop them. The tests that prove a command's silence set the filters themselves, inside their own context."""
    quiet_warnings()


WORKER_MEMORY_GIB = 4
"""What one pytest-xdist worker may hold at once: itself and the 2 ranks of the run it launched. A bound with room,
not a measured peak: a rank of the heaviest tiny model (Llama's 128,256-token vocabulary) peaked at 1.48 GiB
resident in the CPU throughput table (docs/PERFORMANCE.md, activation offload), the quickstart's at about 0.6 GiB."""

if importlib.util.find_spec("xdist") is not None:  # its hooks: pytest refuses a hook no plugin declares
    def pytest_xdist_auto_num_workers(config):
        """`-n auto`: a worker per core, as many as the memory holds."""
        from accel_fsdp.hardware import usable_cores

        memory_gib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
        return max(1, min(usable_cores(), int(memory_gib // WORKER_MEMORY_GIB)))

    def pytest_xdist_make_scheduler(config, log):
        """Each worker runs whole work units (`work_unit`), handed out in the order the workers collected them
        (heaviest first: pytest_collection_modifyitems), not reordered by their number of tests."""
        from xdist.scheduler import LoadScopeScheduling

        class WorkUnitScheduling(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return work_unit(nodeid)

        config.option.loadscopereorder = False
        return WorkUnitScheduling(config, log)


def work_unit(nodeid: str) -> str:
    """What one pytest-xdist worker runs whole: a test file (its module-scoped runs are made once), or the files that
    read one shared session run."""
    module = nodeid.split("::", 1)[0]
    return SHARED_RUN_MODULES.get(module, module)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist: the work units (test files) in the order of what they cost, the heaviest first, so that the
    light ones fill the end and no worker is left alone with a long run (a slow test, about half a minute of 2-rank
    runs, counts 100 times a one-process test; a multi-process test of the fast tier 30 times; `slow(weight=k)`, a test
    of many runs, k slow tests)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    for item in items:
        shared = set(SHARED_RUN_MODULES.values()).intersection(item.fixturenames)
        if shared and work_unit(item.nodeid) not in shared:
            raise pytest.UsageError(f"{item.nodeid} reads {shared.pop()}: add its file to tests/conftest.py "
                                    "SHARED_RUN_MODULES, so that the runs are made once")
    cost: dict[str, float] = {}
    for item in items:
        slow = item.get_closest_marker("slow")
        cost[work_unit(item.nodeid)] = cost.get(work_unit(item.nodeid), 0.0) + (
            100 * slow.kwargs.get("weight", 1) if slow else 30 if item.get_closest_marker("multiprocess") else 1)
    position = {item.nodeid: i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-cost[work_unit(item.nodeid)], work_unit(item.nodeid), position[item.nodeid]))


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """One cache per test session (built-in data, tokenized datasets), never the user's."""
    cache = tmp_path_factory.mktemp("accel_fsdp_cache")
    old = os.environ.get("ACCEL_FSDP_CACHE")
    os.environ["ACCEL_FSDP_CACHE"] = str(cache)
    os.environ["HF_HUB_OFFLINE"] = "1"  # a test that tried to download would fail loudly
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    # Compiled graphs (training.compile) are kept across test sessions: inductor keys them by the graph, its inputs and
    # the torch build, so a reused one computes what a new one would, and it saves minutes of C++ compiling on 2
    # cores. tests/test_compile.py clears this where it tests the run's own cache folder.
    shared = Path(tempfile.gettempdir()) / f"accel_fsdp_tests_compiled_{os.getuid()}"
    os.environ.setdefault(COMPILE_CACHE_ENV, str(shared))
    yield cache
    if old is None:
        os.environ.pop("ACCEL_FSDP_CACHE", None)
    else:
        os.environ["ACCEL_FSDP_CACHE"] = old


def run_cli(*args, cwd=None, env=None, timeout=600, check=None):
    """Run `python -m accel_fsdp ARGS` as a user would; return the CompletedProcess (text output)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    proc = subprocess.run([sys.executable, "-m", "accel_fsdp", *map(str, args)], cwd=cwd or REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    if check is not None and proc.returncode != check:
        raise AssertionError(f"exit status {proc.returncode} (expected {check})\n--- stdout ---\n{proc.stdout[-6000:]}"
                             f"\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def stock_accelerate_launch(recipe: Path, run_dir: Path, *, env=None, timeout=300) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file accelerate_configs/fsdp_cpu.yaml -m accel_fsdp recipe run RECIPE`: the stock
    spelling, with no launcher of ours before it (its config path is not exported), as a user on a cluster types it."""
    import shutil

    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    full_env.pop(CONFIG_PATH_ENV, None)  # our launcher sets it; the stock one does not
    accelerate = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or "accelerate"
    return subprocess.run([accelerate, "launch", "--config_file", str(REPO / "accelerate_configs" / "fsdp_cpu.yaml"),
                           "--main_process_port", "0", "-m", "accel_fsdp", "recipe", "run", str(recipe),
                           "--output-dir", str(run_dir)], env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def run_in_process(*args, env=None, check=None) -> subprocess.CompletedProcess:
    """A command that runs in one process (checkpoint inspect and consolidate, generate, data prepare, slurm) called
    in this one through click's CliRunner, answered as run_cli answers: exit status, stdout and stderr. It saves a
    Python start and its imports per call. An exception the CLI did not turn into a message is written to stderr with
    its traceback, as Python would, so "no traceback" holds the same."""
    import traceback

    from click.testing import CliRunner

    from accel_fsdp.cli import main

    result = CliRunner().invoke(main, [str(a) for a in args], env=env)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
    proc = subprocess.CompletedProcess(["accel-fsdp", *map(str, args)], result.exit_code, result.stdout, stderr)
    if check is not None and proc.returncode != check:
        raise AssertionError(f"exit status {proc.returncode} (expected {check})\n--- stdout ---\n{proc.stdout[-6000:]}"
                             f"\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def cli_process(*args, env=None) -> subprocess.Popen:
    """Start `python -m accel_fsdp ARGS` as a user would, without waiting (several machines, signals, a live run)."""
    return subprocess.Popen([sys.executable, "-m", "accel_fsdp", *map(str, args)], cwd=REPO,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def cli(*args) -> tuple[int, str]:
    """The CLI in-process (click's CliRunner): exit status and output (stdout and stderr, as a terminal shows them).
    For commands of one process; a run that launches ranks goes through run_cli."""
    from click.testing import CliRunner

    from accel_fsdp.cli import main

    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def every_command(group=None, path: tuple[str, ...] = ()):
    """(words, command) of every command of the CLI, groups walked down: ("checkpoint", "consolidate"), ..."""
    import click

    from accel_fsdp.cli import main

    for name, command in (group or main).commands.items():
        if isinstance(command, click.Group):
            yield from every_command(command, (*path, name))
        else:
            yield (*path, name), command


def user_error(*args) -> str:
    """The output of an in-process CLI call that must end as a user error: status 2, one message, no traceback."""
    code, out = cli(*args)
    assert code == 2, f"exit status {code}, output:\n{out}"
    assert "Traceback" not in out
    assert out.startswith("error: "), out
    return out


def free_port() -> int:
    """A port free on loopback now (for a main process several "machines" of one box must agree on)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_config(path: Path, fsdp: dict | None = None, **values) -> Path:
    """accelerate_configs/fsdp_cpu.yaml with top-level `values` replaced and `fsdp` merged into its fsdp_config."""
    import yaml

    config = yaml.safe_load((REPO / "accelerate_configs" / "fsdp_cpu.yaml").read_text())
    config.update(values)
    config["fsdp_config"].update(fsdp or {})
    path.write_text(yaml.safe_dump(config))
    return path


def save_tiny_model(folder: Path, kind: str) -> Path:
    """A 2-layer, width-64 GPT-2 or Llama with the built-in tokenizer, saved like a hub model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from accel_fsdp.data.synthetic import build_tokenizer

    tok = build_tokenizer()
    common = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  bos_token_id=tok.eos_token_id)
    if kind == "gpt2":
        config = AutoConfig.for_model("gpt2", n_layer=2, n_embd=64, n_head=4, n_positions=128, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, **common)
    else:
        config = AutoConfig.for_model("llama", num_hidden_layers=2, hidden_size=64, intermediate_size=176,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=False, **common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-gpt2"), "gpt2")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def stories(tmp_path_factory) -> Path:
    """2,000 built-in stories as a plain .jsonl file (text format)."""
    import random

    from accel_fsdp.data.synthetic import story

    rng = random.Random(1)
    rows = [{"text": story(rng)[0]} for _ in range(2000)]
    return write_jsonl(tmp_path_factory.mktemp("data") / "stories.jsonl", rows)


@pytest.fixture(scope="session")
def gpu_check_on_cpu_ranks(tmp_path_factory) -> SimpleNamespace:
    """`python benchmarks/gpu_check.py --cpu --no-table`, run once a session with its work folder kept: its report
    (proc, markdown), and the run folders its checks left in `work` (<work>/<run name>/, what the run printed in
    <work>/<run name>.out), which tests of the same mechanisms read instead of launching the same runs again."""
    folder = tmp_path_factory.mktemp("gpu-check")
    report, work = folder / "report.md", folder / "work"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--cpu", "--no-table",
                           "--work", str(work), "--markdown", str(report)], capture_output=True, text=True,
                          timeout=1800, cwd=REPO)

    def run(name: str) -> Path:
        """The folder of the check's run `name`, which must have trained (else the GPU check's output says why)."""
        folder = work / name
        said = proc.stdout[-3000:] + proc.stderr[-3000:]
        assert (folder / "metrics.jsonl").exists(), f"no run {name} in {work}:\n{said}"
        return folder

    return SimpleNamespace(proc=proc, report=report, work=work, run=run)


REFERENCE_WORK_S = 0.086
"""Seconds `reference_work` takes on the machine the suite's wall-clock bounds were set on (2 cores of an AMD EPYC,
the least of 20 tries; 0.086 to 0.1 s with the other engineers' tests running): the unit of `WallClockBound`."""


def reference_work() -> float:
    """Wall-clock seconds of a fixed piece of single-threaded Python work (what the launcher and the ranks do between
    their kernels): longer on a slower core, and longer while the cores are shared with other processes."""
    start = time.perf_counter()
    total, kept = 0, {}
    for i in range(1_000_000):
        total += (i * i) % 7
        if i % 3 == 0:
            kept[i & 1023] = total
    return time.perf_counter() - start


class WallClockBound:
    """A bound on the seconds something takes, set on the reference machine and scaled by how much slower this machine
    is while it runs: `reference_work` timed before and after, against REFERENCE_WORK_S, the larger of the two.

    The noise model: a core k times slower makes both the work and the probe k times slower; cores shared with busy
    processes slow both as long as the load lasts (the other pytest-xdist worker's runs, the 2 busy loops of the
    suite's contention check). A burst the probes miss is what the bound's own margin over the time measured on
    the reference machine under the parallel suite is for; the bound never shrinks below its reference seconds. On a
    crowded machine the one-thread probe overstates the slowdown (load average 10 on 2 cores: the probes read 7 to 14,
    the quickstart ran 3 times its idle time), so there the bound is loose; on a quiet one it is the reference."""

    def __init__(self, seconds: float):
        self.seconds, self.slowdown = seconds, max(1.0, reference_work() / REFERENCE_WORK_S)
        self.start = time.monotonic()

    def check(self, what: str) -> float:
        """The seconds since the bound was made; fails the test when they exceed the scaled bound."""
        elapsed = time.monotonic() - self.start
        self.slowdown = max(self.slowdown, reference_work() / REFERENCE_WORK_S)
        limit = self.seconds * self.slowdown
        print(f"{what}: {elapsed:.1f} s, bound {limit:.1f} s (slowdown {self.slowdown:.2f})")  # shown by pytest -rP
        assert elapsed < limit, (f"{what} took {elapsed:.1f} s, more than {self.seconds:g} s x {self.slowdown:.2f} "
                                 f"(this machine's slowdown against the reference) = {limit:.1f} s")
        return elapsed


@pytest.fixture
def cpu_with_native_bf16(monkeypatch):
    """This CPU computes bf16 natively, whatever CPU runs the suite: on one without it (AVX2 only) a config's bf16 on
    CPU ranks becomes fp32 (config/settings.py), and a plan's figures and settings with it."""
    from accel_fsdp.hardware import CPU_BF16_ENV

    monkeypatch.setenv(CPU_BF16_ENV, "1")


TRACE_UNITS = {"ACCEL_FSDP_TRACE_UNITS": "1"}
"""The environment of a run that records, per rank and step, the training units it read (train/hooks.py)."""


def units_by_step(run: Path) -> dict[int, list[int]]:
    """The training units each step read, over all ranks of a run traced with TRACE_UNITS; for a resumed run the last
    attempt of a step counts (the killed attempt's work past its checkpoint was lost with it)."""
    per_step: dict[int, dict[int, list[int]]] = {}
    for f in sorted((run / "trace").glob("units-rank*.jsonl")):
        rank = int(f.stem.removeprefix("units-rank"))
        for line in f.read_text().splitlines():
            record = json.loads(line)
            per_step.setdefault(record["step"], {})[rank] = record["units"]
    return {step: sorted(u for units in by_rank.values() for u in units) for step, by_rank in per_step.items()}


def fabricate_checkpoint(folder: Path, step: int, run_id: str | None = None) -> Path:
    """A checkpoint complete as far as its manifest can tell, without training: one file, its size and CRC-32."""
    from accel_fsdp.files import crc32_of
    from accel_fsdp.checkpoint.records import Manifest
    from accel_fsdp.layout import checkpoint_name

    step_dir = folder / checkpoint_name(step)
    step_dir.mkdir(parents=True)
    (step_dir / "weights").write_bytes(bytes(range(16)) * step)
    manifest = Manifest(step=step, world_size=2, run_id=run_id, files={"weights": 16 * step},
                        crc32={"weights": crc32_of(step_dir / "weights")})
    (step_dir / "manifest.json").write_text(manifest.to_json())
    return step_dir


def tiny_recipe(path: Path, model_path: Path, data_path: Path, **sections) -> Path:
    """A small recipe file for tests: a few steps of a tiny model, overridable per section."""
    import yaml

    recipe = {
        "name": path.stem,
        "model": {"name_or_path": str(model_path)},
        "data": {"path": str(data_path), "seq_len": 64, "eval_fraction": 0.05},
        "training": {"micro_batch_size": 4, "global_batch_size": 8, "max_steps": 8, "lr": 3e-3, "warmup_steps": 0,
                     "seed": 7},
        "checkpoint": {"keep_last": None},
        "logging": {"every_steps": 1, "sample_prompt": None},
    }
    for section, values in sections.items():
        recipe.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl as the JSON has them (read and checked by the product's reader)."""
    from accel_fsdp.train.metrics import read_metrics as read
    from accel_fsdp.train.metrics import row_to_dict

    return [row_to_dict(r) for r in read(run_dir / "metrics.jsonl")]


def load_weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


# ---------------------------------------------------------------------- noise models of float comparisons
# A float tolerance in a test follows from one of these or from the noise model of accel_fsdp/tools/noise.py (ROUNDOFF,
# SIGMAS, reordered, adam_step_bound), with the reason it applies where it is used; never from one machine's run:
# AVX2-only, AVX512-BF16 and AMX CPUs pick other kernels, so add numbers up in other orders.

LOGIT_PATH = 2**11
"""Products summed on the way to one logit of the tests' 2-layer, width-64 models (GPT-2 at 128 positions:
2 x (64 + 16 + 128 + 64 + 64 + 256) + 64 = 1,248; Llama 1,088). Layer norms keep every stage at the logits' scale, so
two computations of the same logits that round differently agree within reordered(LOGIT_PATH) of the logit scale."""


def precomputed_reference_start(beta: float, seq_len: int, logp_scale: float, pairs: int,
                                logit_path: int = LOGIT_PATH) -> tuple[float, float]:
    """How far DPO's first step may be from policy == reference, fp32, where the reference's log-probabilities are the
    policy's own computed before the first step in batches of other shapes (train/reference.py groups the pairs its own
    way, so rows are padded to other lengths and kernels may add up in other orders: equal, but not bitwise by
    construction). Returns (bound on |reward_margin|, bound on |loss - ln 2|), absolute.

    A token's log-prob z_y - logsumexp(z) moves by at most twice its logits' error, each within reordered(logit_path)
    of the logit scale, below `logp_scale` (a token's |log-prob|) at a start from scratch: logits near 0, log-probs
    near -ln V. A sequence's log-prob adds up to `seq_len` of them (independent errors: sqrt(seq_len) of one's bound),
    in another order too (reordered(seq_len) of its size). A pair's margin z = beta ((pc - rc) - (pr - rr)) moves by
    beta x two sequences' errors; the loss -log sigmoid(z) = ln 2 - z / 2 + O(z^2) by half that, plus one fp32 rounding
    of ln 2 and the mean over the step's `pairs` added in some order."""
    from accel_fsdp.tools.noise import ROUNDOFF, reordered

    sequence = (math.sqrt(seq_len) * 2 * reordered(logit_path) * logp_scale
                + reordered(seq_len) * seq_len * logp_scale)
    margin = 2 * beta * sequence
    return margin, margin / 2 + math.log(2) * (ROUNDOFF["fp32"] + reordered(pairs))


def assert_adam_runs_agree(weights: dict, reference: dict, lrs: list[float], gradient_noise: float) -> None:
    """Final weights of two AdamW runs (default betas) from the same start whose gradients differ by `gradient_noise`
    (relative: rounding) only. That moves an element's step by at most that share of its largest step, but the step
    of an element whose gradient is itself rounding noise (zero in exact arithmetic, as GPT-2's key biases: softmax
    ignores a constant added to every key) can go either way. So every weight within both runs' largest steps, and half
    of them within `gradient_noise` of that; another gradient (a micro-batch lost, a wrong shard) moves most more."""
    import torch

    from accel_fsdp.config.recipe import TrainingConfig
    from accel_fsdp.tools.noise import adam_step_bound

    t = TrainingConfig()
    largest = 2 * adam_step_bound(t.adam_beta1, t.adam_beta2, len(lrs)) * sum(lrs)
    assert weights.keys() == reference.keys()
    differences = []
    for key, tensor in reference.items():
        difference = (weights[key].double() - tensor.double()).abs().flatten()
        assert difference.max() <= largest, (key, float(difference.max()), largest)
        differences.append(difference)
    median = float(torch.cat(differences).median())
    assert median <= gradient_noise * largest, (median, gradient_noise * largest)


def collated(sequences, pad_id: int, use_position_ids: bool = True, **options) -> dict:
    """A micro-batch as the trainer builds it (train/setup.py `Run.collate`, on the host): the collated tensors and
    the index of their loss-carrying positions."""
    from accel_fsdp.data.batches import collate
    from accel_fsdp.train.methods import LossIndex

    batch = collate(sequences, pad_id, use_position_ids, **options)
    batch["loss_index"] = LossIndex.of(batch)
    return batch
