"""How a rank's life ends: with its launcher, on a preemption signal after a checkpoint, or early, with one message.

Ranks die with their launcher. `accelerate launch` (torchrun underneath) starts every rank in a session of its own
(torch/distributed/elastic/multiprocessing/subprocess_handler, `start_new_session=True`, checked with torch 2.13.0),
so a SIGKILL of the launcher (a CI cancel, `timeout -s KILL`, the OOM killer) would leave the ranks training. Each
rank asks the kernel for SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG on Linux; a watchdog thread
elsewhere). A checkpoint is written under a temporary name and renamed last, so a rank killed mid-save leaves no
half checkpoint.

Preemption: SIGTERM or SIGUSR1 (SLURM's warning signal) to a rank or to the launcher asks the run to stop: every rank
finishes the optimizer step the signal arrived in, the run writes a checkpoint of that step, and the processes exit
with PREEMPTED (75, EX_TEMPFAIL: "resumable"). The ranks agree on that step through one all-reduce of a 4-byte CPU
flag after each optimizer step (gloo: it waits for the other ranks' hosts, never for a GPU). The launcher forwards
the signal to the ranks and waits for them (PET_SHUTDOWN_TIMEOUT), instead of torchrun's 30 seconds before SIGKILL.

An early end: a rank that stops for a reason of its own (a user's mistake only it found, a collective that waited
past `fsdp.collective_timeout_minutes`, a bug) while the others are in, or on their way to, a collective. It writes
a `RankRecord` (why, and what it was doing) into the launch's record folder before it exits. The others then end
quietly with PEER_FAILED: their collective fails because a peer left (gloo: "Connection reset by peer"), or
torchrun's agent, which stops the remaining ranks with SIGTERM once one failed (SimpleElasticAgent._invoke_run ->
_stop_workers; torch 2.13.0), finds a record there and so is not taken for a preemption. Our launcher reads the
records and says what happened once: the user's message (exit 2), or which rank stopped making progress and where
the others waited for it. Under a stock `accelerate launch` (no record folder) each rank says it itself, once per
message across the job (a counter in the process group's store).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import signal
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from accel_fsdp.errors import OUT_OF_SPACE, Problem, UserError, allocation_figures, out_of_memory, path_problem
from accel_fsdp.files import write_atomic
from accel_fsdp.quiet import outlive_closed_output

PREEMPTED = 75
"""Exit status of a run stopped by a preemption signal after writing its checkpoint: resume it."""
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
SHUTDOWN_GRACE_S = 900
"""How long the launcher waits for its ranks to checkpoint after a preemption signal before killing them."""
INTERRUPTED = 130
"""Exit status of a process Ctrl-C (SIGINT) stopped: 128 + SIGINT, as a shell reports it."""
PEER_FAILED = 3
"""Exit status of a rank that stopped because another rank failed first: it says nothing, the other rank's record
(or its own output) says why."""
RANK_RECORDS_ENV = "ACCEL_FSDP_RANK_RECORDS"
"""The folder where a rank that ends early writes its `RankRecord`: made by our launcher for one launch."""


DIE_WITH_PARENT_ENV = "ACCEL_FSDP_DIE_WITH_PARENT"
"""Set by a command for the `accel-fsdp recipe run` it starts (verify's probes, bench's runs), to the command's PID:
that launcher dies with the command (`die_with_launcher`: SIGKILL included), and its ranks with it. Else a verify
killed and run again would share its probes' folders with the orphaned probes of the first, still training into
them."""
LAUNCHER_PID_ENV = "ACCEL_FSDP_LAUNCHER_PID"
"""Set by our launcher for its ranks: its PID, the parent each rank must find (`die_with_launcher`)."""


def tied_to_this_process(env: dict[str, str]) -> dict[str, str]:
    """The environment of a child `accel-fsdp recipe run` that must not outlive this process."""
    return {**env, DIE_WITH_PARENT_ENV: str(os.getpid())}


def die_with_launcher(parent_env: str = LAUNCHER_PID_ENV) -> None:
    """In a rank (or a launcher a command started): be killed when the process that started this one dies. The PID
    that process gave in `parent_env` is the parent this one must have: a parent killed while this process was still
    starting (its imports take seconds) left it to init, where the kernel's parent-death signal would never come and it
    would train on alone. Without the variable (a stock launcher's rank), the parent it has now."""
    given = os.environ.get(parent_env, "")
    parent = int(given) if given.isdigit() else os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            PR_SET_PDEATHSIG = 1
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except OSError:  # pragma: no cover - no libc.so.6 (musl): the watchdog below still works
            _watchdog(parent)
            return
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)
        return
    _watchdog(parent)  # pragma: no cover - not Linux


