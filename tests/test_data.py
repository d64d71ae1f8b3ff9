"""Data: loss masks, packing, the tables on disk, the held-out split, and the order of the global batches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import write_jsonl

from accel_fsdp.config.recipe import recipe_from_text
from accel_fsdp.data.batches import collate, label_count
from accel_fsdp.data.prepare import prepare_data
from accel_fsdp.data.sampler import GlobalBatchSampler, Permutation, held_out
from accel_fsdp.data.sources import SourceReader
from accel_fsdp.data.store import IGNORE_INDEX, Sequence, TableWriter, TokenTable
from accel_fsdp.data.synthetic import build_tokenizer
from accel_fsdp.data.tokenize import ALPACA_PROMPT, ExampleTokenizer
from accel_fsdp.errors import UserError


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def recipe(fmt="text", path="builtin:quickstart", **data):
    extra = "".join(f"\n  {k}: {v}" for k, v in data.items())
    return recipe_from_text(f"""
model: {{architecture: gpt2, tokenizer: "builtin:quickstart"}}
data:
  path: "{path}"
  format: {fmt}{extra}
training: {{micro_batch_size: 2, global_batch_size: 4, max_steps: 3}}
""", source="r.yaml")


def tokenize(r, tok, row: dict) -> tuple[list[int], list[int]]:
    """(ids, labels) of one row, through the same code as a whole source."""
    source = r.data.resolved_sources()[0]
    reader = SourceReader(r, source, 0)
    (example,) = ExampleTokenizer(tok, source, reader)([1], [row])
    carries = np.ones(len(example.ids), bool) if example.mask is None else example.mask
    return example.ids.tolist(), np.where(carries, example.ids, IGNORE_INDEX).tolist()


# ------------------------------------------------------------------------------------------- loss masks


def test_text_labels_every_token(tok):
    ids, labels = tokenize(recipe(), tok, {"text": "alice has a red cat ."})
    assert ids == labels and ids[-1] == tok.eos_token_id
    assert ids == tok("alice has a red cat .")["input_ids"] + [tok.eos_token_id]  # the tokenizer's own ids


def test_instruction_masks_exactly_the_prompt(tok):
    r = recipe("instruction")
    row = {"instruction": "what color is the cat ?", "input": "alice has a red cat .", "output": "the cat is red ."}
    ids, labels = tokenize(r, tok, row)
    answer = tok("the cat is red .", add_special_tokens=False)["input_ids"]
    n_loss = sum(1 for x in labels if x != IGNORE_INDEX)
    assert n_loss == len(answer) + 1  # the answer and the end-of-turn token
    first = labels.index(next(x for x in labels if x != IGNORE_INDEX))
    assert all(x == IGNORE_INDEX for x in labels[:first])
    assert labels[first:first + len(answer)] == answer
    assert tok.decode(ids[:first]).endswith("<assistant>")


def test_instruction_without_chat_template_uses_the_alpaca_prompt(tiny_gpt2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_gpt2)
    tok.chat_template = None
    ids, labels = tokenize(recipe("instruction"), tok, {"instruction": "who has a cat ?", "input": "",
                                                        "output": "alice ."})
    prompt = tok(ALPACA_PROMPT.format(instruction="who has a cat ?"))["input_ids"]
    answer = tok("alice .", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ids == prompt + answer
    assert labels == [IGNORE_INDEX] * len(prompt) + answer


def test_chat_masks_everything_but_assistant_turns(tok):
    messages = [{"role": "system", "content": "you answer questions about stories ."},
                {"role": "user", "content": "alice has a red cat . who has a cat ?"},
                {"role": "assistant", "content": "alice has a red cat ."},
                {"role": "user", "content": "what color is the cat ?"},
                {"role": "assistant", "content": "the cat is red ."}]
    ids, labels = tokenize(recipe("chat"), tok, {"messages": messages})
    kept = [tok.convert_ids_to_tokens(i) for i, x in zip(ids, labels) if x != IGNORE_INDEX]
    assert " ".join(kept) == "alice has a red cat . <end> the cat is red . <end>"
    assert all(x in (IGNORE_INDEX, i) for i, x in zip(ids, labels))


# ------------------------------------------------------------------------------------ tables and packing


def test_padding_is_masked_and_isolated():
    x = IGNORE_INDEX  # sequences as the data gives them: each document's first token carries no label
    a = np.array
    sequences = [Sequence(a([5, 6, 7]), a([x, 6, 7]), a([0, 1, 2])), Sequence(a([5, 6, 7, 8, 9]), a([x, 6, 7, 8, 9]),
                                                                            a([0, 1, 2, 3, 4]))]
    batch = collate(sequences, pad_id=0, use_position_ids=True, multiple_of=8)
    assert batch["input_ids"].shape == (2, 8)
    assert batch["labels"][0, 3:].tolist() == [IGNORE_INDEX] * 5  # padding never carries a loss
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]  # padding is its own document
    assert label_count(batch["labels"]) == 2 + 4
    with_mask = collate(sequences, pad_id=0, use_position_ids=False, multiple_of=8)
    assert with_mask["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0, 0, 0], [1] * 5 + [0] * 3]


def write_table(folder, examples, *, packing, seq_len=16, masked=False):
    writer = TableWriter(folder, dtype=np.uint16, masked=masked, seq_len=seq_len, packing=packing)
    for batch in examples:
        writer.add([(np.asarray(ids), None if mask is None else np.asarray(mask, bool)) for ids, mask in batch])
    writer.close()
    return TokenTable(folder)


def test_stream_packing_keeps_every_token_restarts_positions_and_counts_labels(tmp_path):
    docs = [list(range(10, 10 + n)) for n in (7, 12, 3, 9, 1, 20)]
    # two batches of examples: a document cut by a sequence boundary that is also a batch boundary
    table = write_table(tmp_path / "t", [[(d, None) for d in docs[:3]], [(d, None) for d in docs[3:]]],
                        packing="stream")
    total = sum(map(len, docs))
    assert len(table) == -(-total // 16) and table.meta["tokens"] == total
    stream = [i for d in docs for i in d]
    starts = np.cumsum([0] + [len(d) for d in docs])[:-1]
    for k in range(len(table)):
        s = table.sequence(k)
        a = 16 * k
        assert s.ids.tolist() == stream[a:a + 16]  # every token, in order
        # positions restart at every document start and at the sequence's start (a cut document goes on anew)
        expected_pos = [0 if (a + i in starts or i == 0) else None for i in range(len(s))]
        for i, p in enumerate(expected_pos):
            if p is None:
                expected_pos[i] = expected_pos[i - 1] + 1
        assert s.positions.tolist() == expected_pos
        # no token is predicted across a document boundary: a position-0 token carries no label
        assert s.labels.tolist() == [IGNORE_INDEX if p == 0 else t for p, t in zip(expected_pos, s.ids.tolist())]
        assert int(table.labels[k]) == int((s.labels != IGNORE_INDEX).sum())


def test_bins_keep_examples_whole_and_masks_survive(tmp_path):
    examples = [([1, 2, 3, 4, 5], [0, 0, 1, 1, 1]), ([6, 7, 8], [0, 1, 1]), ([9, 10, 11, 12, 13, 14, 15, 16, 17],
                                                                          [0, 0, 0, 0, 1, 1, 1, 1, 1])]
    table = write_table(tmp_path / "t", [examples], packing="bins", seq_len=12, masked=True)
    seen = {}
    for k in range(len(table)):
        s = table.sequence(k)
        assert len(s) <= 12
        doc_starts = [i for i, p in enumerate(s.positions) if p == 0] + [len(s)]
        for a, b in zip(doc_starts, doc_starts[1:]):
            seen[tuple(s.ids[a:b].tolist())] = s.labels[a:b].tolist()
    for ids, mask in examples:
        assert seen[tuple(ids)] == [t if m and i else IGNORE_INDEX for i, (t, m) in enumerate(zip(ids, mask))]
    assert table.meta["label_tokens"] == sum(sum(m[1:]) for _, m in examples)


def test_builtin_packing_efficiency_is_reported_and_high(tok):
    data = prepare_data(recipe(seq_len=128), tok)
    (source,) = data.sources
    assert source.stats.packed and source.stats.packing_efficiency >= 0.99
    assert source.stats.train_tokens == int(source.train.lengths().sum())
    assert "packing efficiency" in data.stats.summary()
    again = prepare_data(recipe(seq_len=128), tok)
    assert again.sequence(5).ids.tolist() == data.sequence(5).ids.tolist()  # deterministic (and cached)
    assert len(source.eval) > 0 and data.stats.eval_rows == 1000  # exactly 5% of 20,000 held out


def test_the_cache_costs_at_most_five_bytes_a_token(tok):
    """uint16 ids for vocabularies up to 65,536; document and sequence starts instead of position ids; labels and
    masks derived when a batch is collated; mask bits only for masked formats."""
    for fmt, path in (("text", "builtin:quickstart"), ("instruction", "builtin:quickstart-instruct")):
        data = prepare_data(recipe(fmt, path, seq_len=128), tok)
        (source,) = data.sources
        assert source.train.tokens.dtype == np.uint16
        size = sum(p.stat().st_size for p in source.folder.rglob("*.bin"))
        tokens = source.train.meta["tokens"] + (source.eval.meta["tokens"] if source.eval else 0)
        assert size / tokens <= 5, (fmt, size / tokens)


def test_long_rows_are_truncated_and_counted_never_dropped(tmp_path, tok):
    path = write_jsonl(tmp_path / "long.jsonl", [{"instruction": "who ?", "output": "alice " * 40 + "."}] * 3
                       + [{"instruction": "who ?", "output": "bob ."}])
    data = prepare_data(recipe("instruction", str(path), seq_len=16, eval_fraction=0), tok)
    (source,) = data.sources
    assert source.stats.truncated == 3 and len(source.train) == 4
    assert "3 examples longer than seq_len were truncated" in data.stats.summary()
    assert int(source.train.lengths().max()) == 16


def test_the_held_out_split_is_exact_seeded_and_streamable():
    count, perm = held_out(1000, 0.05, seed=3)
    held = perm.many(np.arange(1000)) < count
    assert count == 50 and held.sum() == 50
    # decided row by row, in any batching: the same rows
    assert (np.concatenate([perm.many(np.arange(a, min(1000, a + 77))) < count for a in range(0, 1000, 77)]).tolist()
            == held.tolist())
    assert (held_out(1000, 0.05, seed=4)[1].many(np.arange(1000)) < count).tolist() != held.tolist()
    assert held_out(1, 0.5, seed=0) == (0, None) and held_out(10, 0.0, seed=0) == (0, None)


# ------------------------------------------------------------------------------------------- bad rows


@pytest.mark.parametrize("rows,expected", [
    ([{"messages": [{"role": "robot", "content": "hi"}]}], "line 1: message 1 has unknown role 'robot'"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], "line 1: no assistant message, so nothing to learn"),
    ([{"messages": "hello"}], "line 1: messages must be a non-empty list"),
])
def test_bad_chat_rows(tmp_path, tok, rows, expected):
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    with pytest.raises(UserError) as e:
        prepare_data(recipe("chat", str(path)), tok)
    assert expected in e.value.format_message()


def test_a_bad_row_is_named_by_file_and_line_and_nothing_is_cached(tmp_path, tok):
    rows = [{"text": f"alice has a cat number {i} ."} for i in range(5000)] + [{"text": 42}]
    path = write_jsonl(tmp_path / "big.jsonl", rows)
    with pytest.raises(UserError) as e:
        prepare_data(recipe("text", str(path)), tok)
    assert "big.jsonl line 5001: field 'text' is not text (int)" in e.value.format_message()
    from accel_fsdp.layout import cache_dir

    assert not any(p.name.startswith(".") for p in (cache_dir() / "tokenized").iterdir())  # no half-built folder


def test_chat_needs_a_template(tmp_path, tiny_gpt2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_gpt2)
    tok.chat_template = None
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "assistant", "content": "hi"}]}])
    with pytest.raises(UserError) as e:
        prepare_data(recipe("chat", str(path)), tok)
    assert "chat data needs a tokenizer with a chat template" in e.value.format_message()


def test_instruction_rows_need_their_fields(tmp_path, tok):
    path = write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "who ?", "response": "alice ."}])
    with pytest.raises(UserError) as e:
        prepare_data(recipe("instruction", str(path)), tok)
    msg = e.value.format_message()
    assert "data.output_field: " in msg and "has no field 'output' (its fields: instruction, response)" in msg


# ------------------------------------------------------------------------------- the order of the batches


def test_permutations_are_bijections_in_constant_memory():
    for n in (1, 2, 3, 50, 1000, 4097):
        perm = Permutation(n, key=7)
        images = [perm(i) for i in range(n)]
        assert sorted(images) == list(range(n))
        assert perm.many(np.arange(n)).tolist() == images
    assert [Permutation(1000, 1)(i) for i in range(10)] != [Permutation(1000, 2)(i) for i in range(10)]


def units_by_step(sampler_of, world, micro, steps):
    out = []
    for step in range(steps):
        units = []
        for rank in range(world):
            units += [u for mb in sampler_of(world, micro, rank).micro_batches(step) for u in mb]
        out.append(sorted(units))
    return out


def test_global_batches_do_not_depend_on_the_number_of_ranks():
    """Step s reads the same sequences whatever the world size: resuming on 1 rank what 2 started sees the same."""
    def sampler(world, micro, rank):
        return GlobalBatchSampler([50], [1.0], global_batch=8, micro_batch=micro, world_size=world, rank=rank, seed=3)

    two, one = units_by_step(sampler, 2, 2, 12), units_by_step(sampler, 1, 4, 12)
    assert two == one
    flat = [u for step in range(12) for u in sampler(1, 8, 0).global_sequences(step)]  # in slot order
    assert sorted(flat[:50]) == list(range(50))  # one epoch: every sequence once, then the next epoch reshuffled
    assert flat[50:58] != flat[:8]
    s = sampler(2, 2, 0)
    assert s.accumulation_steps == 2 and s.position(7) == {"epoch": 1, "batch_in_epoch": 0, "rows_consumed": 56}


def mixture(costs, weights, *, global_batch=16, rows=False, seed=5):
    return GlobalBatchSampler([len(c) for c in costs], weights, None if rows else costs, global_batch=global_batch,
                              micro_batch=global_batch, world_size=1, rank=0, seed=seed)


@pytest.mark.parametrize("rows", [False, True])
def test_mixture_shares_follow_the_weights_over_any_100_steps(rows):
    """Each source's share of the loss-carrying tokens (or of the sequences) over any 100 consecutive optimizer
    steps is within 0.01 of its weight; sources of very different sizes and lengths, each read in its own epochs."""
    rng = np.random.default_rng(0)
    costs = [rng.integers(60, 128, size=3000), rng.integers(2, 40, size=200), rng.integers(1, 300, size=57)]
    weights = [0.5, 0.3, 0.2]
    s = mixture(costs, weights, rows=rows)
    per_step = np.zeros((400, 3))
    for step in range(400):
        for unit in s.global_sequences(step):
            i, j = s.split(unit)
            per_step[step, i] += 1 if rows else costs[i][j]
    sums = np.cumsum(np.vstack([np.zeros(3), per_step]), axis=0)
    windows = sums[100:] - sums[:-100]
    shares = windows / windows.sum(axis=1, keepdims=True)
    assert np.abs(shares - weights).max() <= 0.01, np.abs(shares - weights).max()


def test_each_source_is_read_once_per_epoch_and_starts_its_next():
    costs = [np.full(30, 10), np.full(7, 10)]
    s = mixture(costs, [0.5, 0.5], global_batch=4)
    drawn = {0: [], 1: []}
    for step in range(40):
        for unit in s.global_sequences(step):
            i, j = s.split(unit)
            drawn[i].append(j)
    for i, n in ((0, 30), (1, 7)):
        epochs = [drawn[i][k:k + n] for k in range(0, len(drawn[i]) - n + 1, n)]
        assert len(epochs) >= 2 and all(sorted(e) == list(range(n)) for e in epochs)
        assert epochs[0] != epochs[1]  # each epoch its own permutation


def test_the_sampler_resumes_from_its_saved_state_and_replays_to_the_same():
    rng = np.random.default_rng(1)
    costs = [rng.integers(1, 100, size=400), rng.integers(1, 100, size=90)]
    a = mixture(costs, [0.7, 0.3])
    first = [a.global_sequences(s) for s in range(30)]
    state = json.loads(json.dumps(a.state_dict(20)))  # as a checkpoint stores it
    b = mixture(costs, [0.7, 0.3])
    b.load_state_dict(state)
    assert [b.global_sequences(s) for s in range(20, 30)] == first[20:]
    assert b.global_sequences(3) == first[3]  # an earlier step: replayed from the start


class CountedReads:
    """A per-unit cost array that counts the elements read from it (the sampler reads one at a time)."""

    def __init__(self, values):
        self.values, self.reads = values, 0

    def __getitem__(self, index):
        self.reads += 1
        return self.values[index]

    def __len__(self) -> int:
        return len(self.values)


def anonymous_resident_bytes() -> int:
    """RssAnon of this process: the memory it allocated itself, without the file pages it has mapped."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="RssAnon is Linux's")
