"""Accelerate config values accel-fsdp would silently ignore or that would stop the ranks, refused before anything
runs with the file, the key, the value and the fix: an FSDP2 config naming a sharding strategy FSDP2 does not read,
fsdp_config keys accel-fsdp never reads (one of which Accelerate's plugin refuses in every rank), a port or GPU list
that is not one; and the same from the environment `accelerate launch` exports. In-process."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from accel_fsdp.config.accelerate import config_from_environment, load_accelerate_config
from accel_fsdp.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def config_with(tmp_path: Path, base: str = "fsdp_cpu", **changes) -> Path:
    config = yaml.safe_load((REPO / "accelerate_configs" / f"{base}.yaml").read_text())
    for key, value in changes.items():
        (config["fsdp_config"] if key.startswith("fsdp_") else config)[key] = value
    path = tmp_path / "acc.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def problems_of(path: Path) -> str:
    with pytest.raises(UserError) as e:
        load_accelerate_config(path)
    return e.value.format_message()


@pytest.mark.parametrize("changes,expected,fix", [
    ({"fsdp_sharding_strategy": "SHARD_GRAD_OP"},
     "'SHARD_GRAD_OP' is ignored by FSDP2, which runs FULL_SHARD here "
     "(fsdp_reshard_after_forward: true)",
     "for SHARD_GRAD_OP set fsdp_reshard_after_forward: false, and remove fsdp_sharding_strategy"),
    ({"fsdp_sharding_strategy": 4}, "4 is ignored by FSDP2", "for HYBRID_SHARD set a parallelism_config"),
    ({"fsdp_sharding_strategy": "NO_SHARD"}, "'NO_SHARD' is ignored by FSDP2",
     "for NO_SHARD set fsdp_version: 1 (FSDP2 always shards)"),
    ({"fsdp_sharding_strategy": "ZERO3"}, "'ZERO3' is not a sharding strategy",
     "remove fsdp_sharding_strategy; FSDP2's strategy is"),
    ({"fsdp_sharding_strategy": "FULL_SHARD", "fsdp_reshard_after_forward": False},
     "'FULL_SHARD' is ignored by FSDP2, which runs SHARD_GRAD_OP here",
     "for FULL_SHARD set fsdp_reshard_after_forward: true"),
])
def test_an_fsdp2_config_naming_a_strategy_it_would_not_run_is_refused(tmp_path, changes, expected, fix):
    msg = problems_of(config_with(tmp_path, **changes))
    assert f"acc.yaml: fsdp_config.fsdp_sharding_strategy: {expected}" in msg and f"fix: {fix}" in msg, msg


def test_an_fsdp2_strategy_that_agrees_with_reshard_after_forward_is_accepted(tmp_path):
    assert load_accelerate_config(config_with(tmp_path, fsdp_sharding_strategy="FULL_SHARD")).get("fsdp_version") == 2
    load_accelerate_config(config_with(tmp_path, fsdp_sharding_strategy=2, fsdp_reshard_after_forward=False))


@pytest.mark.parametrize("key,value,fix", [
    ("fsdp_activation_checkpointing_offload", True, "training.activation_offload: true"),
    ("fsdp_mixed_precision_policy", "bf16", "set mixed_precision"),
    ("fsdp_cpu_offload", True, "use fsdp_offload_params"),
    ("fsdp_transformer_cls_names_to_wrap", "GPT2Block", "use fsdp_transformer_layer_cls_to_wrap"),
    ("fsdp_ignored_modules", "lm_head", "remove it"),
])
def test_an_fsdp_key_accel_fsdp_would_not_read_is_refused(tmp_path, key, value, fix):
    msg = problems_of(config_with(tmp_path, **{key: value}))
    assert f"acc.yaml: fsdp_config.{key}: {value!r} is not read by accel-fsdp" in msg and fix in msg, msg


def test_an_unread_key_set_to_false_is_as_unset(tmp_path):
    load_accelerate_config(config_with(tmp_path, fsdp_activation_checkpointing_offload=False))


@pytest.mark.parametrize("changes,expected", [
    ({"main_process_port": "abc"}, "main_process_port: 'abc' is not a TCP port"),
    ({"main_process_port": 70000}, "main_process_port: 70000 is not a TCP port"),
    ({"gpu_ids": "zero"}, "gpu_ids: 'zero' is neither `all` nor a list of GPU numbers"),
    ({"num_processes": None}, "num_processes: null must be a whole number of at least 1\n"
     "    fix: set num_processes to a whole number of at least 1"),
    ({"fsdp_limit_all_gathers": True}, "fsdp_config.fsdp_limit_all_gathers: True has no effect in FSDP2"),
])
def test_launch_values_that_are_not_one_are_refused(tmp_path, changes, expected):
    assert expected in problems_of(config_with(tmp_path, **changes))


def test_good_ports_and_gpu_lists_are_accepted(tmp_path):
    load_accelerate_config(config_with(tmp_path, main_process_port=29500, gpu_ids="0,1"))
    load_accelerate_config(config_with(tmp_path, main_process_port=0, gpu_ids=3))


STOCK_FSDP2 = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
               "FSDP_RESHARD_AFTER_FORWARD": "false", "FSDP_USE_ORIG_PARAMS": "true",
               "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "false", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
"""What `accelerate launch` exports for an FSDP2 config with fsdp_reshard_after_forward: false: FULL_SHARD and
use_orig_params whatever the file says (accelerate/utils/launch.py; 1.15.0)."""


def test_the_stock_launch_environment_is_judged_by_what_the_user_wrote():
    config = config_from_environment(STOCK_FSDP2)  # its defaults are not the user's mistakes
    assert config.get("fsdp_reshard_after_forward") == "false"
    for changes, expected in [({"FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "true"},
                               "accelerate launch environment: fsdp_config.fsdp_activation_checkpointing_offload: "
                               "'true' is not read by accel-fsdp"),
                              ({"FSDP_SHARDING_STRATEGY": "HYBRID_SHARD"},
                               "'HYBRID_SHARD' is ignored by FSDP2, which runs SHARD_GRAD_OP here")]:
        with pytest.raises(UserError, match=expected):
            config_from_environment({**STOCK_FSDP2, **changes})


@pytest.mark.parametrize("changes,expected,fix", [
    ({"compute_environment": "AMAZON_SAGEMAKER"}, "compute_environment: 'AMAZON_SAGEMAKER': accel-fsdp launches on "
     "this machine", "set compute_environment: LOCAL_MACHINE"),
    ({"rdzv_backend": "bogus"}, "rdzv_backend: 'bogus' is not a torchrun rendezvous backend",
     "set rdzv_backend to one of static, c10d"),
    ({"downcast_bf16": "maybe"}, "downcast_bf16: 'maybe' is not true or false", "set downcast_bf16 to true or false"),
    ({"dynamo_config": {"dynamo_backend": "INDUCTOR"}}, "dynamo_config: {'dynamo_backend': 'INDUCTOR'} is not read by "
     "accel-fsdp", "remove it, and set training.compile: true in the recipe"),
    ({"fp8_config": {"backend": "TE"}}, "fp8_config: {'backend': 'TE'} is not read by accel-fsdp",
     "remove it, and set training.mixed_precision: fp8 in the recipe"),
    ({"fsdp_cpu_ram_efficient_loading": True, "fsdp_sync_module_states": False},
     "fsdp_config.fsdp_sync_module_states: is false, and fsdp_cpu_ram_efficient_loading is true: accelerate launch "
     "refuses", "remove fsdp_sync_module_states (its default is true)"),
])
def test_what_accelerate_launch_would_stop_on_or_ignore_is_refused(tmp_path, changes, expected, fix):
    msg = problems_of(config_with(tmp_path, **changes))
    assert f"acc.yaml: {expected}" in msg and f"fix: {fix}" in msg, msg


def test_what_accelerate_config_writes_by_default_is_accepted(tmp_path):
    load_accelerate_config(config_with(tmp_path, compute_environment="LOCAL_MACHINE", rdzv_backend="static",
                                       downcast_bf16="no", debug=False, same_network=True, enable_cpu_affinity=False,
                                       dynamo_config={"dynamo_backend": "NO"}, fp8_config={}))


def test_accelerate_still_stops_on_what_these_checks_refuse_first(monkeypatch):
    """The reliances the refusals rest on (accelerate 1.15): `accelerate launch` refuses ram-efficient loading with
    fsdp_sync_module_states false, and exports FSDP_SHARDING_STRATEGY=FULL_SHARD whatever the config says; the FSDP
    plugin reads FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD from the environment and refuses it without activation
    checkpointing, which accel-fsdp leaves off under FSDP2."""
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    def args(*extra):
        return launch_command_parser().parse_args(["--use_fsdp", "--num_processes", "2", "--num_machines", "1",
                                                   "--main_process_port", "0", "--mixed_precision", "no",
                                                   "--dynamo_backend", "no",
                                                   *extra, "train.py"])

    from_file = args()  # a config file's values reach the parsed arguments as YAML's booleans
    from_file.fsdp_cpu_ram_efficient_loading, from_file.fsdp_sync_module_states = True, False
    with pytest.raises(ValueError, match="fsdp_sync_module_states"):
        prepare_multi_gpu_env(from_file)
    env = prepare_multi_gpu_env(args("--fsdp_version", "2", "--fsdp_reshard_after_forward", "false"))
    assert env["FSDP_SHARDING_STRATEGY"] == "FULL_SHARD" and env["FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD"] == "false"
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", "true")
    with pytest.raises(ValueError, match="activation_checkpointing_offload"):
        FullyShardedDataParallelPlugin(fsdp_version=2, activation_checkpointing=False)


def test_every_shipped_config_as_accelerate_launch_exports_it_reads_back_without_a_problem():
    """The launch environment is judged as a file is, less what the stock launch exports whatever the file says
    (FSDP1's options under FSDP2) and the address it does not pass on: no shipped config may be refused there."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    from accel_fsdp.config.shipped import shipped_accelerate_configs

    for name, path in sorted(shipped_accelerate_configs().items()):
        args = launch_command_parser().parse_args(["--config_file", str(path), "--main_process_port", "0", "x.py"])
        _validate_launch_command(args)
        env = prepare_multi_gpu_env(args)
        world, machines = int(args.num_processes), int(args.num_machines)
        config = config_from_environment({**env, "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world // machines)})
        assert config.get("fsdp_version") == env["FSDP_VERSION"], name


def test_the_launch_environment_is_judged_as_a_file_is():
    """fsdp_version 3 passed `accelerate launch` unchecked and reached the FSDP plugin as FSDP1 (a KeyError)."""
    with pytest.raises(UserError, match="accelerate launch environment: fsdp_config.fsdp_version: '3' is not 1 or 2"):
        config_from_environment({**STOCK_FSDP2, "FSDP_VERSION": "3"})
    with pytest.raises(UserError, match="mixed_precision: 'fp8' is not supported"):
        config_from_environment({**STOCK_FSDP2, "ACCELERATE_MIXED_PRECISION": "fp8"})
