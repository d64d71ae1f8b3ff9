"""GPU mechanisms held on CPU, each read in accelerate 1.15, torch 2.13 and transformers 5.24 and held by a test that
fails with its fault: of the *decision* (what is built for a CUDA configuration, CUDA faked) where the mechanism needs
a GPU, of the *behaviour* where the same mechanism runs on CPU ranks: the Accelerator's backends and timeouts on CUDA,
unsharded gradients on one GPU, fp16 with a fused AdamW, FSDP1's buffers, rank-0 loading, each GPU's RNG state and
the flash-attention kernel's arguments."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import types
import warnings
from datetime import timedelta

import pytest
import torch
from conftest import cpu_config, read_metrics, run_cli, save_tiny_model, tiny_recipe
from flash_standin import NAME as FLASH_STANDIN
from flash_standin import install as install_flash_standin

from accel_fsdp.config.accelerate import load_accelerate_config
from accel_fsdp.config.recipe import recipe_from_text
from accel_fsdp.config.settings import check_settings, resolve_settings

TINY = """
model: {architecture: gpt2, tokenizer: "builtin:quickstart", config_overrides: {n_layer: 2, n_embd: 64, n_head: 4}}
data: {path: "builtin:quickstart", seq_len: 64}
training: {micro_batch_size: 1, global_batch_size: 8, max_steps: 4}
"""


def clean_accelerate_environment(monkeypatch) -> None:
    """Accelerate's FSDP plugin exports its settings as FSDP_* variables (and reads ACCELERATE_* ones): none from
    another test may reach this one's Accelerator."""
    for key in list(os.environ):
        if key.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.delenv(key)


def settings_for(config: str, overrides=(), cuda: bool = True):
    recipe = recipe_from_text(TINY, source="r.yaml", overrides=overrides)
    return recipe, resolve_settings(recipe, load_accelerate_config(config), cuda_available=cuda)