def test_the_sampler_of_100m_sequences_fits_in_a_small_fraction_of_a_gigabyte(tmp_path):
    """No Python list per sequence: the per-sequence costs stay memory-mapped (a sparse file here), the order is
    computed per unit; drawing a few steps over 100M sequences touches almost nothing.

    Not the whole resident size: the file pages the reads map count in it, and how many each read maps is the
    kernel's (fault-around, readahead, large folios: 85 MiB here for 1,538 reads of 4 bytes, 1.2 times below the
    bound this test once held). What the sampler itself allocates is anonymous memory; what it reads is counted."""
    import tracemalloc

    n, steps = 100_000_000, 3
    path = tmp_path / "labels.bin"
    with open(path, "wb") as f:
        f.truncate(4 * n)  # a sparse file: no disk, no memory until read
    mapped = np.memmap(path, dtype=np.uint32, mode="r", shape=(n,))
    costs = [CountedReads(mapped), CountedReads(mapped[: n // 2])]
    before = anonymous_resident_bytes()
    tracemalloc.start()
    s = GlobalBatchSampler([n, n // 2], [0.6, 0.4], costs, global_batch=512, micro_batch=8,
                           world_size=8, rank=3, seed=0)
    for step in range(steps):
        assert len(s.micro_batches(step)) == 8
    allocated = tracemalloc.get_traced_memory()[1]  # the peak of Python and numpy allocations
    tracemalloc.stop()
    grown = anonymous_resident_bytes() - before
    # A list of 100M indices would be ~3.6 GB, an int64 permutation 800 MB: this is about 1 MB. The anonymous growth
    # has room for the allocator's granularity (a 2 MiB huge page per region touched where THP is `always`).
    assert allocated < 16 << 20 and grown < 100 << 20, (allocated, grown)
    # One cost read per unit handed out, and each source's next unit in line: a copy of the costs reads them all.
    assert sum(c.reads for c in costs) <= steps * 512 + len(costs), [c.reads for c in costs]
