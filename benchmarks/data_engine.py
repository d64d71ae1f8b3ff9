"""Data preparation against the plain Hugging Face pipeline, side by side, on corpora we did not write.

    python benchmarks/data_engine.py                          # 25 MB and 100 MB of code and of prose, 3 rounds
    python benchmarks/data_engine.py --sizes 25MB,100MB,2GB --rounds 3   # one round of each 2 GB corpus
    python benchmarks/data_engine.py --corpora chat,instruction,preference --sizes 55MB --rounds 3

Corpora (built once into --work): `code`, the .py files of the installed packages (site-packages), cut into rows of
about 2,000 characters; `prose`, English documentation on this machine (Vim's help, Node.js' docs, Debian
changelogs, Perl's pod, Rust's release notes), cut at paragraphs into rows of about 2,000 characters. A size beyond
the material repeats it, reshuffled. Both pipelines use one tokenizer, a 16,384-token byte-level BPE made by
`accel-fsdp tokenizer train` on the 25 MB code corpus, `seq_len` 512, packed text, and the cores this process may
use (`datasets.map(num_proc=cores)`; our Rust threads).

Chat corpora, made of the prose corpus's paragraphs (seeded): `chat`, conversations of 1 to 4 exchanges (a user
turn asks about a paragraph, the assistant answers with the 1 to 3 paragraphs that follow another), half of them after
a system prompt; `instruction`, an instruction, half of the time an input paragraph, and an output; `preference`, a
prompt and two answers, half as strings and half as conversations whose last assistant turns differ (some of two
exchanges). Ours reads them with their format (the tokenizer's chat template: `accel-fsdp tokenizer train`'s), seq_len
4096, unpacked, the loss on the assistant turns; the plain pipeline renders each row with `apply_chat_template`
(instruction rows as a user and an assistant turn, a preference row as its chosen and its rejected conversation) and
encodes the batch's texts in one call of the fast tokenizer, in `datasets.map(batched=True, num_proc=cores)`, then
`save_to_disk`: no loss mask (less work than ours).

  ours   `accel-fsdp data prepare` of a recipe reading the corpus (a fresh cache each time)
  plain  what a user writes by hand, after transformers' run_clm.py example: datasets.load_dataset("json") ->
         map(tokenize_function: tokenizer(batch), EOS appended) -> map(group_texts: concatenate and cut into 512-token
         blocks, labels copied) -> save_to_disk (a fresh datasets cache each time). `--baseline ids` measures the
         leanest version instead (input ids only: no attention mask, no labels).

Each measurement is a separate process; rounds alternate which runs first. Printed: median wall seconds, tokens/s
and their ratio, CPU seconds of the whole process tree (user and system: the work done, which other load on the
machine inflates far less than wall time), the peak resident memory of the whole process tree (sampled every
50 ms; the plain pipeline's worker processes included), and bytes on disk per token (ours: the cache folder; plain:
the saved dataset).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

PLAIN = '''
import sys
from itertools import chain
import datasets
from transformers import AutoTokenizer
path, tokenizer, out, num_proc, block, variant = (sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]),
                                                  int(sys.argv[5]), sys.argv[6])
datasets.disable_progress_bars()
tok = AutoTokenizer.from_pretrained(tokenizer)
eos = tok.eos_token_id
ds = datasets.load_dataset("json", data_files=path, split="train")
if variant == "run_clm":
    # transformers' examples/pytorch/language-modeling/run_clm.py: tokenize_function and group_texts, EOS appended
    def tokenize_function(examples):
        output = tok(examples["text"])
        output["input_ids"] = [ids + [eos] for ids in output["input_ids"]]
        output["attention_mask"] = [mask + [1] for mask in output["attention_mask"]]
        return output
    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples.keys()}
        total = len(concatenated[list(examples.keys())[0]]) // block * block
        result = {k: [t[i:i + block] for i in range(0, total, block)] for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result
else:  # the leanest hand-written version: ids only
    def tokenize_function(examples):
        return {"input_ids": [ids + [eos] for ids in tok(examples["text"])["input_ids"]]}
    def group_texts(examples):
        ids = list(chain(*examples["input_ids"]))
        n = len(ids) // block * block
        return {"input_ids": [ids[i:i + block] for i in range(0, n, block)]}
ds = ds.map(tokenize_function, batched=True, remove_columns=ds.column_names, num_proc=num_proc)
ds = ds.map(group_texts, batched=True, num_proc=num_proc)
ds.save_to_disk(out)
print(len(ds) * block)
'''

PLAIN_CHAT = '''
import sys
import datasets
import pyarrow.compute as pc
from transformers import AutoTokenizer
path, tokenizer, out, num_proc, kind = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
datasets.disable_progress_bars()
tok = AutoTokenizer.from_pretrained(tokenizer)
ds = datasets.load_dataset("json", data_files=path, split="train")
def conversations(batch):
    if kind == "chat":
        return [batch["messages"]]
    if kind == "instruction":
        return [[[{"role": "user", "content": f"{i}\\n\\n{x}" if x else i}, {"role": "assistant", "content": o}]
                 for i, x, o in zip(batch["instruction"], batch["input"], batch["output"])]]
    pairs = []
    for p, c, r in zip(batch["prompt"], batch["chosen"], batch["rejected"]):
        pairs.append([[{"role": "user", "content": p}, {"role": "assistant", "content": a}] for a in (c, r)]
                     if isinstance(c, str) else [c, r])
    return [[pair[0] for pair in pairs], [pair[1] for pair in pairs]]
def tokenize(batch):
    out = {}
    for name, messages in zip(("chosen_input_ids", "rejected_input_ids") if kind == "preference" else ("input_ids",),
                              conversations(batch)):
        texts = [tok.apply_chat_template(m, tokenize=False) for m in messages]
        out[name] = tok(texts, add_special_tokens=False)["input_ids"]
    return out
ds = ds.map(tokenize, batched=True, remove_columns=ds.column_names, num_proc=num_proc)
ds.save_to_disk(out)
print(sum(pc.sum(pc.list_value_length(ds.data.column(name))).as_py() for name in ds.column_names))
'''
CHAT_KINDS = ("chat", "instruction", "preference")
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are an expert on Unix tools and software packaging. Answer precisely and name the option or file.",
    "You answer questions about documentation. Keep answers short, quote the text where it helps, and say when the "
    "documentation does not cover the question.",
)
ASKS = ("Can you explain this?\n\n{p}", "What does the following mean?\n\n{p}", "Summarize this for me: {p}",
        "{p}\n\nWhat should I take away from that?", "I read this in the docs:\n\n{p}\n\nIs that still true?")
INSTRUCTIONS = ("Explain the following.", "Summarize the text.", "Say what this changes for a user.",
                "Rewrite this for a newcomer.", "Answer briefly: what is this about?")
CHAT_SEQ_LEN = 4096
"""seq_len of the chat corpora: long enough that hardly any example is cut (the plain pipeline cuts none)."""
PROSE_SOURCES = ("/usr/share/vim/vim*/doc/*.txt", "/usr/share/doc/nodejs/**/*.md", "/usr/share/doc/*/changelog*.gz",
                 "/usr/share/perl/*/pod/*.pod", "/root/.rustup/toolchains/*/share/doc/rust/**/*.md")


def parse_size(text: str) -> int:
    units = {"KB": 1e3, "MB": 1e6, "GB": 1e9}
    return int(float(text[:-2]) * units[text[-2:].upper()])


def code_documents():
    import sysconfig

    root = Path(sysconfig.get_paths()["purelib"])
    for path in sorted(root.rglob("*.py")):
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def prose_documents():
    import glob
    import gzip

    for pattern in PROSE_SOURCES:
        for name in sorted(glob.glob(pattern, recursive=True)):
            try:
                raw = gzip.open(name).read() if name.endswith(".gz") else open(name, "rb").read()
                yield raw.decode("utf-8")
            except (UnicodeDecodeError, OSError, EOFError):
                continue


def rows_of(documents, prose: bool):
    """Rows of about 2,000 characters: code cut every 2,000 characters, prose at the paragraph that crosses 2,000."""
    for text in documents:
        if not prose:
            yield from (text[i:i + 2000] for i in range(0, len(text), 2000) if text[i:i + 2000].strip())
            continue
        row = ""
        for paragraph in text.split("\n\n"):
            row += paragraph + "\n\n"
            if len(row) >= 2000:
                yield row
                row = ""
        if row.strip():
            yield row


def chat_rows(kind: str, rng: random.Random, paragraphs: list[str]):
    """Endless rows of a chat, instruction or preference corpus (see the module's docstring)."""
    def ask() -> str:
        return rng.choice(ASKS).format(p=rng.choice(paragraphs))

    def answer() -> str:
        k = rng.randrange(len(paragraphs) - 3)
        return "\n\n".join(paragraphs[k:k + rng.choice((1, 1, 2, 3))])

    def turn(role: str, content: str) -> dict:
        return {"role": role, "content": content}

    while True:
        if kind == "chat":
            messages = [turn("system", rng.choice(SYSTEM_PROMPTS))] if rng.random() < 0.5 else []
            for _ in range(rng.choice((1, 1, 1, 2, 2, 3, 4))):
                messages += [turn("user", ask()), turn("assistant", answer())]
            yield {"messages": messages}
        elif kind == "instruction":
            yield {"instruction": rng.choice(INSTRUCTIONS), "input": rng.choice(paragraphs) if rng.random() < 0.5
                   else "", "output": answer()}
        else:
            chosen, rejected = answer(), answer()
            while rejected == chosen:  # a pair that prefers nothing is refused
                rejected = answer()
            if rng.random() < 0.5:
                yield {"prompt": ask(), "chosen": chosen, "rejected": rejected}
                continue
            shared = [turn("user", ask())]
            if rng.random() < 0.5:
                shared += [turn("assistant", answer()), turn("user", ask())]
            yield {"chosen": shared + [turn("assistant", chosen)], "rejected": shared + [turn("assistant", rejected)]}


def build_corpus(kind: str, size: int, work: Path) -> Path:
    path = work / f"{kind}-{size}.jsonl"
    if path.exists():
        return path
    if kind in CHAT_KINDS:
        paragraphs = [p.strip() for text in prose_documents() for p in text.split("\n\n")
                      if 40 <= len(p.strip()) <= 3000]
        rows, passes = chat_rows(kind, random.Random(0), paragraphs), 1
    else:
        texts = list(rows_of(code_documents() if kind == "code" else prose_documents(), prose=kind == "prose"))
        rows, passes = None, 0
    rng = random.Random(0)
    tmp = path.with_suffix(".tmp")
    written, count = 0, 0
    with open(tmp, "w") as f:
        while written < size:
            if rows is None:
                rng.shuffle(texts)
                passes += 1
            for row in rows or ({"text": t} for t in texts):
                line = json.dumps(row) + "\n"
                f.write(line)
                written += len(line.encode())
                count += 1
                if written >= size:
                    break
    os.replace(tmp, path)
    print(f"corpus {path.name}: {written / 1e6:,.0f} MB, {count:,} rows"
          + ("" if kind in CHAT_KINDS else f", {passes} pass(es) over {len(texts):,} texts"), flush=True)
    return path


def cpu_seconds() -> float:
    """User and system seconds of this process's children that have ended (their own ended children included)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def peak_tree_rss(proc: subprocess.Popen) -> tuple[int, float]:
    """(peak resident bytes of the process and its descendants, wall seconds), sampled until it exits."""
    start, peak = time.monotonic(), 0
    page = os.sysconf("SC_PAGE_SIZE")
    while proc.poll() is None:
        total = 0
        for pid in _tree(proc.pid):
            try:
                with open(f"/proc/{pid}/statm") as f:
                    total += int(f.read().split()[1]) * page
            except OSError:
                continue
        peak = max(peak, total)
        time.sleep(0.05)
    return peak, time.monotonic() - start


def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def run_ours(corpus: Path, tokenizer: Path, work: Path, seq_len: int, kind: str) -> dict:
    cache = work / "ours-cache"
    shutil.rmtree(cache, ignore_errors=True)
    recipe = work / "bench.yaml"
    data = {"path": str(corpus), "seq_len": seq_len, "eval_fraction": 0}
    training = {"micro_batch_size": 1, "global_batch_size": 1}
    if kind in CHAT_KINDS:
        data.update(format=kind, seq_len=CHAT_SEQ_LEN)
        training["method"] = "dpo" if kind == "preference" else "sft"
    recipe.write_text(json.dumps({"name": "bench", "model": {"architecture": "gpt2", "tokenizer": str(tokenizer)},
                                  "data": data, "training": training}))
    env = dict(os.environ, ACCEL_FSDP_CACHE=str(cache))
    cpu = cpu_seconds()
    proc = subprocess.Popen([sys.executable, "-m", "accel_fsdp", "data", "prepare", str(recipe)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, seconds = peak_tree_rss(proc)
    out, err = proc.communicate()
    cpu = cpu_seconds() - cpu
    if proc.returncode:
        raise SystemExit(f"accel-fsdp data prepare failed:\n{err[-3000:]}")
    stats = json.loads(next((cache / "tokenized").glob("*/stats.json")).read_text())
    size = folder_bytes(next(p for p in (cache / "tokenized").iterdir() if p.is_dir()))
    return {"seconds": seconds, "cpu": cpu, "peak": peak, "tokens": stats["train_tokens"], "bytes": size}


def run_plain(corpus: Path, tokenizer: Path, work: Path, seq_len: int, cores: int, variant: str, kind: str) -> dict:
    cache, out = work / "plain-cache", work / "plain-out"
    for folder in (cache, out):
        shutil.rmtree(folder, ignore_errors=True)
    env = dict(os.environ, HF_DATASETS_CACHE=str(cache), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    script = [PLAIN_CHAT, kind] if kind in CHAT_KINDS else [PLAIN, str(seq_len), variant]
    cpu = cpu_seconds()
    proc = subprocess.Popen([sys.executable, "-c", script[0], str(corpus), str(tokenizer), str(out), str(cores),
                             *script[1:]], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, seconds = peak_tree_rss(proc)
    stdout, err = proc.communicate()
    cpu = cpu_seconds() - cpu
    if proc.returncode:
        raise SystemExit(f"the plain pipeline failed:\n{err[-3000:]}")
    return {"seconds": seconds, "cpu": cpu, "peak": peak, "tokens": int(stdout.split()[-1]), "bytes": folder_bytes(out)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="25MB,100MB", help="comma-separated, e.g. 25MB,100MB,2GB")
    parser.add_argument("--corpora", default="code,prose", help="of code, prose, chat, instruction, preference")
    parser.add_argument("--rounds", type=int, default=3, help="measurements of each pipeline per corpus and size")
    parser.add_argument("--rounds-large", type=int, default=1, help="rounds for sizes of 1 GB and more")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--work", type=Path, default=Path("/tmp/accel-fsdp-data-bench"))
    parser.add_argument("--baseline", choices=["run_clm", "ids"], default="run_clm",
                        help="run_clm: run_clm.py's tokenize_function and group_texts; ids: input ids only")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from accel_fsdp.hardware import cpu_bf16, usable_cores

    args.work.mkdir(parents=True, exist_ok=True)
    cores = usable_cores()
    tokenizer = args.work / "tokenizer-16k"
    if not tokenizer.exists():
        seed = build_corpus("code", parse_size("25MB"), args.work)
        recipe = args.work / "tok.yaml"
        recipe.write_text(json.dumps({"model": {"architecture": "gpt2"}, "data": {"path": str(seed)}}))
        subprocess.run([sys.executable, "-m", "accel_fsdp", "tokenizer", "train", str(recipe), str(tokenizer),
                        "--vocab-size", "16384"], check=True)
    print(f"machine: {cpu_bf16()[1]}, {cores} usable cores; tokenizer: 16,384-token byte-level BPE; seq_len "
          f"{args.seq_len} (chat corpora {CHAT_SEQ_LEN}); baseline {args.baseline}; {args.rounds} round(s), medians; "
          f"load average at the start {os.getloadavg()[0]:.1f}", flush=True)
    results = []
    for kind in args.corpora.split(","):
        for size_text in args.sizes.split(","):
            corpus = build_corpus(kind, parse_size(size_text), args.work)
            runs = {"ours": [], "plain": []}
            rounds = args.rounds if parse_size(size_text) < 1e9 else min(args.rounds, args.rounds_large)
            for r in range(rounds):
                order = ("ours", "plain") if r % 2 == 0 else ("plain", "ours")
                for name in order:
                    result = (run_ours(corpus, tokenizer, args.work, args.seq_len, kind) if name == "ours" else
                              run_plain(corpus, tokenizer, args.work, args.seq_len, cores, args.baseline, kind))
                    runs[name].append(result)
                    print(f"  {kind} {size_text} round {r + 1} {name}: {result['seconds']:.1f}s, "
                          f"{result['tokens'] / result['seconds']:,.0f} tokens/s, {result['cpu']:.1f} CPU s, "
                          f"peak {result['peak'] / 2**30:.2f} GiB, load {os.getloadavg()[0]:.1f}", flush=True)
            med = {n: {k: statistics.median(x[k] for x in v) for k in v[0]} for n, v in runs.items()}
            results.append((kind, size_text, med))
    print()
    print("| corpus | size | tokens | ours s | plain s | ours tokens/s | plain tokens/s | ratio | ours CPU s | "
          "plain CPU s | ours peak GiB | plain peak GiB | ours bytes/token | plain bytes/token |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for kind, size_text, m in results:
        o, p = m["ours"], m["plain"]
        print(f"| {kind} | {size_text} | {o['tokens'] / 1e6:,.1f}M | {o['seconds']:.1f} | {p['seconds']:.1f} | "
              f"{o['tokens'] / o['seconds']:,.0f} | {p['tokens'] / p['seconds']:,.0f} | "
              f"{(o['tokens'] / o['seconds']) / (p['tokens'] / p['seconds']):.2f}x | {o['cpu']:.1f} | {p['cpu']:.1f} | "
              f"{o['peak'] / 2**30:.2f} | {p['peak'] / 2**30:.2f} | {o['bytes'] / o['tokens']:.2f} | "
              f"{p['bytes'] / p['tokens']:.2f} |")
    print()
    for kind in args.corpora.split(","):
        peaks = {s: m["ours"]["peak"] for k, s, m in results if k == kind}
        first = next(iter(peaks))
        print(f"{kind}: ours' peak memory relative to {first}: " + ", ".join(f"{s} {v / peaks[first]:.2f}x"
                                                                           for s, v in peaks.items()))


if __name__ == "__main__":
    main()