def _watchdog(parent: int) -> None:
    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)
            threading.Event().wait(1.0)

    threading.Thread(target=watch, name="accel-fsdp-parent-watchdog", daemon=True).start()


def launcher_environment(env: dict) -> dict:
    """What the launcher (torchrun's agent) needs so a preemption signal reaches the ranks and they get time to
    checkpoint: SIGUSR1 handled like SIGTERM (forwarded to the ranks), and a long grace before SIGKILL. torchrun
    reads both as options whose defaults come from PET_* variables (torch/distributed/run.py, --signals-to-handle
    and --shutdown-timeout with action=env; it then overwrites TORCHELASTIC_SIGNALS_TO_HANDLE itself, in
    torch/distributed/launcher/api.py; checked with torch 2.13.0)."""
    out = {}
    handled = env.get("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    if "SIGUSR1" not in handled:
        out["PET_SIGNALS_TO_HANDLE"] = handled + ",SIGUSR1"
    if "PET_SHUTDOWN_TIMEOUT" not in env and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in env:
        out["PET_SHUTDOWN_TIMEOUT"] = str(SHUTDOWN_GRACE_S)
    return out


def flag_needs_own_group(backend_config: str) -> bool:
    """The default group cannot all-reduce a CPU tensor (no CPU backend in `torch.distributed.get_backend_config()`,
    e.g. "cuda:nccl" from a launch we did not configure): the flag then needs a gloo group of its own."""
    return "cpu:" not in backend_config


class Preemption:
    """A rank's view of preemption: the signal handlers, and the agreement of all ranks on when to stop."""

    def __init__(self, records: RankRecords | None = None):
        self.signal_name: str | None = None
        self._group = None
        self._flag = None
        self._records = records if records is not None else RankRecords.from_env()

    def install(self) -> Preemption:
        for sig in PREEMPTION_SIGNALS:
            signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGTERM and stopped_by_launcher(self._records):
            return  # not reached: the rank has ended
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            print(f"[rank {os.environ.get('RANK', '?')}] {self.signal_name}: stopping after this optimizer step "
                  "with a checkpoint", file=sys.stderr, flush=True)

    def join_group(self, timeout=None) -> None:
        """Collective (every rank): where the flag is all-reduced. The default process group when it has a CPU
        backend, as ours always does (gloo on CPU ranks; cuda:nccl,cpu:gloo on GPUs, train/accelerator.py): a
        4-byte CPU all-reduce there is lost in the step, where a gloo group of its own (its own threads and
        sockets) measured 4-5% of a tiny model's step on 2 CPU ranks. Else a gloo group of its own, with the
        run's collective `timeout` (new_group's default is torch's 30 minutes)."""
        import torch
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            own = flag_needs_own_group(dist.get_backend_config())
            self._group = dist.new_group(backend="gloo", timeout=timeout) if own else dist.group.WORLD
            self._flag = torch.zeros(1, dtype=torch.int32)

    def agreed(self) -> bool:
        """Called by every rank after every optimizer step: True on every rank after the step in which any rank got
        the signal. Blocking, so that step is the one every rank stops after: a non-blocking all-reduce read one
        step later (as this was before) stopped the run one optimizer step after the signal. It is a CPU tensor on
        the CPU backend: it waits for the other ranks' hosts to finish queueing this step, not for their GPUs, and
        the ranks meet in the step's own collectives anyway."""
        import torch.distributed as dist

        if self._group is None:
            return self.signal_name is not None
        self._flag.fill_(signal.Signals[self.signal_name].value if self.signal_name else 0)
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group)
        stop = bool(self._flag.item())
        if stop and self.signal_name is None:  # another rank got it: the flag carries its number
            self.signal_name = f"{signal.Signals(int(self._flag.item())).name} to another rank"
        return stop


class Preempted(Exception):
    """Raised after the preemption checkpoint is written; the rank exits with PREEMPTED."""

    def __init__(self, step: int, checkpoint, signal_name: str):
        super().__init__(f"preempted by {signal_name} at step {step}")
        self.step, self.checkpoint, self.signal_name = step, checkpoint, signal_name


