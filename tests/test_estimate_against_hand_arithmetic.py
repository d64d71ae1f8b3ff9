"""`estimate` against arithmetic done by hand, and what it answers to input that cannot be planned.

The hand numbers: AdamW full fine-tune holds 16 bytes per parameter (fp32 weight 4, gradient 4, two moments 8),
divided over the S ranks a tensor is sharded over; a LoRA base holds only its weights, in the compute dtype of the
run (2 bytes in bf16-mixed, 4 in fp32). Parameter counts are the published ones (and what transformers builds on
the meta device): Llama-3.1-8B 8,030,261,248; its r=16 adapters on the 7 projections of 32 layers
32 x 16 x (2 x (4096+4096) + 2 x (4096+1024) + 2 x (4096+14336) + (14336+4096)) = 41,943,040.
"""

from __future__ import annotations

import re

import pytest
from conftest import cli, user_error

from accel_fsdp.config.accelerate import BY_SHARDING
from accel_fsdp.planning.estimate import resolve_target, table

GiB = 2**30
LLAMA_8B = 8_030_261_248
LORA_8B = 32 * 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 2 * (4096 + 14336) + (14336 + 4096))


def rows(what, *, gpus=1, nodes=1, precision="bf16-mixed", gpu_memory=80 * GiB):
    target = resolve_target(what, None, None)
    return target, table(target, gpus=gpus, nodes=nodes, precision=precision, activation_checkpointing=False,
                         strategies=list(BY_SHARDING), offload=None, gpu_memory=gpu_memory)


def test_the_lora_adapters_are_the_hand_count():
    assert LORA_8B == 41_943_040
    target, _ = rows("llama-3.1-8b-lora")
    assert (target.params, target.trainable) == (LLAMA_8B + LORA_8B, LORA_8B)


@pytest.mark.parametrize("precision, base_bytes", [("bf16-mixed", 2), ("fp32", 4)])
def test_a_lora_base_is_held_in_the_precision_estimated(precision, base_bytes):
    """--precision fp32 counted the frozen 8B base at the recipe's 2 bytes: 15 GiB short on one GPU, and a "fits"."""
    _, table_rows = rows("llama-3.1-8b-lora", precision=precision)
    full = next(r for r in table_rows if r.strategy == "FULL_SHARD" and not r.offload)
    assert full.memory.params == 4 * LORA_8B + base_bytes * LLAMA_8B
    assert (full.memory.grads, full.memory.optimizer) == (4 * LORA_8B, 8 * LORA_8B)


@pytest.mark.parametrize("what, count", [("llama-3.1-8b", LLAMA_8B), ("llama-3.1-70b", 70_553_706_496),
                                         ("llama-3.2-1b", 1_235_814_400), ("gpt2-xl", 1_557_611_200),
                                         ("7B", 7 * 10**9), ("7 B", 7 * 10**9), ("7000M", 7 * 10**9)])
def test_model_state_per_rank_is_16_bytes_a_parameter_over_the_shard_group(what, count):
    target, table_rows = rows(what, gpus=8, nodes=2)
    assert target.params == count
    group = {"NO_SHARD": 1, "SHARD_GRAD_OP": 16, "FULL_SHARD": 16, "HYBRID_SHARD": 8}
    for r in table_rows:
        on_gpu, on_host = (0, 16 * count / group[r.strategy]) if r.offload else (16 * count / group[r.strategy], 0)
        assert r.memory.model_state == pytest.approx(on_gpu) and r.memory.host == pytest.approx(on_host), r.label


@pytest.mark.parametrize("count", ["1e30", "999999T", "1e400", "inf", "99999999999999999999999999999"])
def test_counts_past_any_model_are_refused_not_printed_with_float_digits(count):
    """1e30 printed 1,000,000,000,000,000,019,884,624,838,656 parameters and 'fits' at 0.00 GiB per GPU."""
    out = user_error("estimate", count)
    assert f"error: {count}: is more parameters than estimate plans (at most 1,000T)" in out


def test_an_empty_or_negative_infinite_count_is_named():
    assert "MODEL|RECIPE|PARAM_COUNT: is empty" in user_error("estimate", " ")
    assert "error: -inf: is not a parameter count: it must be positive" in user_error("estimate", "-inf")


