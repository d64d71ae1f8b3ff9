"""`--cpu` runs a GPU accelerate config on CPU ranks on purpose, for `recipe run`, `bench` and `verify` alike; without
it a GPU config on a machine without CUDA is refused, naming --cpu."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli, tiny_recipe


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, tiny_gpt2, stories):
    return tiny_recipe(tmp_path_factory.mktemp("cpu-option") / "r.yaml", tiny_gpt2, stories)


@pytest.mark.parametrize("command", [["bench", "--steps", "2", "--warmup", "1"], ["verify", "--quick", "--steps", "2",
                                                                                  "--only", "sharding"]])
def test_a_gpu_config_without_cpu_is_refused_naming_it(recipe, command, tmp_path):
    proc = run_cli(command[0], recipe, "--accelerate-config", "fsdp_2gpu", *command[1:],
                   *(["--output-dir", tmp_path / "v"] if command[0] == "verify" else []), check=2)
    assert "is a GPU config (use_cpu is false) and this machine cannot" in proc.stderr and "--cpu" in proc.stderr


@pytest.mark.slow
@pytest.mark.multiprocess
def test_bench_takes_cpu(recipe):
    proc = run_cli("bench", recipe, "--accelerate-config", "fsdp_2gpu", "--cpu", "--steps", "2", "--warmup", "1",
                   "--compare-baseline", "--rounds", "1", "--json", check=0)
    out = json.loads(proc.stdout)
    assert out["config"] == "accelerate_configs/fsdp_2gpu.yaml"
    assert len(out["ours"][0]["peak_memory_bytes"]) == 2 and out["baseline"][0]["tokens_per_s"] > 0


@pytest.mark.slow
@pytest.mark.multiprocess
def test_verify_takes_cpu(recipe, tmp_path):
    proc = run_cli("verify", recipe, "--accelerate-config", "fsdp_2gpu", "--cpu", "--quick", "--steps", "2", "--only",
                   "sharding", "--output-dir", tmp_path / "v", check=0)
    report = json.loads((tmp_path / "v" / "report.json").read_text())
    assert report["device"] == "cpu" and report["ranks"] == 2
    assert [(c["name"], c["status"]) for c in report["checks"]] == [("sharding", "PASS")], proc.stdout
