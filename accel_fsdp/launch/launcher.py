"""The CLI launching itself through Accelerate's own launcher (`accelerate launch`), never a home-made one.

`accel-fsdp recipe run X --accelerate-config C` outside a distributed launch becomes, in effect,
`accelerate launch --config_file C -m accel_fsdp recipe run X ...`: the same command line runs in every rank,
where `inside_launch()` is true and training starts. The config's path travels in ACCEL_FSDP_ACCELERATE_CONFIG
so the ranks read the same file and name it in their messages.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from accel_fsdp.config.accelerate import CONFIG_PATH_ENV, AccelerateConfig
from accel_fsdp.errors import Problem, UserError
from accel_fsdp.files import scratch_folder
from accel_fsdp.hardware import (
    OMP_THREADS_ENV,
    gloo_interface,
    network_interfaces,
    oom_kills,
    oversubscribed_cores_note,
    usable_cores,
)
from accel_fsdp.layout import PREEMPTED_FILE, finished_since
from accel_fsdp.train.lifetime import (
    CRASHED,
    INTERRUPTED,
    INTERRUPTED_BY_USER,
    LAUNCHER_PID_ENV,
    OUT_OF_MEMORY_FIX,
    PEER_FAILED,
    PREEMPTED,
    PREEMPTION_SIGNALS,
    RANK_RECORDS_ENV,
    STOPPED,
    TIMED_OUT,
    TIMEOUT_FIX,
    USER_ERROR,
    RankRecord,
    RankRecords,
    launcher_environment,
)


RANK_ADDRESS_ENV = ("RANK", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun gives every rank besides LOCAL_RANK and WORLD_SIZE (torch/distributed/elastic/agent/server/api.py,
SimpleElasticAgent._start_workers via the local agent's worker env; torch 2.13.0): the rank's place and the address
its process group meets at."""


