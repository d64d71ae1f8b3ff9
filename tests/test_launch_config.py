"""Accelerate configs: shipped files are valid, read the way `accelerate launch` reads them, and combine with a
recipe into settings whose every value names its source."""

from __future__ import annotations

import pytest

from accel_fsdp.config.accelerate import config_from_environment, load_accelerate_config
from accel_fsdp.config.recipe import recipe_from_text
from accel_fsdp.config.settings import Source, check_settings, resolve_settings
from accel_fsdp.config.shipped import shipped_accelerate_configs
from accel_fsdp.errors import UserError

RECIPE = """
model: {architecture: gpt2, tokenizer: "builtin:quickstart"}
data: {path: "builtin:quickstart"}
training: {micro_batch_size: 2, global_batch_size: 16, max_steps: 4}
"""
SHIPPED = sorted(shipped_accelerate_configs())


def recipe(overrides=()):
    return recipe_from_text(RECIPE, source="r.yaml", overrides=overrides)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_is_valid_and_fully_commented(name):
    config = load_accelerate_config(name)
    assert config.get("distributed_type") == "FSDP"
    text = shipped_accelerate_configs()[name].read_text()
    assert text.startswith("#"), "every shipped config starts with a header"
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#") and not line.rstrip().endswith(":"):
            assert "#" in line, f"{name}: line without a comment: {line!r}"


