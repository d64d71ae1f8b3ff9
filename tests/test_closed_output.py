"""A run whose output's reader goes away (`recipe run ... | head`, a `| tee` that was killed) goes on, its lines into
/dev/null: a BrokenPipeError from a rank's progress line ended the run in the middle of a step."""

from __future__ import annotations

import io
import os

from accel_fsdp.quiet import _OutlivesItsReader


def test_writes_after_the_reader_is_gone_succeed_into_devnull():
    read_end, write_end = os.pipe()
    stream = io.TextIOWrapper(os.fdopen(write_end, "wb"), line_buffering=True)
    out = _OutlivesItsReader(stream)
    out.write("step 1/4: loss 4.5\n")
    assert os.read(read_end, 100) == b"step 1/4: loss 4.5\n"
    os.close(read_end)  # `head -1` has what it wanted
    try:
        out.write("step 2/4: loss 4.1\n")  # BrokenPipeError without the wrapper
        out.write("x" * 200_000)
        out.flush()
        print("done: 4 steps", file=out, flush=True)
        assert out.isatty() is False and out.fileno() == write_end  # the rest is the stream's own
    finally:
        stream.close()
