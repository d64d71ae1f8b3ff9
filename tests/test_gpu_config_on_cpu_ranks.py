"""`--cpu` runs a GPU accelerate config on CPU ranks on purpose, for `recipe run`, `bench` and `verify` alike; without
it a GPU config on a machine without CUDA is refused, naming --cpu."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from conftest import run_in_process, tiny_recipe

from accel_fsdp.cli import main
from accel_fsdp.config.accelerate import load_accelerate_config
from accel_fsdp.config.recipe import recipe_from_text
from accel_fsdp.config.settings import resolve_settings

TINY = """
model: {architecture: gpt2, tokenizer: "builtin:quickstart", config_overrides: {n_layer: 2, n_embd: 64, n_head: 4}}
data: {path: "builtin:quickstart", seq_len: 64}
training: {micro_batch_size: 1, global_batch_size: 8, max_steps: 4}
"""


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, tiny_gpt2, stories):
    return tiny_recipe(tmp_path_factory.mktemp("cpu-option") / "r.yaml", tiny_gpt2, stories)


@pytest.mark.parametrize("command", [["bench", "--steps", "2", "--warmup", "1"], ["verify", "--quick", "--steps", "2",
                                                                                  "--only", "sharding"]])
def test_a_gpu_config_without_cpu_is_refused_naming_it(recipe, command, tmp_path):
    proc = run_in_process(command[0], recipe, "--accelerate-config", "fsdp_2gpu", *command[1:],
                          *(["--output-dir", tmp_path / "v"] if command[0] == "verify" else []), check=2)
    assert "is a GPU config (use_cpu is false) and this machine cannot" in proc.stderr and "--cpu" in proc.stderr


# `bench --cpu` on a GPU config: tests/test_bench.py::test_bench_reports_throughput_memory_and_baseline_ratio runs
# fsdp_2gpu with --cpu and checks the config, both ranks' memory and the baseline (one pair of runs for both files).
# `verify --cpu` on a GPU config: tests/test_verify.py::test_the_data_check_passes_on_a_mixture runs fsdp_2gpu with
# --cpu and checks the report's device and ranks and that the sharding check passes (one verify for both files).


def test_a_gpu_config_on_a_machine_without_cuda_is_refused_naming_why(tmp_path):
    result = CliRunner().invoke(main, ["recipe", "run", "quickstart", "--accelerate-config", "fsdp_2gpu",
                                       "--output-dir", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert ("accelerate_configs/fsdp_2gpu.yaml: use_cpu: is a GPU config (use_cpu is false) and this machine cannot "
            f"run CUDA: this torch ({torch.__version__}) is built without CUDA" in result.output)
    assert "--accelerate-config fsdp_cpu" in result.output and not (tmp_path / "run").exists()
    # judged for the hardware it is written for, the same config is fine
    validated = CliRunner().invoke(main, ["recipe", "validate", "quickstart", "--accelerate-config", "fsdp_2gpu"])
    assert validated.exit_code == 0


def test_under_stock_accelerate_launch_cpu_ranks_are_said_not_refused(tmp_path):
    """Stock `accelerate launch` exports an FSDP config to the ranks without its use_cpu, so fsdp_cpu.yaml and
    fsdp_2gpu.yaml arrive alike: the ranks train on CPU when CUDA cannot run, and say so once, with why."""
    from accel_fsdp.config.accelerate import config_from_environment
    from accel_fsdp.config.settings import cpu_guess_note, cuda_problems

    recipe = recipe_from_text(TINY, source="r.yaml")
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    stock = config_from_environment(env)
    cpu = resolve_settings(recipe, stock, cuda_available=False, num_processes=2)
    why = lambda: "this torch is built without CUDA"  # noqa: E731
    assert cuda_problems(cpu, stock, why) == []
    assert cpu_guess_note(cpu, stock, why) == (
        "note: training on CPU ranks: this machine cannot run CUDA (this torch is built without CUDA), and the "
        "accelerate launch environment does not say whether the config was written for GPUs (Accelerate's launcher "
        "does not pass use_cpu on)")
    # with CUDA, or with use_cpu exported (the simple launcher), nothing to say
    assert cpu_guess_note(resolve_settings(recipe, stock, cuda_available=True, num_processes=2), stock, why) is None
    told = config_from_environment(dict(env, ACCELERATE_USE_CPU="True"))
    assert cpu_guess_note(resolve_settings(recipe, told, cuda_available=False, num_processes=2), told, why) is None
    # a config read from its file is judged, not guessed
    gpu = load_accelerate_config("fsdp_2gpu")
    settings = resolve_settings(recipe, gpu, cuda_available=False, num_processes=2)
    assert cpu_guess_note(settings, gpu, why) is None and len(cuda_problems(settings, gpu, why)) == 1


def test_cpu_asks_for_a_gpu_config_on_cpu_ranks_and_reaches_them(tmp_path, monkeypatch):
    launched = []
    monkeypatch.setattr("accel_fsdp.launch.launcher.launch",
                        lambda config, argv, **k: launched.append((config.values.get("use_cpu"), argv)) or 0)
    result = CliRunner().invoke(main, ["recipe", "run", "quickstart", "--accelerate-config", "fsdp_2gpu", "--cpu",
                                       "--output-dir", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    ((use_cpu, argv),) = launched
    assert use_cpu is True and "--cpu" in argv


@pytest.mark.parametrize("cuda_build,nodes,init_error,expected", [
    (None, True, None, "built without CUDA"),
    ("12.4", False, None, "no NVIDIA device node"),
    ("12.4", True, "Found no NVIDIA driver on your system.", "CUDA failed to initialize: Found no NVIDIA driver"),
])
def test_why_cuda_is_unusable_is_said_in_torchs_words(monkeypatch, tmp_path, cuda_build, nodes, init_error, expected):
    from accel_fsdp import hardware

    monkeypatch.setattr(torch.version, "cuda", cuda_build)
    monkeypatch.setattr(hardware, "_NVIDIA_NODES", (str(tmp_path),) if nodes else (str(tmp_path / "none"),))

    def init():
        raise RuntimeError(init_error)

    monkeypatch.setattr(torch.cuda, "init", init)
    assert expected in hardware.cuda_unavailable_reason()