@pytest.mark.parametrize("name", SHIPPED)
def test_ranks_read_the_same_settings_as_the_file(name, monkeypatch, cpu_with_native_bf16):
    """Inside a rank started by a stock `accelerate launch`, the FSDP_* variables Accelerate exports from the
    file must resolve to exactly the settings read from the file itself."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    # The device is not exported (skipped below), and on CPU the precision follows it (cpu_with_native_bf16): with the
    # CPU's bf16 pinned, the CPU that runs the suite does not decide the comparison.
    path = shipped_accelerate_configs()[name]
    args = launch_command_parser().parse_args(["--config_file", str(path), "--main_process_port", "0", "x.py"])
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    env["WORLD_SIZE"] = str(args.num_processes)
    env["LOCAL_WORLD_SIZE"] = str(args.num_processes // args.num_machines)
    monkeypatch.setenv("WORLD_SIZE", env["WORLD_SIZE"])
    r = recipe()
    from_file = resolve_settings(r, load_accelerate_config(path), cuda_available=True)
    from_env = resolve_settings(r, config_from_environment(env), cuda_available=True)
    # Accelerate's launcher does not export use_cpu to the ranks: there the device is what is detected.
    skip = {"fsdp1_options", "device"}
    values = lambda s: {k: v["value"] for k, v in s.to_dict().items() if k not in skip}  # noqa: E731
    assert values(from_env) == values(from_file)


def test_recipe_overrides_win_and_name_their_source():
    config = load_accelerate_config("fsdp_2gpu")
    s = resolve_settings(recipe(["fsdp.wrap_class=LlamaDecoderLayer", "checkpoint.state_dict_type=FULL_STATE_DICT"]),
                         config, cuda_available=True)
    assert s.wrap_classes.value == ["LlamaDecoderLayer"] and s.wrap_classes.source == Source.OVERRIDE
    assert s.state_dict_type.value == "FULL_STATE_DICT" and str(s.state_dict_type) == "FULL_STATE_DICT  (--set)"
    assert s.cpu_offload.source == Source.ACCELERATE_CONFIG
    assert s.cpu_offload.source_text == "accelerate_configs/fsdp_2gpu.yaml"
    assert s.to_dict()["cpu_offload"] == {"value": False, "source": "accelerate_configs/fsdp_2gpu.yaml",
                                          "source_kind": "accelerate_config"}
    assert s.sharding_strategy.value == "FULL_SHARD"
    s = resolve_settings(recipe(), load_accelerate_config("fsdp_cpu"), cuda_available=False)
    assert s.wrap_classes.source == Source.DEFAULT and s.device.value == "cpu"
    assert s.wrap_classes.source_text == "default: the model's _no_split_modules"


@pytest.mark.parametrize("config,processes,overrides,expected", [
    ("fsdp1_2gpu", 1, [], "NO_SHARD"), ("fsdp1_2gpu", 1, ["fsdp.sharding_strategy=SHARD_GRAD_OP"], "NO_SHARD"),
    ("fsdp1_2gpu", 2, [], "FULL_SHARD"), ("fsdp_2gpu", 1, [], "FULL_SHARD"),
])
def test_fsdp1_on_one_rank_is_named_no_shard_as_torch_runs_it(config, processes, overrides, expected):
    """FSDP1 runs any strategy on one rank as NO_SHARD, and torch warned so in the middle of the start ("FSDP is
    switching to use NO_SHARD", with its file path) while the start summary said FULL_SHARD. FSDP2 has no NO_SHARD:
    on one rank it keeps its strategy."""
    s = resolve_settings(recipe(overrides), load_accelerate_config(config), cuda_available=True,
                         num_processes=processes)
    assert s.sharding_strategy.value == expected
    if expected == "NO_SHARD":
        asked = "SHARD_GRAD_OP" if overrides else "FULL_SHARD"
        assert str(s.sharding_strategy) == f"NO_SHARD  (derived: {asked} on one rank: FSDP1 holds whole parameters)"
        assert not check_settings(s, recipe(overrides), visible_gpus=1)


def test_batch_arithmetic_error_names_key_values_and_fix():
    r = recipe(["training.global_batch_size=24"])
    s = resolve_settings(r, load_accelerate_config("fsdp_8gpu"), cuda_available=True)
    (problem,) = check_settings(s, r)
    assert str(problem) == (
        "--set training.global_batch_size: 24 is not divisible by micro_batch_size x processes = 2 x 8 = 16, so "
        "gradient accumulation steps would not be a whole number\n"
        "    fix: use a multiple of 16 (e.g. 16 or 32), or change training.micro_batch_size")
    assert check_settings(resolve_settings(recipe(), load_accelerate_config("fsdp_8gpu"), cuda_available=True),
                          recipe()) == []


def test_fp16_needs_a_gpu():
    r = recipe(["training.mixed_precision=fp16"])
    (problem,) = check_settings(resolve_settings(r, load_accelerate_config("fsdp_cpu"), cuda_available=False), r)
    assert "fp16 needs a GPU" in str(problem) and "use bf16" in str(problem)


def test_invalid_config_lists_every_problem(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("distributed_type: MULTI_GPU\nnum_processes: 3\nnum_machines: 2\nfsdp_config:\n"
                   "  fsdp_version: 2\n  fsdp_state_dict_type: LOCAL\n  fsdp_offload_param: true\n"
                   "mixed_precison: bf16\n")
    with pytest.raises(UserError) as e:
        load_accelerate_config(bad)
    msg = e.value.format_message()
    for expected in ("mixed_precison: not an Accelerate config key", "did you mean mixed_precision?",
                     "fsdp_config.fsdp_offload_param: not an Accelerate fsdp_config key",
                     "distributed_type: is 'MULTI_GPU'; accel-fsdp trains with FSDP",
                     "num_processes: 3 processes cannot be split evenly over num_machines = 2",
                     "main_process_ip: is not set", "fsdp_state_dict_type: 'LOCAL' is not supported"):
        assert expected in msg, expected


def test_missing_config_names_the_fix(tmp_path):
    with pytest.raises(UserError) as e:
        load_accelerate_config(tmp_path / "nope.yaml")
    assert "no such accelerate config file" in e.value.format_message()
    with pytest.raises(UserError) as e:
        load_accelerate_config("fsdp_2gpus")
    assert "did you mean fsdp_2gpu" in e.value.format_message()


def test_the_key_tables_are_accelerates_own():
    from accel_fsdp.config.accelerate import FSDP_KEYS, PARALLELISM_KEYS, TOP_LEVEL_KEYS, accelerate_known_keys

    assert (TOP_LEVEL_KEYS, FSDP_KEYS, PARALLELISM_KEYS) == accelerate_known_keys()


def test_saved_settings_read_back_as_they_were(tmp_path):
    """fsdp_settings.json is read as typed settings (verify reads a probe's), each value with its source."""
    import json

    from accel_fsdp.config.settings import FsdpSettings, Setting

    for name in ("fsdp_2gpu", "fsdp_cpu"):
        s = resolve_settings(recipe(["fsdp.cpu_offload=true"]), load_accelerate_config(name), cuda_available=True)
        saved = json.loads(json.dumps(s.to_dict(), default=str))
        again = FsdpSettings.from_dict(saved)
        assert again.to_dict() == saved and again.cpu_offload == s.cpu_offload
        assert again.sharding_strategy.value == s.sharding_strategy.value == "FULL_SHARD"
    for setting in (Setting(2, Source.OVERRIDE), Setting("cuda", Source.DETECTED, "2 GPUs"), Setting(4, Source.DEFAULT),
                    Setting("bf16", Source.TARGET_HARDWARE, "no CUDA here")):
        assert Setting.from_dict(setting.to_dict()) == setting
    (tmp_path / "fsdp_settings.json").write_text("{")
    with pytest.raises(UserError, match="fsdp_settings.json: is unreadable or corrupt"):
        FsdpSettings.read(tmp_path / "fsdp_settings.json")