def test_a_bare_count_under_offload_gets_no_fits_verdict():
    """A count has no gathered units or activations, so its offload rows held 0.00 GiB on the GPU and 'fit' a 7B
    on an 80 MB GPU (now on 1 GB, the least --gpu-memory takes)."""
    code, out = cli("estimate", "7B", "--gpu-memory", "1GB")
    assert code == 0, out
    offload = [line for line in out.splitlines() if line.startswith("FULL_SHARD + offload")]
    assert offload and offload[0].endswith("  ?"), out
    assert "nothing fits" in out and "a bare count does not give" in out


def test_strategies_that_leave_no_row_are_refused():
    out = user_error("estimate", "gpt2", "--strategy", "NO_SHARD", "--offload")
    assert "NO_SHARD with --offload leaves nothing to estimate" in out and "--strategy FULL_SHARD" in out
    out = user_error("estimate", "llama-3.1-8b-qlora", "--strategy", "NO_SHARD", "--gpus", "2")
    assert "NO_SHARD needs FSDP1, which a LoRA recipe cannot use" in out


@pytest.mark.parametrize("gpus", [1, 2])
def test_a_lora_recipe_is_not_offered_fsdp1_no_shard(gpus):
    """`recipe run` refuses LoRA and QLoRA under FSDP1 (the only NO_SHARD), so the estimate must not pick it; on one
    GPU it named fsdp_1gpu.yaml (FSDP2, which gathers as FULL_SHARD does) with NO_SHARD's smaller total."""
    _, table_rows = rows("llama-3.1-8b-lora", gpus=gpus)
    assert "NO_SHARD" not in {r.strategy for r in table_rows}


@pytest.mark.parametrize("gpu_memory", ["16GB", "11GB"])
def test_one_gpu_estimate_and_dry_run_agree_on_the_config_named(gpu_memory):
    """estimate's pick for one GPU and the dry run of the config it names are the same formulas on the same inputs:
    equal to the printed hundredth. Its SHARD_GRAD_OP row named plain fsdp_1gpu.yaml, which runs FULL_SHARD."""
    code, out = cli("estimate", "llama-3.1-8b-qlora", "--gpus", "1", "--gpu-memory", gpu_memory)
    assert code == 0, out
    pick = re.search(r"cheapest that fits .*?: (\S+), ([\d.,]+) GiB per GPU -> accelerate_configs/fsdp_1gpu.yaml"
                     r"(?: \+ --set (\S+))?$", out, re.M)
    assert pick and pick.group(1) == {"16GB": "SHARD_GRAD_OP", "11GB": "FULL_SHARD"}[gpu_memory], out
    overrides = ["--set", pick.group(3)] if pick.group(3) else []
    code, plan = cli("recipe", "run", "llama-3.1-8b-qlora", "--dry-run", "--accelerate-config", "fsdp_1gpu", *overrides)
    assert code == 0, plan
    assert f"total {pick.group(2)}" in plan, plan


def test_no_shard_names_every_rank_of_every_node():
    code, out = cli("estimate", "124M", "--gpus", "8", "--nodes", "2")
    assert code == 0, out
    assert "NO_SHARD (num_machines: 2, num_processes: 16)" in out, out


def test_a_model_named_like_a_shipped_recipe_says_which_was_estimated():
    """`estimate llama-3.1-8b` is the model at micro batch 1 x 2048 without activation checkpointing, while the recipe
    of that name trains 2 x 4096 with it: 30.25 against the dry run's 23.59 GiB on 8 GPUs, with nothing saying why."""
    code, out = cli("estimate", "llama-3.1-8b", "--gpus", "8")
    assert code == 0 and "micro batch 1 x 2048" in out, out
    assert "the shipped recipe of that name" in out and "accel-fsdp estimate recipes/llama-3.1-8b.yaml" in out
    code, out = cli("estimate", "recipes/llama-3.1-8b.yaml", "--gpus", "8")
    assert code == 0 and "micro batch 2 x 4096 tokens, activation checkpointing" in out, out
    code, out = cli("estimate", "llama-3.2-3b")
    assert code == 0 and "shipped recipe" not in out, out
