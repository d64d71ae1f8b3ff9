"""Conversations encoded in worker processes (data/encoder_pool.py): the same ids and loss masks, byte for byte, as the
encoder in this process, for chat, instruction and preference rows on every tokenizer of tests/test_chat_masks.py
(non-ASCII text; GPT-2's trimmed offsets and the word-level tokenizer take the offsets path); batches come back in
order; a worker imports neither torch nor transformers; a worker that dies ends `data prepare` with one message and
no half-written cache; Ctrl-C still ends it with one line and exit status 130."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, write_jsonl
from test_chat_masks import conversation, named_tokenizer, text, tokenizers  # noqa: F401 - the fixture

from accel_fsdp.config.recipe import recipe_from_text
from accel_fsdp.data import encoder_pool, tokenize
from accel_fsdp.data.encoder_pool import EncoderPool, read_message, unpack, worker_command, write_message
from accel_fsdp.data.sources import SourceReader
from accel_fsdp.data.tokenize import ChatJob, ExampleTokenizer


def rows_of(fmt: str, rng: random.Random, count: int) -> list[dict]:
    """Rows of a format, their texts drawn from test_chat_masks's words (accents, CJK, an emoji, a decomposed é)."""
    out = []
    for k in range(count):
        if fmt == "chat":
            messages = conversation(rng)
            while not any(m["role"] == "assistant" for m in messages):
                messages = conversation(rng)
            out.append({"messages": messages})
        elif fmt == "instruction":
            out.append({"instruction": text(rng) + "?", "input": text(rng) if k % 2 else "", "output": text(rng) + "."})
        elif k % 2:
            shared = [{"role": "user", "content": text(rng) + "?"}]
            out.append({"chosen": shared + [{"role": "assistant", "content": text(rng) + " yes"}],
                        "rejected": shared + [{"role": "assistant", "content": text(rng) + " no"}]})
        else:
            out.append({"prompt": text(rng) + "?", "chosen": text(rng) + " yes", "rejected": text(rng) + " no"})
    return out


def example_tokenizer(tok, fmt: str) -> ExampleTokenizer:
    r = recipe_from_text(f"model: {{architecture: gpt2, tokenizer: 'builtin:quickstart'}}\n"
                         f"data: {{path: 'builtin:quickstart', format: {fmt}}}\n"
                         f"training: {{method: {'dpo' if fmt == 'preference' else 'sft'}}}\n", source="r.yaml")
    source = r.data.resolved_sources()[0]
    return ExampleTokenizer(tok, source, SourceReader(r, source, 0))


def as_bytes(examples_) -> list[tuple]:
    return [(ex.row, ex.ids.dtype.str, ex.ids.tobytes(), ex.mask.dtype.str, ex.mask.tobytes()) for ex in examples_]


def test_the_workers_encode_byte_for_byte_as_this_process(named_tokenizer):
    name, tok = named_tokenizer
    rng = random.Random(5)
    jobs = []
    for fmt in ("chat", "instruction", "preference"):
        split = example_tokenizer(tok, fmt)
        for start in (1, 41):
            rows = rows_of(fmt, rng, 40)
            job = split.check_and_render(list(range(start, start + 40)), rows)
            assert isinstance(job, ChatJob) and not split.reader.problems, (fmt, split.reader.problems)
            jobs.append(job)
    pool = EncoderPool(jobs[0].encoder, 2)
    try:
        tickets = [pool.submit(job.method, job.args) for job in jobs]  # more batches than workers: taken in turn
        pooled = [job.finish(ticket.result()) for job, ticket in zip(jobs, tickets)]
    finally:
        pool.close()
    assert [as_bytes(got) for got in pooled] == [as_bytes(job()) for job in jobs]
    assert sum(int(ex.mask.sum()) for got in pooled for ex in got) > 0


def test_special_tokens_read_as_text_are_read_so_in_the_workers_too():
    """`encode_special_tokens` is not in the tokenizer's definition (`to_str`): it travels beside it."""
    tok = tokenizers()["byte-level BPE, the BPE template"]()
    tok.backend_tokenizer.encode_special_tokens = True
    job = example_tokenizer(tok, "chat").check_and_render(list(range(1, 31)), rows_of("chat", random.Random(8), 30))
    pool = EncoderPool(job.encoder, 1)
    try:
        pooled = job.finish(pool.submit(job.method, job.args).result())
    finally:
        pool.close()
    assert as_bytes(pooled) == as_bytes(job())


