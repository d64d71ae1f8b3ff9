"""Conversations encoded in worker processes: the chat encoder (encoder.py `ChatEncoder`) run on rendered batches in
a few processes of its own, while this process reads, checks and renders the next batches (tokenize.py `stream`).

Why processes: the Rust encoder is about three quarters of the work of chat, instruction and preference data, and
the rest (reading JSON, checks, the chat template, turning ids into arrays and masks) is Python under one GIL. In one
process, that Python leaves a core idle while the encoder's threads wait for it; a second thread gains nothing (the
GIL). Here each worker encodes a whole batch single-threaded (its Rust thread pool set to one thread), ids and masks
included, and sends back three arrays; the workers and this process's Python keep the cores busy.

A worker is a fresh interpreter (`subprocess`, never a fork: `prepare_data` also runs inside a rank that may hold
gloo and torch threads), started with `python -c` in the package's folder so that it imports this module and
encoder.py alone: numpy and tokenizers, never torch or transformers (tests/test_encoder_pool.py holds it). It builds
its encoder from the Rust tokenizer's definition (`ChatEncoder.portable`), so the ids and masks are those of the
encoder in this process (held byte for byte by the same test). Messages are pickles with a length before them, on the
worker's stdin and stdout; a worker holds one batch at a time and this process sends it the next only after taking
its result, so neither side waits on a full pipe. Results come back in the order the batches went out.

A worker ignores Ctrl-C (this process handles it, and stops the workers on its way out); a worker that ends on its own
(killed, out of memory) raises `EncoderProcessFailed` here at the batch it held. This module never writes a file.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np

from accel_fsdp.data.encoder import ChatEncoder

WORKER_CODE = "from accel_fsdp.data.encoder_pool import serve; serve()"
"""What a worker runs (`python -c`), in the folder that holds the package."""
WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}
"""A worker's Rust encoder on one thread: the workers are the parallelism."""
_LENGTH = struct.Struct("<Q")


class EncoderProcessFailed(RuntimeError):
    """A worker ended without answering (killed, out of memory). data/build.py names the source."""


def worker_command() -> tuple[list[str], Path, dict]:
    """(argv, working folder, environment) of a worker process."""
    return ([sys.executable, "-c", WORKER_CODE], Path(__file__).resolve().parents[2],
            dict(os.environ, **WORKER_ENV))


def write_message(stream, value) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(data)))
    stream.write(data)
    stream.flush()


def read_message(stream):
    """The next message, or EOFError when the other side has closed (or died) before a whole one."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        raise EOFError
    size = _LENGTH.unpack(head)[0]
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


def pack(examples: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, mask) of each example as three arrays: their lengths, the ids end to end, the masks end to end."""
    lengths = np.fromiter((len(ids) for ids, _ in examples), dtype=np.int64, count=len(examples))
    if not examples:
        return lengths, np.zeros(0, np.int64), np.zeros(0, bool)
    return (lengths, np.concatenate([ids for ids, _ in examples]).astype(np.int64, copy=False),
            np.concatenate([mask for _, mask in examples]).astype(bool, copy=False))


def unpack(packed: tuple[np.ndarray, np.ndarray, np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    lengths, ids, mask = packed
    ends = np.cumsum(lengths).tolist()
    return [(ids[end - size:end], mask[end - size:end]) for size, end in zip(lengths.tolist(), ends)]


def serve() -> None:
    """A worker: its encoder from the first message, then (method, args) -> the packed result of
    `getattr(encoder, method)(*args)` (`("ok", arrays)`, or `("error", traceback)` for an exception) until stdin
    ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent handles it
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing printed may land among the messages
    try:
        encoder = ChatEncoder.from_portable(read_message(source))
        while True:
            method, args = read_message(source)
            try:
                answer = ("ok", pack(getattr(encoder, method)(*args)))
            except Exception:  # noqa: BLE001 - a bug of ours: its traceback goes to the parent, which raises it
                answer = ("error", traceback.format_exc())
            write_message(sink, answer)
    except (EOFError, BrokenPipeError):  # the parent closed our stdin (done), or is gone
        return


class _Worker:
    def __init__(self, state: dict):
        argv, folder, env = worker_command()
        self.errors = tempfile.TemporaryFile()  # what the interpreter says if it fails: read only then
        self.process = subprocess.Popen(argv, cwd=folder, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.errors)
        self.busy: _Ticket | None = None
        self._send(state)

    def _send(self, value) -> None:
        try:
            write_message(self.process.stdin, value)
        except (BrokenPipeError, OSError):
            raise self.failure() from None

    def submit(self, method: str, args: tuple) -> _Ticket:
        if self.busy is not None:  # take its result first: it cannot take a new batch while it writes one
            self.busy.result()
        self._send((method, args))
        self.busy = _Ticket(self)
        return self.busy

    def receive(self):
        try:
            status, value = read_message(self.process.stdout)
        except (EOFError, OSError):
            raise self.failure() from None
        self.busy = None
        if status == "error":
            raise RuntimeError(f"the chat encoder failed in its worker process:\n{value}")
        return unpack(value)

    def failure(self) -> EncoderProcessFailed:
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        how = ("did not answer" if code is None else
               f"was killed by {signal.Signals(-code).name}" if code < 0 else f"ended with status {code}")
        self.errors.seek(0)
        said = [line for line in self.errors.read().decode(errors="replace").splitlines() if line.strip()]
        return EncoderProcessFailed(f"an encoder process (pid {self.process.pid}) {how}"
                                    + (f": {said[-1].strip()[:200]}" if said else ""))

    def stop(self, *, now: bool) -> None:
        """Close its stdin (it ends after its batch) and wait; `now`: kill it first (an error or Ctrl-C here)."""
        if now and self.process.poll() is None:
            self.process.kill()
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:  # a pipe the dead worker left unflushed
                pass
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.errors.close()


class _Ticket:
    """A batch in a worker: `result()` waits for its (ids, mask) list."""

    def __init__(self, worker: _Worker):
        self.worker, self.done, self.value = worker, False, None

    def result(self) -> list[tuple[np.ndarray, np.ndarray]]:
        if not self.done:
            self.value, self.done = self.worker.receive(), True
        return self.value


class EncoderPool:
    """`processes` workers, each holding the chat encoder; batches go to them in turn. At most `processes` batches
    are in the workers at once: `submit` waits for a worker's previous batch before giving it the next."""

    def __init__(self, encoder: ChatEncoder, processes: int):
        state = encoder.portable()
        self.workers: list[_Worker] = []
        try:
            for _ in range(processes):
                self.workers.append(_Worker(state))
        except BaseException:
            self.close(now=True)
            raise
        self.turn = 0

    @property
    def size(self) -> int:
        return len(self.workers)

    def submit(self, method: str, args: tuple) -> _Ticket:
        """`getattr(encoder, method)(*args)` in the next worker; its ticket's `result()` is the (ids, mask) list."""
        worker = self.workers[self.turn]
        self.turn = (self.turn + 1) % len(self.workers)
        return worker.submit(method, args)

    def close(self, *, now: bool = False) -> None:
        for worker in self.workers:
            worker.stop(now=now)
        self.workers = []