@pytest.fixture
def fake_cuda_rank(monkeypatch):
    """Rank 0 of 2 under torchrun on a machine with 2 GPUs, as far as Accelerate can tell: init_process_group only
    records what it was given (accelerate/state.py, PartialState; 1.15.0)."""
    from accelerate.state import AcceleratorState, GradientState

    for key, value in dict(LOCAL_RANK="0", RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT="29500").items():
        monkeypatch.setenv(key, value)
    clean_accelerate_environment(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    calls = []
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda backend=None, **kwargs: calls.append(dict(kwargs, backend=backend)))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: bool(calls))
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield calls
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture
def gloo_world_of_one(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29000 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# ------------------------------------------------------- 6: the Accelerator on CUDA, and every group's timeout


@pytest.mark.parametrize("minutes", [10, 60])
def test_the_accelerator_on_cuda_gets_both_backends_and_the_configured_timeout(fake_cuda_rank, minutes):
    """What reaches init_process_group, CUDA faked: both backends, and the timeout, 10 minutes included (Accelerate's
    InitProcessGroupKwargs.to_kwargs() drops a value equal to its default of 10 minutes: it became torch's 30)."""
    from accel_fsdp.train.accelerator import build_accelerator

    _, settings = settings_for("fsdp_2gpu", [f"fsdp.collective_timeout_minutes={minutes}"])
    acc = build_accelerator(settings, gradient_accumulation_steps=4, run_dir=None)
    (call,) = fake_cuda_rank
    assert call == {"backend": "cuda:nccl,cpu:gloo", "timeout": timedelta(minutes=minutes)}
    assert acc.is_fsdp2 and acc.device == torch.device("cuda", 0)


# --------------------------------------------------------------------------- 1: one GPU + accumulation


@pytest.fixture(scope="module")
def one_rank_recipe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("one-rank")
    model = save_tiny_model(folder / "model", "gpt2")
    return tiny_recipe(folder / "r.yaml", model, "builtin:quickstart", data={"max_rows": 400, "eval_fraction": 0},
                       training={"max_steps": 2, "micro_batch_size": 2, "global_batch_size": 8},
                       checkpoint={"export_final": False}, logging={"every_steps": 1})


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("reduce_every_micro_step", [True, False])
def test_one_rank_holds_no_unsharded_gradient_between_micro_steps_unless_deferred(tmp_path, one_rank_recipe,
                                                                                 reduce_every_micro_step):
    """One process: Accelerate ignores sync_each_batch and would run every micro-step but the last under no_sync,
    which keeps FSDP2's unsharded fp32 gradients (on the GPU, with offload too). The shard is the whole model on one
    rank, so what tells them apart is where the gradient is kept."""
    run = tmp_path / "run"
    run_cli("recipe", "run", one_rank_recipe, "--num-processes", "1", "--output-dir", run,
            "--set", f"fsdp.reduce_every_micro_step={str(reduce_every_micro_step).lower()}",
            env={"ACCEL_FSDP_PROBE": "grad-bytes"}, check=0)
    rows = [json.loads(line) for line in (run / "trace" / "grad-bytes-rank0.jsonl").read_text().splitlines()]
    between = [r["unsharded"] for i, r in enumerate(rows) if i % 4]  # before micro-steps 2..4 of each step
    assert len(between) == 6
    if reduce_every_micro_step:
        assert between == [0] * 6, between
    else:
        assert all(b > 0 for b in between), between


def test_the_planner_counts_deferred_gradients_on_one_gpu_with_offload():
    from accel_fsdp.planning.memory import MemoryInputs, estimate

    p = 1_000_000
    base = dict(params=p, trainable=p, largest_unit=p // 10, world=1, shard_group=1, offload=True)
    assert estimate(MemoryInputs(**base)).grads == 0  # offloaded: on the host
    assert estimate(MemoryInputs(**base, deferred_reduce=True)).grads == 4 * p  # unsharded fp32, on the GPU


# ------------------------------------------------------------------------ 2: fp16 with a fused AdamW


@pytest.fixture
def accelerator_with_a_scaler(monkeypatch):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    clean_accelerate_environment(monkeypatch)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True)
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)  # Accelerate makes none on CPU; CUDA's is this one
    yield acc
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.mark.parametrize("overflow", [True, False])
def test_a_fused_adamw_step_the_scaler_skips_does_not_advance_the_schedule(accelerator_with_a_scaler, overflow):
    """Real objects: AcceleratedOptimizer + GradScaler + fused AdamW. GradScaler always calls a fused optimizer's
    step (the kernel skips the update itself), so Accelerate's optimizer_step_was_skipped stays False."""
    from accel_fsdp.train.loop import advance_schedule

    acc = accelerator_with_a_scaler
    layer = torch.nn.Linear(4, 4)
    optimizer = acc.prepare(torch.optim.AdamW(layer.parameters(), lr=1.0, fused=True))
    # Over the AcceleratedOptimizer, as train/setup.py builds it: over its inner optimizer, whose step the scaler's
    # patch replaces, torch warns that "optimizer.step() has been overridden".
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    before = layer.weight.detach().clone()
    acc.scaler.scale(layer(torch.ones(1, 4)).sum()).backward()
    if overflow:
        layer.weight.grad[0, 0] = float("inf")
    acc.clip_grad_norm_(layer.parameters(), 1.0)  # unscales, as fit() does
    scale = acc.scaler.get_scale()
    optimizer.step()
    assert torch.equal(layer.weight, before) is overflow  # the kernel skipped the update, or made it
    assert not acc.optimizer_step_was_skipped  # Accelerate's flag cannot tell (why the scale is read)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert advance_schedule(acc, scheduler, scale) == 1.0
    assert scheduler.get_last_lr() == ([1.0] if overflow else [0.5])


# ------------------------------------------------------------------------------ 3: FSDP1 buffers


