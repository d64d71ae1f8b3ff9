"""Which network gloo binds on several machines: derived from NCCL_SOCKET_IFNAME and said, under our launcher and
under a stock `accelerate launch` alike (there, each rank derives it before its process group is created)."""

from __future__ import annotations

import os

import pytest

from accel_fsdp.config.accelerate import CONFIG_PATH_ENV
from accel_fsdp.config.recipe import recipe_from_text

INTERFACES = {"lo": ["127.0.0.1"], "eth0": [], "eth1": ["10.0.0.2"], "ib0": ["192.168.1.2"]}
STOCK_TWO_MACHINES = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}  # what torchrun gives a rank of 2 machines x 2


@pytest.mark.parametrize("env,expected,note", [
    ({**STOCK_TWO_MACHINES, "NCCL_SOCKET_IFNAME": "ib"}, "ib0", "binds ib0: GLOO_SOCKET_IFNAME derived from "
                                                                "NCCL_SOCKET_IFNAME=ib"),
    (STOCK_TWO_MACHINES, None, "neither GLOO_SOCKET_IFNAME nor NCCL_SOCKET_IFNAME is set"),
    ({**STOCK_TWO_MACHINES, "NCCL_SOCKET_IFNAME": "ib", "GLOO_SOCKET_IFNAME": "eth1"}, None, None),  # the user's
    ({**STOCK_TWO_MACHINES, "NCCL_SOCKET_IFNAME": "ib", CONFIG_PATH_ENV: "c.yaml"}, None, None),  # our launcher's
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "NCCL_SOCKET_IFNAME": "ib"}, None, None),  # one machine
])
def test_a_stock_multi_machine_launch_derives_gloos_interface_in_the_ranks(env, expected, note):
    from accel_fsdp.train.accelerator import stock_launch_gloo_interface

    machines = int(env["WORLD_SIZE"]) // int(env["LOCAL_WORLD_SIZE"])
    name, said = stock_launch_gloo_interface(env, machines, lambda: INTERFACES)
    assert name == expected
    assert said == note if note is None else note in said


def test_the_rank_sets_it_before_its_process_group_and_its_machine_says_it_once(monkeypatch, capsys):
    from accel_fsdp import hardware
    from accel_fsdp.train import setup

    for key in list(os.environ):
        if key.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "unset below")  # restored after the test
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.delenv(CONFIG_PATH_ENV, raising=False)
    for key, value in {**STOCK_TWO_MACHINES, "RANK": "2", "LOCAL_RANK": "0", "NCCL_SOCKET_IFNAME": "ib"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(hardware, "network_interfaces", lambda: INTERFACES)
    seen = {}

    def accelerator(settings, **kwargs):  # where the process group would be created
        seen["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME")
        return object()

    monkeypatch.setattr(setup, "build_accelerator", accelerator)
    recipe = recipe_from_text("name: r\nmodel: {architecture: gpt2, tokenizer: 'builtin:quickstart'}\n"
                              "data: {path: 'builtin:quickstart', seq_len: 64}\n"
                              "training: {micro_batch_size: 1, global_batch_size: 8, max_steps: 2}\n", source="r.yaml")
    setup.start_engine(recipe, run_dir=None)
    assert seen == {"GLOO_SOCKET_IFNAME": "ib0"}
    assert capsys.readouterr().err.count("note: gloo (barriers, object collectives) binds ib0") == 1
    monkeypatch.setenv("LOCAL_RANK", "1")  # the machine's other rank: the same interface, said once per machine
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    setup.start_engine(recipe, run_dir=None)
    assert seen == {"GLOO_SOCKET_IFNAME": "ib0"} and "note:" not in capsys.readouterr().err