def test_a_stream_uses_the_workers_from_its_second_batch_and_keeps_the_order(monkeypatch):
    tok = tokenizers()["ChatML, NFC (Qwen style)"]()
    submitted = []

    class CountingPool(EncoderPool):
        def submit(self, method, args):
            submitted.append(method)
            return super().submit(method, args)

    monkeypatch.setattr(tokenize, "EncoderPool", CountingPool)
    rng = random.Random(6)
    batches = [(list(range(1 + 30 * b, 31 + 30 * b)), rows_of("chat", rng, 30)) for b in range(6)]
    split = example_tokenizer(tok, "chat")
    streamed = list(split.stream(batches, processes=2))
    here = [split(numbers, rows) for numbers, rows in batches]
    assert [numbers for numbers, _, _ in streamed] == [numbers for numbers, _ in batches]
    assert [as_bytes(got) for _, _, got in streamed] == [as_bytes(got) for got in here]
    assert submitted == ["__call__"] * 5  # the first batch on the thread while the workers start
    assert list(example_tokenizer(tok, "chat").stream(batches[:1], processes=2))  # one batch: no worker
    assert len(submitted) == 5


def test_a_worker_imports_neither_torch_nor_transformers():
    tok = tokenizers()["Llama-3 style"]()
    job = example_tokenizer(tok, "chat").check_and_render([1], rows_of("chat", random.Random(7), 1))
    argv, folder, env = worker_command()
    argv = argv[:-1] + [argv[-1] + "\nimport sys\nsys.stderr.write(' '.join(sorted(sys.modules)))"]
    worker = subprocess.Popen(argv, cwd=folder, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    write_message(worker.stdin, job.encoder.portable())
    write_message(worker.stdin, (job.method, job.args))
    status, packed = read_message(worker.stdout)
    worker.stdin.close()
    modules = worker.stderr.read().decode().split()
    assert worker.wait(timeout=60) == 0
    assert status == "ok" and as_bytes(job.finish(unpack(packed))) == as_bytes(job())
    assert "accel_fsdp.data.encoder" in modules and "tokenizers" in modules
    assert [m for m in modules if m.split(".")[0] in ("torch", "transformers", "accelerate", "datasets", "click")] == []


# ------------------------------------------------------------------------------------- through the CLI


def chat_corpus(tmp_path: Path) -> Path:
    from accel_fsdp.data.synthetic import story

    rng = random.Random(0)
    rows = []
    for _ in range(40_000):
        prompt, answer = story(rng)[0], story(rng)[0]
        rows.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]})
    return write_jsonl(tmp_path / "chat.jsonl", rows)


def start_prepare(tmp_path: Path, cache: Path) -> subprocess.Popen:
    """`data prepare` of a chat corpus in a session of its own (a terminal's Ctrl-C reaches its whole group)."""
    return subprocess.Popen([sys.executable, "-m", "accel_fsdp", "data", "prepare", "quickstart", "--set",
                             f"data.path={chat_corpus(tmp_path)}", "--set", "data.format=chat", "--set",
                             "data.num_proc=2"], cwd=REPO, env=dict(os.environ, ACCEL_FSDP_CACHE=str(cache)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def workers_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        try:
            if (entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid
                    and encoder_pool.WORKER_CODE.encode() in (entry / "cmdline").read_bytes()):
                out.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return out


def wait_for_workers(proc: subprocess.Popen) -> list[int]:
    deadline = time.monotonic() + 240
    while not workers_of(proc.pid):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    return workers_of(proc.pid)


def no_entry(cache: Path) -> list[str]:
    return [p.name for p in (cache / "tokenized").iterdir() if not p.name.endswith(".lock")]


@pytest.mark.slow
def test_a_worker_that_dies_ends_data_prepare_with_one_message_and_no_half_written_cache(tmp_path):
    cache = tmp_path / "cache"
    proc = start_prepare(tmp_path, cache)
    os.kill(wait_for_workers(proc)[0], signal.SIGKILL)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("    fix: "), err
    assert "an encoder process (pid" in lines[0] and "was killed by SIGKILL" in lines[0], err
    assert "nothing of this source was kept in the cache" in lines[0] and "data.num_proc: 1" in lines[1]
    assert no_entry(cache) == []


@pytest.mark.slow
def test_ctrl_c_with_workers_exits_130_with_one_line_and_leaves_no_worker_and_no_cache(tmp_path):
    cache = tmp_path / "cache"
    proc = start_prepare(tmp_path, cache)
    workers = wait_for_workers(proc)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 130, (out, err)
    assert err.strip().splitlines() == ["data prepare: interrupted (Ctrl-C); the cache holds no half-written data"]
    assert no_entry(cache) == []
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()
                and "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:1]]
