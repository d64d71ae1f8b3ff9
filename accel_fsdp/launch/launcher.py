"""The CLI launching itself through Accelerate's own launcher (`accelerate launch`), never a home-made one.

`accel-fsdp recipe run X --accelerate-config C` outside a distributed launch becomes, in effect,
`accelerate launch --config_file C -m accel_fsdp recipe run X ...`: the same command line runs in every rank,
where `inside_launch()` is true and training starts. The config's path travels in ACCEL_FSDP_ACCELERATE_CONFIG
so the ranks read the same file and name it in their messages.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from accel_fsdp.config.accelerate import CONFIG_PATH_ENV, AccelerateConfig
from accel_fsdp.errors import Problem, UserError
from accel_fsdp.hardware import usable_cores
from accel_fsdp.layout import PREEMPTED_FILE, finished_since
from accel_fsdp.train.lifetime import PREEMPTED, launcher_environment


def inside_launch() -> bool:
    """True inside a rank started by torchrun / accelerate launch (or SLURM's srun with torchrun)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


@dataclass
class MachineOptions:
    """Per-machine launch settings that override the config (what differs between the machines of one job)."""
    machine_rank: int | None = None
    main_process_ip: str | None = None
    main_process_port: int | None = None
    num_machines: int | None = None
    rendezvous_timeout: int = 300

    def apply(self, config: AccelerateConfig) -> None:
        """Overlay the options on the config's values (the file itself is not changed)."""
        for key in ("machine_rank", "main_process_ip", "main_process_port", "num_machines"):
            if getattr(self, key) is not None:
                config.values[key] = getattr(self, key)


def launch(config: AccelerateConfig, argv: list[str], *, num_processes: int | None = None,
           machine: MachineOptions | None = None, run_dir: Path | None = None) -> int:
    """Run `python -m accel_fsdp <argv>` in every rank the config asks for; return the exit status.

    A preemption signal (SIGTERM, SIGUSR1) to this process reaches every rank, which finishes its step and writes a
    checkpoint; the status is then PREEMPTED (75). Ctrl-C stops the ranks at once (130)."""
    from accelerate.commands.launch import launch_command, launch_command_parser


    machine = machine or MachineOptions()
    machines = int(config.get("num_machines", 1) or 1)
    args = ["--config_file", str(config.path)]
    if num_processes is not None:
        args += ["--num_processes", str(num_processes)]
    for key in ("machine_rank", "main_process_ip", "main_process_port", "num_machines"):
        if getattr(machine, key) is not None:
            args += [f"--{key}", str(getattr(machine, key))]
    if machines == 1 and not config.get("main_process_port"):
        args += ["--main_process_port", "0"]  # a free port: two runs on one machine must not collide
    if machines > 1:
        name, note = gloo_interface(os.environ, network_interfaces())
        if name:
            os.environ["GLOO_SOCKET_IFNAME"] = name  # the ranks inherit it
        print(f"note: {note}", file=sys.stderr)
        args += ["--rdzv_conf", f"timeout={machine.rendezvous_timeout}"]
        address = (str(config.get("main_process_ip")), int(config.get("main_process_port") or 29500))
        if int(config.get("machine_rank", 0) or 0) > 0:
            wait_for_main(*address, timeout=machine.rendezvous_timeout)
    if config.get("use_cpu") and not os.environ.get("OMP_NUM_THREADS"):
        # One thread per rank unless told otherwise: CPU ranks share the cores.
        per_machine = max(1, int(config.get("num_processes", 1) or 1) // machines)
        args += ["--num_cpu_threads_per_process", str(max(1, usable_cores() // per_machine))]
    args += ["-m", "accel_fsdp", *argv]
    parsed = launch_command_parser().parse_args(args)
    os.environ[CONFIG_PATH_ENV] = str(config.path.resolve())
    os.environ.update(launcher_environment(os.environ))
    # torchrun's agent logs every child failure with a banner; our ranks already said what went wrong.
    for name in ("torch.distributed.elastic", "torch.distributed.run", "accelerate"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    started = time.time()
    try:
        launch_command(parsed)
    except subprocess.CalledProcessError as e:  # the single-process launcher
        return _status(e.returncode)
    except KeyboardInterrupt:
        return _interrupted("SIGINT")
    except Exception as e:  # torchrun's ChildFailedError, or a rendezvous that never completed
        if type(e).__name__ == "SignalException":  # torchrun turns the signals it handles into this
            name = signal.Signals(getattr(e, "sigval", signal.SIGTERM)).name
            return _preempted(name, run_dir, started) if name in ("SIGTERM", "SIGUSR1") else _interrupted(name)
        failures = getattr(e, "failures", None)
        if not failures:
            if machines > 1 and _is_timeout(e):
                raise UserError(Problem(
                    f"{config.get('main_process_ip')}:{config.get('main_process_port') or 29500}",
                    f"not all {machines} machines joined within {machine.rendezvous_timeout}s ({_first_line(e)})",
                    "start the same command on every machine with its --machine-rank (0 to "
                    f"{machines - 1}), check that they can reach this address and port, or raise "
                    "--rendezvous-timeout")) from None
            raise
        codes = [f.exitcode for f in failures.values()]
        if 2 in codes:
            return 2  # a user error, already explained by rank 0
        if all(code == PREEMPTED for code in codes):
            return _preempted(None, run_dir, started)  # a rank got the signal; the ranks checkpointed
        for rank, f in sorted(failures.items()):
            if f.exitcode < 0:
                print(f"error: rank {rank} was killed by {signal.Signals(-f.exitcode).name}", file=sys.stderr)
            else:
                print(f"error: rank {rank} exited with status {f.exitcode} (see its output above)", file=sys.stderr)
        return 1
    return 0


def gloo_interface(env, interfaces: dict[str, list[str]]) -> tuple[str | None, str]:
    """GLOO_SOCKET_IFNAME for this machine (None: leave it as it is) and the note said before a multi-machine launch.

    Barriers, object collectives and CPU tensors ride on gloo (the group is cuda:nccl,cpu:gloo). Without
    GLOO_SOCKET_IFNAME gloo binds the address this machine's name resolves to, else loopback, silently: other machines
    cannot reach it and the job hangs until the collective timeout. gloo takes exact interface names, comma separated,
    one device each, and ignores a one-character value (torch/csrc/distributed/c10d/init.cpp, ProcessGroupGloo;
    gloo/transport/tcp/device.cc, lookupAddrForIface compares names with strcmp; torch 2.13.0). NCCL_SOCKET_IFNAME
    lists prefixes, `=` makes them exact, `^` excludes. One interface is derived, so every machine opens one gloo
    device. `interfaces`: name -> addresses, in the system's order."""
    own = env.get("GLOO_SOCKET_IFNAME", "").strip()
    if own:
        return None, f"gloo (barriers, object collectives) binds GLOO_SOCKET_IFNAME={own}"
    nccl = env.get("NCCL_SOCKET_IFNAME", "").strip()
    usable = [name for name, addresses in interfaces.items() if addresses]
    if nccl and not nccl.startswith("^"):
        exact = nccl.startswith("=")
        for want in (w.strip() for w in nccl.lstrip("=").split(",") if w.strip()):
            for name in usable:
                if name == want or (not exact and name.startswith(want)):
                    return name, f"gloo (barriers, object collectives) binds {name}: GLOO_SOCKET_IFNAME derived from " \
                                 f"NCCL_SOCKET_IFNAME={nccl}"
        return None, (f"NCCL_SOCKET_IFNAME={nccl} names no interface with an address on this machine "
                      f"({', '.join(usable) or 'none'}): gloo binds the address of this machine's name; set "
                      "GLOO_SOCKET_IFNAME to the interface the machines share")
    try:
        where = socket.gethostbyname(socket.gethostname())
    except OSError:
        where = "nothing (gloo falls back to 127.0.0.1)"
    why = f"NCCL_SOCKET_IFNAME={nccl} excludes interfaces rather than naming one" if nccl else \
        "neither GLOO_SOCKET_IFNAME nor NCCL_SOCKET_IFNAME is set"
    loop = ", a loopback address the other machines cannot reach" if where.startswith("127.") else ""
    return None, (f"{why}: gloo (barriers, object collectives) binds the address this machine's name resolves to "
                  f"({where}{loop}); set GLOO_SOCKET_IFNAME (or NCCL_SOCKET_IFNAME) to the interface the machines "
                  "share, on every machine")


def network_interfaces() -> dict[str, list[str]]:
    """This machine's interfaces and their IPv4/IPv6 addresses (psutil, a dependency of Accelerate)."""
    import psutil

    return {name: [a.address for a in addresses if a.family in (socket.AF_INET, socket.AF_INET6)]
            for name, addresses in psutil.net_if_addrs().items()}


def wait_for_main(host: str, port: int, *, timeout: float, interval: float = 1.0) -> None:
    """Before a non-main machine launches: the main process must be reachable, else one clear error instead of a
    silent wait. The main machine may start later, so keep trying until `timeout`."""
    deadline = time.monotonic() + timeout
    last: OSError | None = None
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(5.0, max(0.5, timeout))):
                return
        except OSError as e:
            last = e
        if time.monotonic() >= deadline:
            break
        time.sleep(interval)
    raise UserError(Problem(f"{host}:{port}", f"cannot reach the main process (machine_rank 0) within {timeout:.0f}s "
                            f"({last.strerror or last})",
                            "start machine_rank 0 first (or together), check main_process_ip / main_process_port "
                            "(--main-process-ip, --main-process-port) and that the port is open between the "
                            "machines; --rendezvous-timeout waits longer"))


def _preempted(name: str | None, run_dir: Path | None, started: float = 0.0) -> int:
    """A preemption signal (to this launcher, which forwarded it, or to a rank) ended the launch. If the ranks had
    finished the run first (the signal came during the last moments, or as the job ended), the run is done: 0, so a
    scheduler does not requeue a finished job. Else they checkpointed and exited: say where, from the record the
    main rank wrote in this launch (each start removes an older one), and return PREEMPTED."""
    import json

    if run_dir is not None and finished_since(run_dir, started):
        print(f"{name or 'a preemption signal'} came after the run had finished: nothing to resume", file=sys.stderr)
        return 0
    where = ""
    marker = run_dir / PREEMPTED_FILE if run_dir else None
    if marker is not None and marker.exists():
        try:
            info = json.loads(marker.read_text())
            where = f": the ranks stopped after step {info['step']} with checkpoint {info['checkpoint']}"
            name = name or info.get("signal")
        except (ValueError, KeyError, OSError):
            pass
    # --resume auto, not --resume: a signal before the first checkpoint (or before the run folder) leaves nothing
    # that --resume could continue, and auto then starts the run again.
    print(f"preempted ({name}){where}. Continue with the same command and --resume auto.", file=sys.stderr)
    return PREEMPTED


def _interrupted(name: str) -> int:
    print(f"interrupted ({name}): the ranks were stopped. Run the same command with --resume to continue from the "
          "newest complete checkpoint.", file=sys.stderr)
    return 128 + getattr(signal, name, signal.SIGINT).value


def _is_timeout(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    return "timeout" in text or "timed out" in text


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def _status(code: int) -> int:
    return 2 if code == 2 else (1 if code else 0)