def test_fsdp1_keeps_the_rotary_frequencies_in_fp32(gloo_world_of_one):
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from transformers import LlamaConfig, LlamaForCausalLM

    from accel_fsdp.train.accelerator import _mixed_precision_policy

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
    reference = model.model.rotary_emb.inv_freq.clone()
    wrapped = FullyShardedDataParallel(model, mixed_precision=_mixed_precision_policy(1, "bf16", torch.float32),
                                       device_id=torch.device("cpu"), use_orig_params=True,
                                       sharding_strategy=ShardingStrategy.NO_SHARD)  # what one rank runs
    wrapped(input_ids=torch.randint(0, 64, (1, 8)))  # FSDP1 casts buffers at the first forward
    inv_freq = wrapped.module.model.rotary_emb.inv_freq
    assert inv_freq.dtype == torch.float32 and torch.equal(inv_freq, reference)


def test_fsdp1_no_shard_says_nothing_a_user_cannot_act_on(gloo_world_of_one):
    """FSDP1's NO_SHARD (one rank, or asked for): torch warns at every sharded save that it returns whole tensors,
    with its file path, on every rank; on several ranks it calls NO_SHARD deprecated and points to DDP. The start
    summary names NO_SHARD, and the checkpoints load on any number of ranks (the slow tests resume them), so the
    filters every command sets (accel_fsdp/quiet.py) keep both out of a run's output."""
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy, StateDictType
    from torch.distributed.fsdp._init_utils import _init_core_state

    from accel_fsdp.quiet import quiet_warnings

    with warnings.catch_warnings(record=True) as drawn, contextlib.suppress(Exception):
        warnings.simplefilter("always")
        _init_core_state(types.SimpleNamespace(world_size=2), ShardingStrategy.NO_SHARD, None, None, False, True, 1, 1)
    assert any("NO_SHARD` sharding strategy is deprecated" in str(w.message) for w in drawn)  # what torch says

    model = FullyShardedDataParallel(torch.nn.Linear(4, 4), device_id=torch.device("cpu"),
                                     sharding_strategy=ShardingStrategy.NO_SHARD)
    with warnings.catch_warnings(record=True) as unfiltered:
        warnings.simplefilter("always")
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            model.state_dict()
    assert any("full_state_dict will be returned" in str(w.message) for w in unfiltered)  # what torch says
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_warnings()
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            model.state_dict()
        # What torch says on several ranks, drawn from its own code with a state that says 2 ranks (the warning comes
        # first; what follows needs a real one)
        with contextlib.suppress(Exception):
            _init_core_state(types.SimpleNamespace(world_size=2), ShardingStrategy.NO_SHARD, None, None, False, True,
                             1, 1)
    assert not [str(w.message) for w in caught if "NO_SHARD" in str(w.message)], [str(w.message) for w in caught]


def test_fsdp1_decays_the_matrices_it_flattened(gloo_world_of_one):
    """FSDP1 (use_orig_params, sharded) turns every parameter into a 1-D view of its shard, so an optimizer that chose
    the decayed parameters by their shapes after wrapping decayed none: training.weight_decay was silently 0 under
    FSDP1. The decayed set is the matrices' names, read before wrapping (train/setup.py)."""
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from transformers import GPT2Config, GPT2LMHeadModel

    from accel_fsdp.train.optimizer import build_optimizer, decayed_names

    recipe, settings = settings_for("fsdp1_2gpu", ["training.weight_decay=0.1"], cuda=False)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=16))
    matrices = sum(p.numel() for p in model.parameters() if p.ndim >= 2)
    decayed = decayed_names(model)
    wrapped = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True,
                                       sharding_strategy=ShardingStrategy.NO_SHARD)
    # One rank runs NO_SHARD (config/settings.py), which keeps the shapes: flatten them as two ranks' shards would be
    # (the slow tests/test_logged_numbers_replay.py FSDP1 run holds the real thing)
    for parameter in wrapped.parameters():
        parameter.data = parameter.data.flatten()
    decay, no_decay = build_optimizer(wrapped, recipe, settings, decayed).param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert sum(p.numel() for p in decay["params"]) == matrices
    assert sum(p.numel() for p in no_decay["params"]) == sum(p.numel() for p in wrapped.parameters()) - matrices