# ------------------------------------------------------------------------------------------------ an early end

USER_ERROR, TIMED_OUT, STOPPED, CRASHED = "user-error", "timed-out", "stopped", "crashed"
"""Why a rank ended early: a user's mistake (exit 2), a collective that waited past the timeout, stopped because
another rank failed (PEER_FAILED), or a bug of ours (its traceback is in the rank's output)."""
INTERRUPTED_BY_USER = "interrupted"
"""A rank's record of a Ctrl-C (SIGINT): its exit status (130) says it to the launcher; the record tells the other
ranks that the SIGTERM torchrun then sends them is not a preemption."""


@dataclass(frozen=True)
class RankRecord:
    """Why one rank ended early, written where the launcher reads it."""

    rank: int
    why: str
    """USER_ERROR, TIMED_OUT, STOPPED, CRASHED or INTERRUPTED_BY_USER."""
    doing: str
    """What the rank was doing (or waiting in) when it ended."""
    message: str = ""
    """What the user is shown (a UserError's message; a timeout's, with the minutes waited)."""
    waited_minutes: float | None = None
    """TIMED_OUT: the collective timeout it waited."""


class RankRecords:
    """The launch's record folder (RANK_RECORDS_ENV), or none under a launcher that is not ours."""

    def __init__(self, folder: Path | None):
        self.folder = folder

    @classmethod
    def from_env(cls, env=None) -> RankRecords:
        folder = (os.environ if env is None else env).get(RANK_RECORDS_ENV)
        return cls(Path(folder) if folder else None)

    @property
    def active(self) -> bool:
        """Our launcher reads them (and says what they hold)."""
        return self.folder is not None

    def write(self, record: RankRecord) -> bool:
        """False when it could not be written: the rank then says its message itself."""
        if self.folder is None:
            return False
        try:
            write_atomic(self.folder / f"rank-{record.rank}.json", json.dumps(asdict(record)))
            return True
        except OSError:
            return False

    def read(self) -> dict[int, RankRecord]:
        out = {}
        for path in sorted(self.folder.glob("rank-*.json")) if self.folder is not None else ():
            try:
                record = RankRecord(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError):
                continue
            out[record.rank] = record
        return out

    def another_rank_failed(self, rank: int) -> bool:
        return self.folder is not None and any(p.name != f"rank-{rank}.json" for p in self.folder.glob("rank-*.json"))


class Whereabouts:
    """What this rank is doing now, named for a message if it has to end there: set by setup, the loop and the
    checkpointer as they go (an assignment: no communication), read when the rank ends early."""

    doing = "starting (before the process group)"
    timeout_minutes: float | None = None
    """The collective timeout of this run's process groups (fsdp.collective_timeout_minutes)."""
    folders: tuple = ()
    """Where the run writes (its folder, its checkpoints'): their free space names the full one, for a write that
    named no file."""


WHEREABOUTS = Whereabouts()


def doing(what: str) -> None:
    """This rank is now in `what` ("optimizer step 7 (forward, backward, gradient reduction)")."""
    WHEREABOUTS.doing = what


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def collective_failure(error: BaseException) -> str | None:
    """TIMED_OUT or STOPPED (a peer left) for an error a collective raised, in gloo's and NCCL's words (gloo/transport/
    tcp/pair.cc and unbound_buffer.cc; ProcessGroupNCCL; torch 2.13.0), else None (not a collective's failure)."""
    if not isinstance(error, RuntimeError):  # torch.distributed.DistError is a RuntimeError
        return None
    text = str(error).lower()
    if "timed out waiting" in text or ("timeout" in text and type(error).__name__.startswith("Dist")):
        return TIMED_OUT
    if any(words in text for words in ("reset by peer", "closed by peer", "broken pipe", "communicator was aborted",
                                       "remote process exited")):
        return STOPPED
    return None


def timeout_message(doing_now: str, minutes: float | None) -> str:
    """A rank's own account of a timeout (under a stock launcher; ours names the rank that stopped, too)."""
    waited = f"{minutes:g} min (fsdp.collective_timeout_minutes)" if minutes else "the collective timeout"
    return str(Problem(f"rank {rank()}", f"waited {waited} in {doing_now} for a rank that did not arrive",
                       TIMEOUT_FIX))


TIMEOUT_FIX = ("a rank stopped making progress: its output above may say why (a stuck filesystem or data source, a "
               "deadlock, a GPU error); if it is only slow there (a large dataset built on one rank, a long save), "
               "raise fsdp.collective_timeout_minutes")


