"""Which network gloo binds on several machines: derived from NCCL_SOCKET_IFNAME and said, under our launcher and
under a stock `accelerate launch` alike (there, each rank derives it before its process group is created)."""

from __future__ import annotations

import os

import pytest
import yaml
from click.testing import CliRunner
from conftest import REPO

from accel_fsdp.cli import main
from accel_fsdp.config.accelerate import CONFIG_PATH_ENV, load_accelerate_config
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


# ------------------------------------------------------------------------- under our launcher

LAUNCHER_INTERFACES = {"lo": ["127.0.0.1"], "docker0": ["172.17.0.1"], "eth0": [], "eth1": ["10.0.0.2"],
              "ib0": ["192.168.1.2"]}


@pytest.mark.parametrize("env,expected,note", [
    ({"NCCL_SOCKET_IFNAME": "eth"}, "eth1", "binds eth1: GLOO_SOCKET_IFNAME derived from NCCL_SOCKET_IFNAME=eth"),
    ({"NCCL_SOCKET_IFNAME": "=ib0"}, "ib0", "binds ib0"),
    ({"NCCL_SOCKET_IFNAME": "ib,eth"}, "ib0", "binds ib0"),
    ({"NCCL_SOCKET_IFNAME": "=eth"}, None, "NCCL_SOCKET_IFNAME==eth names no interface with an address"),
    ({"NCCL_SOCKET_IFNAME": "^docker0,lo"}, None, "excludes interfaces rather than naming one"),
    ({"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "eth1"}, None, "binds GLOO_SOCKET_IFNAME=eth1"),
    ({}, None, "neither GLOO_SOCKET_IFNAME nor NCCL_SOCKET_IFNAME is set"),
])
def test_gloo_gets_one_exact_interface_derived_from_nccls(env, expected, note):
    """gloo takes exact names (no prefixes, no '=', no '^'), and every machine must open as many devices."""
    from accel_fsdp.launch.launcher import gloo_interface

    name, said = gloo_interface(env, LAUNCHER_INTERFACES)
    assert name == expected and note in said


def test_a_multi_machine_launch_sets_the_interface_and_says_so(tmp_path, monkeypatch, capsys):
    import accelerate.commands.launch as accelerate_launch

    from accel_fsdp.launch import launcher

    config = yaml.safe_load((REPO / "accelerate_configs" / "fsdp_multinode.yaml").read_text())
    config.update(machine_rank=0, main_process_ip="127.0.0.1")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    seen = {}
    monkeypatch.setattr(accelerate_launch, "launch_command", lambda args: seen.update(
        gloo=os.environ.get("GLOO_SOCKET_IFNAME")))
    monkeypatch.setattr(launcher, "network_interfaces", lambda: LAUNCHER_INTERFACES)
    monkeypatch.setattr(launcher, "port_in_use", lambda port: False)  # another test's main machine may hold it
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib")
    saved = dict(os.environ)
    try:
        assert launcher.launch(load_accelerate_config(tmp_path / "c.yaml"), ["recipe", "run", "quickstart"]) == 0
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert seen == {"gloo": "ib0"}
    assert "note: gloo (barriers, object collectives) binds ib0" in capsys.readouterr().err


def test_the_slurm_script_says_which_interface_gloo_binds(tmp_path):
    out = tmp_path / "job.sbatch"
    result = CliRunner().invoke(main, ["slurm", "quickstart", "--nodes", "2", "--gpus-per-node", "2", "-o", str(out)])
    assert result.exit_code == 0, result.output
    script = out.read_text()
    assert "export NCCL_SOCKET_IFNAME=ib0" in script and "GLOO_SOCKET_IFNAME" in script
    assert 'echo "gloo binds:    ${GLOO_SOCKET_IFNAME:-derived on each node from NCCL_SOCKET_IFNAME=' in script


@pytest.mark.parametrize("resolves_to,said", [
    ("fd00::5", "resolves to (fd00::5); set GLOO_SOCKET_IFNAME"),  # an IPv6-only machine
    ("::1", "(::1, a loopback address the other machines cannot reach)"),
    ("127.0.1.1", "(127.0.1.1, a loopback address the other machines cannot reach)"),  # Debian's /etc/hosts
    (None, "(nothing (gloo falls back to the loopback address)"),
])
def test_the_note_names_the_address_gloo_would_bind_ipv6_included(monkeypatch, resolves_to, said):
    """gloo resolves the machine's name with getaddrinfo, any family; the note used gethostbyname (IPv4 alone) and
    told an IPv6-only machine that gloo would fall back to 127.0.0.1."""
    import socket

    from accel_fsdp import hardware

    def getaddrinfo(host, port, *args, **kwargs):
        if resolves_to is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        family = socket.AF_INET6 if ":" in resolves_to else socket.AF_INET
        return [(family, socket.SOCK_STREAM, 6, "", (resolves_to, 0))]

    def ipv4_only(host):
        if resolves_to is None or ":" in resolves_to:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return resolves_to

    monkeypatch.setattr(hardware.socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(hardware.socket, "gethostbyname", ipv4_only)
    name, note = hardware.gloo_interface({}, LAUNCHER_INTERFACES)
    assert name is None and said in note, note
    assert ("loopback address the other" in note) == (resolves_to in ("::1", "127.0.1.1"))


@pytest.mark.parametrize("value,works", [("lo", True), ("lo,lo", True), ("^lo", False), ("=lo", False)])
def test_gloo_takes_exact_interface_names(monkeypatch, value, works):
    """What gloo_interface relies on: GLOO_SOCKET_IFNAME holds exact names (NCCL's '^' and '=' are not names)."""
    import torch.distributed as dist

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(30000 + os.getpid() % 1000))
    try:
        dist.init_process_group("gloo", rank=0, world_size=1)
    except Exception as e:  # gloo's EnforceNotMet surfaces as a RuntimeError (or DistBackendError)
        assert not works and "Unable to find address" in str(e), e
        return
    dist.destroy_process_group()
    assert works