# ------------------------------------------------------------------- 5: rank-0 loading, checked first


def test_layout_differences_name_dtypes_missing_tensors_and_ties():
    from accel_fsdp.model.build import layout_differences

    rank0 = {"tensors": [("a", [2], "torch.float32"), ("b", [3], "torch.float32")], "ties": [["a", "c"]]}
    assert layout_differences(rank0, rank0) == []
    other = {"tensors": [("a", [2], "torch.bfloat16"), ("d", [1], "torch.float32")], "ties": []}
    assert layout_differences(rank0, other) == ["b: only on rank 0", "d: not on rank 0",
                                                "a: rank 0 torch.float32 [2], here torch.bfloat16 [2]",
                                                "tied parameters: rank 0 [['a', 'c']], here []"]
    swapped = {"tensors": list(reversed(rank0["tensors"])), "ties": rank0["ties"]}
    assert layout_differences(rank0, swapped) == ["the same names in another order"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_checkpoint_rank0_reads_differently_from_the_config_is_one_message(tmp_path):
    """A checkpoint that stores its output embedding apart from the input one (different values) while its config
    ties them: from_pretrained on rank 0 unties them, the config build on rank 1 ties them. Named, not a hang."""
    from safetensors.torch import load_file, save_file

    folder = save_tiny_model(tmp_path / "model", "gpt2")  # GPT-2 ties lm_head to wte
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"] = torch.randn_like(weights["transformer.wte.weight"])
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    r = tiny_recipe(tmp_path / "r.yaml", folder, "builtin:quickstart", data={"max_rows": 200},
                    training={"max_steps": 1})
    proc = run_cli("recipe", "run", r, "--accelerate-config",
                   cpu_config(tmp_path / "c.yaml", fsdp={"fsdp_cpu_ram_efficient_loading": True}),
                   "--output-dir", tmp_path / "run")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert ("rank 0 streams the weights to the ranks that hold their shards, and the model files differ from the "
            "model the config builds" in proc.stderr)
    assert "tied parameters" in proc.stderr and "fsdp_cpu_ram_efficient_loading: false" in proc.stderr
    assert proc.stderr.count("error:") == 1


@pytest.mark.slow
@pytest.mark.multiprocess
def test_rank0_loading_of_a_lora_llama_with_activation_checkpointing_trains_like_loading_everywhere(tmp_path,
                                                                                                tiny_llama):
    r = tiny_recipe(tmp_path / "r.yaml", tiny_llama, "builtin:quickstart",
                    model={"activation_checkpointing": True,
                           "lora": {"enabled": True, "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}},
                    data={"max_rows": 200, "eval_fraction": 0}, training={"max_steps": 2, "mixed_precision": "fp32"},
                    checkpoint={"export_final": False})
    losses = {}
    for efficient in (True, False):
        run = tmp_path / f"run-{efficient}"
        proc = run_cli("recipe", "run", r, "--output-dir", run, "--accelerate-config",
                       cpu_config(tmp_path / f"c{efficient}.yaml", fsdp={"fsdp_cpu_ram_efficient_loading": efficient}), check=0)
        assert ("read by rank 0 only" in proc.stdout) is efficient
        losses[efficient] = [x["loss"] for x in read_metrics(run) if x["kind"] == "train"]
    assert losses[True] == losses[False]  # rank 1 received exactly the weights it would have read


# --------------------------------------------------------------------------------------- 7: RNG state


class _Generator:
    def __init__(self, i):
        self.state = torch.tensor([i], dtype=torch.uint8)

    def get_state(self):
        return self.state.clone()

    def set_state(self, state):
        self.state = state.clone()


def fake_gpus(monkeypatch, n: int, current: int):
    """n visible GPUs, this rank's the current one: only the runtime under torch.cuda's RNG functions is faked."""
    generators = tuple(_Generator(i) for i in range(n))
    cuda, random_module = torch.cuda, sys.modules["torch.cuda.random"]
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "default_generators", generators, raising=False)
    for module in (cuda, random_module):
        monkeypatch.setattr(module, "is_initialized", lambda: True)
        monkeypatch.setattr(module, "device_count", lambda: n)
        monkeypatch.setattr(module, "current_device", lambda: current)
    monkeypatch.setattr(random_module, "_lazy_init", lambda: None)
    return generators


def test_a_rank_saves_and_restores_its_own_gpus_rng_however_many_it_sees(monkeypatch):
    from accel_fsdp.checkpoint.store import _rng_state, _set_rng_state

    with monkeypatch.context() as m:
        fake_gpus(m, n=8, current=3)  # saved under torchrun with 8 GPUs visible, as local rank 3
        state = _rng_state()
    generators = fake_gpus(monkeypatch, n=1, current=0)  # resumed with CUDA_VISIBLE_DEVICES=<its GPU>
    _set_rng_state(state)  # every visible GPU's state restored by index raised IndexError here
    assert generators[0].state.item() == 3
    older = dict(state, cuda=[torch.tensor([i], dtype=torch.uint8) for i in range(8)])  # an earlier version's list
    generators = fake_gpus(monkeypatch, n=8, current=5)
    _set_rng_state(older)
    assert [g.state.item() for g in generators] == [0, 1, 2, 3, 4, 5, 6, 7]


# --------------------------------------------------------------------------------- 8: flash attention


def test_flash_attention_in_fp32_is_refused_before_launch():
    recipe, settings = settings_for("fsdp_2gpu", ["model.attn_implementation=flash_attention_2",
                                                  "training.mixed_precision=fp32"])
    (problem,) = check_settings(settings, recipe)
    assert ("--set model.attn_implementation: flash_attention_2 runs only in fp16 or bf16, and this run computes in "
            "fp32" in str(problem) and "training.mixed_precision: bf16" in str(problem))
    recipe, settings = settings_for("fsdp_2gpu", ["model.attn_implementation=flash_attention_2"])
    assert check_settings(settings, recipe) == []


@pytest.fixture
def flash_standin(monkeypatch):
    """The CPU stand-in for flash_attention_2 (tests/flash_standin.py), undone after the test; the calls' boundaries."""
    return install_flash_standin(monkeypatch.setitem, monkeypatch.setattr)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_flash_kernel_gets_varlen_arguments_and_no_mask_from_the_trainers_batches(tmp_path, flash_standin, kind):
    from transformers import AutoModelForCausalLM

    from accel_fsdp.data.batches import PADDED, batch_layout, collate
    from accel_fsdp.data.store import Sequence

    folder = save_tiny_model(tmp_path / kind, kind)
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=FLASH_STANDIN).eval()
    reference = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    layout = batch_layout(model.config._attn_implementation, True)
    a = torch.tensor
    sequences = [Sequence(a([5, 6, 7, 8, 9, 10, 11]).numpy(), a([-100, 6, 7, -100, 9, 10, 11]).numpy(),
                          a([0, 1, 2, 0, 1, 2, 3]).numpy()),
                 Sequence(a([12, 13, 14, 15, 16]).numpy(), a([-100, 13, 14, 15, 16]).numpy(),
                          a([0, 1, 2, 3, 4]).numpy())]
    with torch.no_grad():
        loss = model(**collate(sequences, 0, True, layout=layout), use_cache=False).loss
        expected = reference(**collate(sequences, 0, True, layout=PADDED), use_cache=False).loss
    assert flash_standin == [[0, 3, 7, 12]] * 2  # one call per layer, the documents' boundaries
    # the same sums of products in another layout (fp32): within the logits' rounding
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