def leave(status: int) -> None:
    """End a rank: destroy the process group, flush, and exit without interpreter finalization, where gloo's
    worker threads can still hold tensors and abort the process (SIGABRT, "terminate called without an active
    exception"; see pytorch/pytorch#179291) after the work is done and saved."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and status in (0, PREEMPTED):
        dist.destroy_process_group()  # its barrier would wait for the ranks that left
    if status not in (0, PREEMPTED) and "tqdm" in sys.modules:  # a progress bar ended mid-line: end the line
        for bar in list(getattr(sys.modules["tqdm"].tqdm, "_instances", ())):
            try:
                bar.close()
            except (OSError, RuntimeError, ValueError):
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, RuntimeError, ValueError):  # in a signal handler: a write the handler interrupted
            pass
    os._exit(status)


def first_to_say(message: str) -> bool | None:
    """Whether this rank is the first of the job to report `message` (a counter in the process group's store, which
    every rank reaches, on every machine); before the process group exists, the first of this machine's ranks (a
    file claimed in the temporary folder, named by the launcher's process): local rank 0 alone would often be
    stopped by the launcher before it says it, once a faster rank has ended. None when neither can be asked."""
    import torch.distributed as dist

    digest = hashlib.sha1(message.encode()).hexdigest()[:16]
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return _first_on_this_machine(digest)
        store = dist.distributed_c10d._get_default_store()
        return store.add("accel_fsdp/said/" + digest, 1) == 1
    except Exception:  # noqa: BLE001 - a store gone with its host: say it anyway
        return None


def _first_on_this_machine(digest: str) -> bool | None:
    """Claim `accel-fsdp-said-<launcher pid>-<digest>` in the temporary folder; one older than a minute is another
    launch's whose launcher had the same process id, and is claimed anew. The rank that claims sweeps the claims of
    launches that ended more than a minute ago (`_sweep_old_claims`), so the folder does not fill with them."""
    import tempfile
    import time

    if "LOCAL_RANK" not in os.environ:
        return None
    claim = Path(tempfile.gettempdir()) / f"accel-fsdp-said-{os.getppid()}-{digest}"
    for _ in range(2):
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            _sweep_old_claims(claim.parent, time.time() - CLAIM_SECONDS)
            return True
        except FileExistsError:
            try:
                if time.time() - claim.stat().st_mtime < CLAIM_SECONDS:
                    return False
                claim.unlink()
            except OSError:
                return False
        except OSError:
            return None
    return False


CLAIM_SECONDS = 60
"""How long a claim to have said a message holds: the ranks of one launch find one another's within it."""


def _sweep_old_claims(folder: Path, before: float) -> None:
    """Remove the `accel-fsdp-said-*` claims last written before `before` (launches long over); a claim another
    process removes first, or one of another user's, is left to it."""
    for old in folder.glob("accel-fsdp-said-*"):
        try:
            if old.stat().st_mtime < before:
                old.unlink()
        except OSError:
            pass


def end_with_user_error(error: UserError, records: RankRecords) -> None:
    """A user's mistake found by this rank (alone, or like every rank): recorded for our launcher, which says each
    message once; else said here, once per message across the job."""
    message = error.format_message()
    if not records.write(RankRecord(rank(), USER_ERROR, WHEREABOUTS.doing, message)):
        first = first_to_say(message)
        if first or (first is None and (int(os.environ.get("LOCAL_RANK", "0")) == 0 or error.rank_local)):
            error.show()
    leave(error.exit_code)


def end_after_collective_failure(why: str, error: BaseException, records: RankRecords) -> None:
    """A collective this rank was in failed: a peer left (quietly: it, or the launcher, says why), or the timeout
    passed (the launcher, or this rank, names where it waited)."""
    here = WHEREABOUTS.doing
    if why == STOPPED:
        if not records.write(RankRecord(rank(), STOPPED, here)):
            print(f"[rank {rank()}] stopped in {here}: another rank left (its output says why)", file=sys.stderr)
        leave(PEER_FAILED)
    message = timeout_message(here, WHEREABOUTS.timeout_minutes)
    if not records.write(RankRecord(rank(), TIMED_OUT, here, message, WHEREABOUTS.timeout_minutes)):
        if first_to_say(message) is not False:
            UserError(message).show()
    leave(1)