def inside_launch() -> bool:
    """True inside a rank started by torchrun / accelerate launch (or SLURM's srun with torchrun). LOCAL_RANK and
    WORLD_SIZE without the rest of a rank's environment are left over from another launch (a shell that ran one, a
    script that exported them): one message, where this process would train as a rank whose process group can never
    meet (Accelerate's "MASTER_ADDR env was not set" traceback), or as one rank of one instead of launching its own."""
    if not ("LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return False
    missing = [name for name in RANK_ADDRESS_ENV if not os.environ.get(name)]
    if missing:
        given = ", ".join(f"{name}={os.environ[name]}" for name in ("LOCAL_RANK", "WORLD_SIZE"))
        raise UserError(Problem(given, f"a rank's environment only in part ({', '.join(missing)} not set): left over "
                                "from another launch, it makes this command act as one rank of a launch that is not "
                                "there", "unset LOCAL_RANK WORLD_SIZE (accel-fsdp then launches its own ranks), or "
                                "start it under torchrun / accelerate launch, which set all of them"))
    return True


def srun_step_problem(env, config: AccelerateConfig, machine: MachineOptions) -> Problem | None:
    """Under srun (a SLURM job step), where each task that runs `recipe run` of several machines is one machine's
    launcher: more tasks than nodes (`srun --ntasks-per-node=8`, one per GPU, as for a program that is its own rank)
    would start several launchers on a node, each with all of its ranks (tasks that are runs of one machine each, a
    sweep, are the user's to place); with one task per node on as many nodes as the job's machines,
    a machine rank other than the node's (SLURM_NODEID: the same rank on every node, where --machine-rank was not
    given) would make several machines claim one rank and the rendezvous never completes. The step's size and this
    node's place are what srun sets in every task (srun(1), OUTPUT ENVIRONMENT VARIABLES); without them, no check."""
    try:
        tasks, nodes = int(env["SLURM_STEP_NUM_TASKS"]), int(env["SLURM_STEP_NUM_NODES"])
        node = int(env["SLURM_NODEID"])
    except (KeyError, ValueError):
        return None
    machines, machine_rank = config.num_machines(), config.machine_rank()
    if machines > 1 and tasks > nodes:
        return Problem(f"SLURM_STEP_NUM_TASKS={tasks}", f"srun started {tasks} tasks on {nodes} node(s), and each "
                       "`accel-fsdp recipe run` launches all of its machine's ranks itself: several per node would "
                       "start several ranks per GPU", "start one task per node (srun --ntasks-per-node=1), or write "
                       "the job with `accel-fsdp slurm`")
    # srun(1) calls SLURM_NODEID "the relative node ID" without saying relative to what: in a step on part of the
    # job's nodes it may be the node's place in the job, so the rank is compared only where the step spans the job
    # (a refusal of a right rank would stop a run that works).
    job_nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    whole_job = job_nodes is None or job_nodes.strip() == str(nodes)
    if machines == nodes > 1 and whole_job and machine_rank != node:
        return Problem(f"{_named(config, machine, 'machine_rank')} {machine_rank}",
                       f"runs on node {node} of the {nodes} of this SLURM step (SLURM_NODEID={node}): each node "
                       "needs its own machine rank, else two claim one and the machines never all meet",
                       'give --machine-rank "$SLURM_NODEID" (in the command srun runs on every node), as a script of '
                       "`accel-fsdp slurm` does")
    return None


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
    from accelerate.commands.launch import launch_command_parser

    machine = machine or MachineOptions()
    machines = config.num_machines()
    per_machine = max(1, int(num_processes or config.get("num_processes", 1) or 1) // machines)
    args = ["--config_file", str(config.path)]
    if num_processes is not None:
        args += ["--num_processes", str(num_processes)]
    for key in ("machine_rank", "main_process_ip", "main_process_port", "num_machines"):
        if getattr(machine, key) is not None:
            args += [f"--{key}", str(getattr(machine, key))]
    args += _meeting_args(config, machine, machines)
    args += _environment_args(config, per_machine)
    args += ["-m", "accel_fsdp", *argv]
    parsed = launch_command_parser().parse_args(args)
    os.environ[CONFIG_PATH_ENV] = str(config.path.resolve())
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # the parent every rank must find (train/lifetime.py)
    os.environ.update(launcher_environment(os.environ))
    # torchrun's agent logs every child failure with a banner, and a signal it forwards with a line ("Received 10
    # death signal, shutting down workers"); our ranks and _preempted already say what happened. Its modules' loggers
    # carry levels of their own (torch/distributed/elastic/utils/logging.py, get_logger sets one: WARNING unless
    # LOGLEVEL; torch 2.13.0), which a parent's level does not override: each one is set, its module imported first.
    import torch.distributed.elastic.agent.server.api  # noqa: F401

    quiet = ("torch.distributed.elastic", "torch.distributed.run", "accelerate")
    for name in (*quiet, *(n for n in list(logging.Logger.manager.loggerDict) if n.startswith(quiet))):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    first = config.machine_rank() * per_machine
    # Where a rank that ends early says why (train/lifetime.py): this launch's alone, read once the ranks are gone.
    with scratch_folder("accel-fsdp-ranks") as folder:
        records = RankRecords(folder)
        os.environ[RANK_RECORDS_ENV] = str(records.folder)
        try:
            return _launch(parsed, config, machine, run_dir, records, range(first, first + per_machine))
        finally:
            os.environ.pop(RANK_RECORDS_ENV, None)
            os.environ.pop(LAUNCHER_PID_ENV, None)


def _meeting_args(config: AccelerateConfig, machine: MachineOptions, machines: int) -> list[str]:
    """Where the ranks meet, checked first: one machine, on a free port (its own if it is in use); several, at an
    address that resolves, a port free on the main machine, the other machines waiting for it, gloo's interface."""
    port = int(config.get("main_process_port") or 0)
    if machines == 1 and port and port_in_use(port):
        print(f"note: {_named(config, machine, 'main_process_port')} {port} is in use by another process on this "
              "machine: the ranks meet on a free port instead (one machine needs none in particular)", file=sys.stderr)
        port = 0
    if machines == 1:
        return [] if port else ["--main_process_port", "0"]  # a free port: two runs on one machine must not collide
    if (problem := main_address_problem(config, machine)) is not None:
        raise UserError(problem)
    name, note = gloo_interface(os.environ, network_interfaces())
    if name:
        os.environ["GLOO_SOCKET_IFNAME"] = name  # the ranks inherit it
    print(f"note: {note}", file=sys.stderr)
    if config.machine_rank() > 0:
        address = (str(config.get("main_process_ip")), int(config.get("main_process_port") or 29500))
        wait_for_main(*address, timeout=machine.rendezvous_timeout)
    return ["--rdzv_conf", f"timeout={machine.rendezvous_timeout}"]


def _environment_args(config: AccelerateConfig, per_machine: int) -> list[str]:
    """The ranks' threads (a share of the cores for CPU ranks unless OMP_NUM_THREADS says otherwise), and the
    environment they inherit without the ACCELERATE_*/FSDP_* variables a shell left exported."""
    args = []
    if config.uses_cpu() and (note := oversubscribed_cores_note(os.environ, per_machine)):
        print(f"note: {note}", file=sys.stderr)
    if config.uses_cpu() and not os.environ.get(OMP_THREADS_ENV):
        # One thread per rank unless told otherwise: CPU ranks share the cores.
        args += ["--num_cpu_threads_per_process", str(max(1, usable_cores() // per_machine))]
    if stale := stale_launch_variables(os.environ):
        print(f"note: {', '.join(f'{name}={os.environ[name]}' for name in stale)} exported in this shell "
              f"{'is' if len(stale) == 1 else 'are'} left out of the launch: the accelerate config and the recipe "
              "decide (unset them to silence this note)", file=sys.stderr)
        for name in stale:
            del os.environ[name]
    return args


def _launch(parsed, config: AccelerateConfig, machine: MachineOptions, run_dir: Path | None, records: RankRecords,
            local_ranks: range) -> int:
    """Accelerate's launch of this machine's ranks, and what it ended with: the exit status, and what to say."""
    from accelerate.commands.launch import launch_command

    machines = config.num_machines()
    started, oom_kills_before = time.time(), oom_kills()
    try:
        launch_command(parsed)
    except subprocess.CalledProcessError as e:  # the single-process launcher
        early = ended_early(records.read(), local_ranks, machines)
        return early if early is not None else _status(e.returncode)
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
        codes = {rank: f.exitcode for rank, f in failures.items()}
        early = ended_early(records.read(), local_ranks, machines)
        if early is not None:
            return early
        if 2 in codes.values():
            return 2  # a user error, already explained by a rank
        preemption = preemption_of_ranks(codes)
        if preemption is not None:
            return _preempted(preemption or None, run_dir, started)
        interrupted = sorted(rank for rank, code in codes.items() if code == INTERRUPTED)
        if interrupted:  # Ctrl-C (SIGINT) to a rank alone, which stopped; the others followed it
            return _interrupted(f"SIGINT to {_ranks(interrupted)}")
        status = 1
        for rank, code in sorted(codes.items()):
            if code < 0:
                said, oom = killed_rank_message(rank, signal.Signals(-code), oom_kills_before, oom_kills())
                print(said, file=sys.stderr)
                status = 2 if oom else status
            elif code != PEER_FAILED:
                print(f"error: rank {rank} exited with status {code} (see its output above)", file=sys.stderr)
        return status
    return 0


def killed_rank_message(rank: int, sig: signal.Signals, oom_kills_before: int | None,
                        oom_kills_after: int | None) -> tuple[str, bool]:
    """What to say of a rank a signal ended, and whether the kernel's out-of-memory killer did it: a SIGKILL while the
    machine's count of OOM kills rose (`oom_kills`) is that, and the recipe asks for more host memory than there is
    (exit status 2, as for a rank that ran out of memory itself: train/lifetime.py `out_of_memory_error`)."""
    said = f"error: rank {rank} was killed by {sig.name}"
    resume = "\n    the run can go on from its newest checkpoint: the same command with --resume auto"
    if sig in (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGABRT):
        return f"{said} (a crash in native code: torch, a compiled kernel, or the hardware)", False
    if sig != signal.SIGKILL:
        return said, False
    if oom_kills_before is not None and oom_kills_after is not None and oom_kills_after > oom_kills_before:
        return (f"{said}: the kernel's out-of-memory killer ended a process of this machine while the run trained "
                f"(oom_kill in /proc/vmstat went from {oom_kills_before} to {oom_kills_after})\n    fix: "
                f"{OUT_OF_MEMORY_FIX['host']}{resume}"), True
    known = oom_kills_before is not None and oom_kills_after is not None
    return (f"{said} ({'not by the out-of-memory killer, which ended nothing meanwhile: ' if known else ''}"
            f"`kill -9`, a job scheduler's limit{'' if known else ', or the out-of-memory killer'}){resume}"), False


KEPT_LAUNCH_VARIABLES = frozenset({"ACCELERATE_LOG_LEVEL", "ACCELERATE_DEBUG_MODE"})
"""Accelerate variables a user may set around our launch: how much it logs, and its collective-shape checks."""


def stale_launch_variables(env) -> list[str]:
    """The ACCELERATE_* and FSDP_* variables exported before our launch (by another `accelerate launch` this shell ran,
    or by hand). Accelerate's launcher exports those the config sets and leaves the others as they are, and the ranks
    read them where accel-fsdp passes no value: ACCELERATE_USE_DEEPSPEED=true made every rank ask for DeepSpeed (an
    ImportError traceback each), an FSDP_* key the config leaves out reached Accelerate's plugin. The config and the
    recipe are what decides: these are left out."""
    return sorted(name for name in env if name.startswith(("ACCELERATE_", "FSDP_"))
                  and name not in KEPT_LAUNCH_VARIABLES)


def preemption_of_ranks(codes: dict[int, int]) -> str | None:
    """The ranks' exit statuses as a preemption: "" when they checkpointed (PREEMPTED; the marker names the signal),
    the signals that ended ranks before they could answer them ("SIGUSR1 to rank 1"), or None when something else
    ended the run. A rank answers SIGTERM and SIGUSR1 from its process group on (train/setup.py); before that, while
    it starts, with nothing to save yet, the signal's default action ends it, and torchrun's agent then ends the
    others with SIGTERM (or they stop, PEER_FAILED, when a collective finds a peer gone)."""
    by_signal: dict[str, list[int]] = {}
    for rank, code in sorted(codes.items()):
        if code < 0 and signal.Signals(-code) in PREEMPTION_SIGNALS:
            by_signal.setdefault(signal.Signals(-code).name, []).append(rank)
        elif code not in (PREEMPTED, PEER_FAILED):
            return None
    if not by_signal:
        return "" if PREEMPTED in codes.values() else None
    return ", ".join(f"{name} to {_ranks(ranks)}" for name, ranks in by_signal.items())


def ended_early(records: dict[int, RankRecord], local_ranks: range, machines: int) -> int | None:
    """What to say when ranks of this machine ended early and recorded why (train/lifetime.py), once: a user's
    mistake (each distinct message, exit 2), a rank that stopped making progress and where the others waited for it
    (1), a bug (the rank's traceback is above; 1), or a failure on another machine. None: no record explains it."""
    by_why: dict[str, list[RankRecord]] = {}
    for record in sorted(records.values(), key=lambda r: r.rank):
        by_why.setdefault(record.why, []).append(record)
    if USER_ERROR in by_why:
        for message in dict.fromkeys(r.message for r in by_why[USER_ERROR]):
            UserError(message).show()
        return 2
    if TIMED_OUT in by_why:
        UserError(hang_problem(records, local_ranks, machines)).show()
        return 1
    if CRASHED in by_why:
        for r in by_why[CRASHED]:
            print(f"error: rank {r.rank} failed in {r.doing} (its traceback is above)", file=sys.stderr)
        return 1
    if INTERRUPTED_BY_USER in by_why:
        return None  # Ctrl-C to a rank of this machine: its exit status (130) says it, the others followed
    if STOPPED in by_why and machines > 1:
        print("error: this machine's ranks stopped because a rank of another machine ended early: that machine's "
              "output says why", file=sys.stderr)
        return 1
    return None


def hang_problem(records: dict[int, RankRecord], local_ranks: range, machines: int) -> Problem:
    """A collective timed out: which rank(s) stopped making progress, where, and where the others waited for them.
    A rank that did not time out itself is the one that stopped: its record says where torchrun's SIGTERM found it,
    and no record means it did not even answer that (stuck outside Python: a GPU, file-system or network call)."""
    waited = [r for r in sorted(records.values(), key=lambda r: r.rank) if r.why == TIMED_OUT]
    how_long = waited_for(waited[0].waited_minutes)
    stuck = [rank for rank in local_ranks if rank not in {r.rank for r in waited}]
    places = {r.doing for r in waited}
    if stuck:
        found = {records[rank].doing for rank in stuck if rank in records}
        where = "; ".join(
            f"{_ranks(group)} stopped making progress in {records[group[0]].doing}" if group[0] in records else
            f"{_ranks(group)} stopped making progress (it did not answer the launcher's SIGTERM: stuck outside "
            "Python, in a GPU, file-system or network call)"
            for group in _grouped(stuck, lambda rank: records[rank].doing if rank in records else ""))
        waiting = (f"{_ranks([r.rank for r in waited])} waited {how_long} for it there" if places == found else
                   f"{_waiting(waited)} waited {how_long} for it")
        return Problem("", f"{where}: {waiting}", TIMEOUT_FIX)
    if machines > 1:
        return Problem("", f"every rank of this machine waited {how_long} for a rank of another machine that stopped "
                           f"making progress ({_waiting(waited)}): that machine's output names it", TIMEOUT_FIX)
    return Problem("", f"the ranks waited {how_long} for each other in different places ({_waiting(waited)}): they "
                       "ran different collectives, a bug of accel-fsdp: please report it with this output")


def waited_for(minutes: float | None) -> str:
    """'15 s (fsdp.collective_timeout_minutes: 0.25)'."""
    if not minutes:
        return "the collective timeout"
    span = f"{minutes * 60:.0f} s" if minutes < 1 else f"{minutes:g} min"
    return f"{span} (fsdp.collective_timeout_minutes: {minutes:g})"


def _waiting(waited: list[RankRecord]) -> str:
    return "; ".join(f"{_ranks([r.rank for r in group])} in {group[0].doing}"
                     for group in _grouped(waited, lambda r: r.doing))


def _grouped(items, key) -> list[list]:
    groups: dict = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return list(groups.values())


def _ranks(ranks: list[int]) -> str:
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


def port_in_use(port: int) -> bool:
    """Something on this machine accepts connections on `port`: Accelerate's own test (accelerate/utils/other.py,
    is_port_in_use, a connect to localhost; accelerate 1.15), which on one machine silently picks another port (with a
    UserWarning) and on the main machine of several raises ConnectionError."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        return probe.connect_ex(("localhost", port)) == 0


def main_address_problem(config: AccelerateConfig, machine: MachineOptions) -> Problem | None:
    """Before a multi-machine launch: the main process's address must resolve (else rank 0's store waits out the whole
    rendezvous timeout with a C++ stack per retry, and the message blames the machines that did not join), and on
    the main machine its port must be free (else Accelerate's ConnectionError traceback)."""
    host, port = str(config.get("main_process_ip")), int(config.get("main_process_port") or 29500)
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        return Problem(f"{_named(config, machine, 'main_process_ip')} {host}",
                       f"does not resolve to an address ({e.strerror or e})",
                       "give the IP address of the machine with machine_rank 0, or a name every machine resolves "
                       "(`getent hosts NAME` shows what it resolves to)")
    if config.machine_rank() == 0 and port_in_use(port):
        return Problem(f"{_named(config, machine, 'main_process_port')} {port}",
                       "is in use by another process on this machine (the main machine, where the ranks meet)",
                       "choose another port, the same on every machine, or stop what holds it (`ss -ltnp "
                       f"'sport = :{port}'` names it)")
    return None


def _named(config: AccelerateConfig, machine: MachineOptions, key: str) -> str:
    """Where a machine setting came from, as the user gave it: the option, else the config's key."""
    if getattr(machine, key) is not None:
        return "--" + key.replace("_", "-")
    return f"{config.label}: {key}"


def wait_for_main(host: str, port: int, *, timeout: float, interval: float = 0.25) -> None:
    """Before a non-main machine launches: the main process must be reachable, else one clear error instead of a
    silent wait. The main machine may start later, so keep trying until `timeout`, every `interval` seconds: a refused
    connection costs nothing, and the main machine's ranks wait at the rendezvous for as long as this one is late."""
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


@contextlib.contextmanager
def preemption_answered_until_launch() -> Iterator[None]:
    """In the launcher, until torchrun's agent takes SIGTERM and SIGUSR1 over (it installs its own handlers before it
    starts the ranks: torch/distributed/elastic/multiprocessing/api.py, PContext.start; torch 2.13.0): a preemption
    signal during the checks before a launch ends the command there with PREEMPTED and the line a preemption during
    training gives, unwinding (what was half-written is removed), instead of the signal's default action (status 143
    or 138, which a requeueing script does not take for a preemption: the job would be lost). The handlers before
    are put back on the way out where they are still ours."""

    def on_signal(signum, frame) -> None:
        sys.exit(_preempted(signal.Signals(signum).name, None))

    previous = {sig: signal.signal(sig, on_signal) for sig in PREEMPTION_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if signal.getsignal(sig) is on_signal:
                signal.signal(sig, handler)


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
    print(f"preempted ({name or 'a preemption signal'}){where}. Continue with the same command and --resume auto.",
          file=sys.stderr)
    return PREEMPTED


def _interrupted(name: str) -> int:
    # --resume auto, as after a preemption: an interruption before the first checkpoint leaves nothing that --resume
    # could continue (it refuses), and auto then starts the run again.
    print(f"interrupted ({name}): the ranks were stopped. Continue with the same command and --resume auto (from the "
          "newest complete checkpoint, if any).", file=sys.stderr)
    return 128 + getattr(signal, name.split()[0], signal.SIGINT).value


def _is_timeout(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    return "timeout" in text or "timed out" in text


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def _status(code: int) -> int:
    return 2 if code == 2 else (1 if code else 0)