def stopped_by_launcher(records: RankRecords) -> bool:
    """In the SIGTERM handler: another rank ended early, so this SIGTERM is torchrun's agent stopping the rest, not a
    preemption. Recorded (with where this rank was, which names a rank that hung) before it ends quietly."""
    if not records.another_rank_failed(rank()):
        return False
    records.write(RankRecord(rank(), STOPPED, WHEREABOUTS.doing))
    leave(PEER_FAILED)
    return True


OUT_OF_MEMORY_FIX = {
    "GPU": ("lower training.micro_batch_size (the global batch stays: more accumulation steps), turn on "
            "model.activation_checkpointing or training.activation_offload, or offload to the CPU (fsdp.cpu_offload); "
            "`accel-fsdp recipe run <recipe> --dry-run --gpu-memory <size>` shows what fits"),
    "host": ("lower training.micro_batch_size, let rank 0 alone read the weights (fsdp_cpu_ram_efficient_loading: "
             "true in the accelerate config), turn CPU offload off (fsdp.cpu_offload: false), or run fewer ranks on "
             "this machine"),
}
"""What to change when a rank runs out of memory: the knobs that lower its peak, cheapest first. On the host, CPU
offload is a cost, not a cure."""


def free_space(error: BaseException) -> str:
    """For a full disk that a write named no file of: the free space where the run writes."""
    import shutil

    if not isinstance(error, OSError) or error.filename or error.errno not in OUT_OF_SPACE:
        return ""
    free = []
    for folder in WHEREABOUTS.folders:
        try:
            free.append(f"{folder} {shutil.disk_usage(folder).free / 2**20:,.1f} MiB")
        except OSError:
            continue
    return f"; free space: {', '.join(free)}" if free else ""


RESUME_AFTER = "; then run the same command with --resume auto (it goes on from the newest checkpoint)"
"""After a rank's path error: the run's checkpoints are written whole or not at all, so the newest is intact."""


def out_of_memory_error(kind: str, error: BaseException, doing: str) -> UserError:
    """A rank out of memory, as the one message the user sees (exit status 2: the recipe asks for more memory than
    the machine has), with torch's own figures (what it tried to allocate, what was free)."""
    return UserError(Problem(f"rank {rank()}", f"out of {kind} memory in {doing} ({allocation_figures(error)})",
                             OUT_OF_MEMORY_FIX[kind]))


def run_rank(train) -> None:
    """Run this rank's training (`train()`), then end the process with the status that says how it went: 0, 2 (a
    user's mistake), PREEMPTED, 130 (Ctrl-C), PEER_FAILED, 1 (a collective timed out). A bug of ours keeps its
    traceback (and is recorded, so the other ranks end quietly)."""
    records = RankRecords.from_env()
    outlive_closed_output()  # `recipe run ... | head`: the run goes on, its lines into /dev/null
    try:
        train()
    except UserError as e:
        end_with_user_error(e, records)
    except Preempted as p:
        if rank() == 0 and not records.active:  # else our launcher says it
            print(f"preempted ({p.signal_name}) after step {p.step}: checkpoint {p.checkpoint}; continue with the same "
                  "command and --resume (or --resume auto)", file=sys.stderr)
        leave(PREEMPTED)
    except KeyboardInterrupt:  # Ctrl-C; the launcher says what to do next
        # Recorded first: a SIGINT to this rank alone (`kill -INT`) makes torchrun SIGTERM the others, which must
        # not take it for a preemption (a line "stopping after this optimizer step" above the launcher's one).
        records.write(RankRecord(rank(), INTERRUPTED_BY_USER, WHEREABOUTS.doing))
        leave(INTERRUPTED)
    except Exception as e:
        kind = out_of_memory(e)
        if kind is not None:
            end_with_user_error(out_of_memory_error(kind, e, WHEREABOUTS.doing), records)
        problem = path_problem(e, f"rank {rank()}, in {WHEREABOUTS.doing}{free_space(e)}")
        if problem is not None:  # a full disk, a folder made read-only: the user's, wherever the rank was writing
            end_with_user_error(UserError(Problem(problem.where, problem.message, problem.fix + RESUME_AFTER)),
                                records)
        why = collective_failure(e)
        if why is not None:
            end_after_collective_failure(why, e, records)
        records.write(RankRecord(rank(), CRASHED, WHEREABOUTS.doing))
        raise
    leave(0)
