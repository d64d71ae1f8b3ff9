"""The commands around training: tokenizer train, bench, verify, report, generate."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from accel_fsdp.cli.options import CONFIG_HELP, CPU_HELP, GivenPath, finite, load_recipe, not_empty, set_option
from accel_fsdp.config.recipe_checks import BPE_VOCAB_MAX, BPE_VOCAB_MIN, SEED_MAX
from accel_fsdp.errors import Problem, UserError
from accel_fsdp.files import write_atomic
from accel_fsdp.layout import RunLayout
from accel_fsdp.model.tokenizer import earlier_trained_tokenizer, trained_tokenizer
from accel_fsdp.preflight import load_config_or_default, preflight
from accel_fsdp.tools import bench
from accel_fsdp.tools.report import format_summary, plot, summarize
from accel_fsdp.tools.verify import CHECKS, verify
from accel_fsdp.tools.verify_runs import format_table

# ------------------------------------------------------------------------------------------- tokenizer


@click.group()
def tokenizer() -> None:
    """Tokenizers of your own text, for models trained from scratch without a hub tokenizer."""


@tokenizer.command("train")
@click.argument("name_or_path")
@click.argument("out_dir", type=GivenPath(path_type=Path))
@click.option("--vocab-size", default=8192, show_default=True, type=click.IntRange(BPE_VOCAB_MIN, BPE_VOCAB_MAX),
              help="Tokens in the vocabulary (special tokens included).")
@set_option
def tokenizer_train(name_or_path, out_dir, vocab_size, overrides) -> None:
    """Train a byte-level BPE tokenizer on a recipe's data (data.path and its fields) and write it to OUT_DIR, a
    folder `model.tokenizer` (and transformers) can load. Byte-level: every text is covered, no <unk>. A recipe can
    also say `model.tokenizer: bpe:8192` to train (and cache) one when it starts.

    \b
    accel-fsdp tokenizer train my.yaml tokenizers/mine --vocab-size 8192
    accel-fsdp recipe run my.yaml --set model.tokenizer=tokenizers/mine
    """
    r = load_recipe(name_or_path, [*overrides, f"model.tokenizer=bpe:{vocab_size}"])
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir())
                                                      and not earlier_trained_tokenizer(out_dir))):
        raise UserError(Problem(str(out_dir), "exists and is neither empty nor a tokenizer this command wrote",
                                "give a new folder (nothing was written)"))
    tok = trained_tokenizer(r, out_dir=out_dir.absolute())
    sample = ", ".join(s.path or s.name for s in r.data.resolved_sources())
    click.echo(f"wrote a byte-level BPE tokenizer of {len(tok):,} tokens trained on {sample} to {out_dir}")
    if len(tok) < vocab_size:  # BPE stops when no pair of tokens is left to merge: said, never a silent surprise
        click.echo(f"note: the text has merges for {len(tok):,} tokens, fewer than --vocab-size {vocab_size:,}: the "
                   f"vocabulary is {len(tok):,} (more text gives more)", err=True)


# ----------------------------------------------------------------------------------------------- bench


@click.command("bench")
@click.argument("name_or_path")
@click.option("--accelerate-config", "accelerate_config", metavar="NAME|PATH", callback=not_empty, help=CONFIG_HELP)
@click.option("--steps", default=10, show_default=True, type=click.IntRange(1, 100_000),
              help="Optimizer steps measured, after the warm-up.")
@click.option("--warmup", default=3, show_default=True, type=click.IntRange(1, 1000))
@set_option
@click.option("--compare-baseline", is_flag=True, help="Also run a minimal hand-written Accelerate FSDP loop on the "
              "same model, batch and config, alternating the two, and print the throughput ratio ours / baseline.")
@click.option("--compare", "compare", type=click.Choice(["strategies", "wrapping"]),
              help="strategies: NO_SHARD vs SHARD_GRAD_OP vs FULL_SHARD; wrapping: per block vs whole model vs "
              "per Linear.")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1, 50),
              help="With --compare-baseline: alternate ours and the baseline this many times; medians are reported.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--cpu", is_flag=True, help=CPU_HELP)
def bench_command(name_or_path, accelerate_config, steps, warmup, overrides, compare_baseline, compare, rounds,
                  as_json, cpu) -> None:
    """Measure tokens/s per rank, step time, peak memory per rank (and MFU on GPUs) of a recipe.

    \b
    accel-fsdp bench quickstart --steps 20
    accel-fsdp bench quickstart --compare-baseline --rounds 3
    accel-fsdp bench quickstart --compare strategies
    accel-fsdp bench gpt2-xl --accelerate-config fsdp_1gpu --set data.path=builtin:quickstart --steps 20
    accel-fsdp bench quickstart --accelerate-config fsdp_2gpu --cpu  # a GPU config's sharding, on CPU ranks
    """
    from click.core import ParameterSource

    # An option the chosen measurement would not read is refused, as `consolidate --base-model` without --merge is:
    # never silently ignored (the baseline was dropped under --compare, --rounds without the baseline).
    if compare_baseline and compare:
        raise UserError(Problem("--compare-baseline", f"cannot be combined with --compare {compare}",
                                "run them as two commands"))
    if not compare_baseline and click.get_current_context().get_parameter_source("rounds") != ParameterSource.DEFAULT:
        raise UserError(Problem("--rounds", "only applies to --compare-baseline (the rounds alternate ours and the "
                                "baseline)", "add --compare-baseline, or drop --rounds"))
    r = load_recipe(name_or_path, overrides)
    config, n, _ = load_config_or_default(accelerate_config)
    if cpu:
        config.values["use_cpu"] = True  # as the ranks will read it (--cpu reaches them)
    preflight(r, config, num_processes=n, check_hub=True, cpu_option=True)
    result, text = bench.run(r, config, list(overrides), steps=steps, warmup=warmup, compare=compare,
                             baseline_rounds=rounds if compare_baseline else 0, cpu=cpu)
    click.echo(bench.to_json(result) if as_json else text)


# ---------------------------------------------------------------------------------------------- verify


@click.command("verify")
@click.argument("name_or_path")
@click.option("--accelerate-config", "accelerate_config", metavar="NAME|PATH", callback=not_empty, help=CONFIG_HELP)
@set_option
@click.option("--quick", is_flag=True, help="Fewer probes: no run on fewer ranks (equivalence and data compare one).")
@click.option("--steps", default=4, show_default=True, type=click.IntRange(2, 100),
              help="Optimizer steps of each probe (resume is checked from step 2 when there are 3 or more).")
@click.option("--layers", type=click.IntRange(1, 1000), help="Verify the same settings on a copy of the architecture "
              "with this many blocks (for models too large to probe whole; pretrained weights of the first blocks).")
@click.option("--num-processes", type=click.IntRange(1, 1 << 20), help="Ranks, overriding the config.")
@click.option("--only", "only", multiple=True, type=click.Choice(CHECKS),
              help="Only these checks (repeatable). Default: all.")
@click.option("--output-dir", type=GivenPath(path_type=Path), help="Where the probes and report.json go. Default: "
              "runs/<recipe name>-verify.")
@click.option("--cpu", is_flag=True, help=CPU_HELP)
def verify_command(name_or_path, accelerate_config, overrides, quick, steps, layers, num_processes, only,
                   output_dir, cpu) -> None:
    """Prove on this hardware that the recipe trains correctly: sharding, precision, the same loss however the
    global batch is split, exact resume, packed documents kept apart, the data mixture (each sequence once per epoch,
    shares by weight, the same sequences on any number of ranks), activation checkpointing with dropout, memory
    against the estimate, throughput. Each check prints PASS/FAIL with what was measured and the tolerance;
    exit status 1 when any fails. docs/VERIFY.md says what each proves, and what it cannot.

    \b
    accel-fsdp verify quickstart                                     # 2 CPU ranks: what CI runs
    accel-fsdp verify gpt2-xl --accelerate-config fsdp_2gpu
    accel-fsdp verify my.yaml --accelerate-config llama_fsdp_8gpu --quick --layers 4
    accel-fsdp verify quickstart --accelerate-config fsdp_2gpu --cpu  # a GPU config's settings, on CPU ranks
    """
    r = load_recipe(name_or_path, overrides)
    config, n, _ = load_config_or_default(accelerate_config)
    if num_processes is not None:
        config.values["num_processes"] = n = num_processes
    if cpu:
        config.values["use_cpu"] = True  # as the probes' ranks will read it (--cpu reaches them)
    out = (output_dir or Path(f"runs/{r.name}-verify")).expanduser().absolute()
    result = verify(r, config, n, list(overrides), out_dir=out, quick=quick, layers=layers, steps=steps,
                    only=list(only), cpu=cpu)
    click.echo(format_table(result))
    if any(c.status == "FAIL" for c in result.checks):
        sys.exit(1)


# ---------------------------------------------------------------------------------------------- report


@click.command("report")
@click.argument("run_dir", type=GivenPath(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def report_command(run_dir: Path, as_json: bool) -> None:
    """Summarize a run (steps, final and best eval loss, tokens/s, peak memory) and draw its loss curve into
    RUN_DIR/loss_curve.png (needs matplotlib: pip install "accel-fsdp[plot]").

    \b
    accel-fsdp report runs/quickstart
    """
    summary = summarize(run_dir)
    try:
        png = plot(run_dir)
        write_atomic(RunLayout.at(run_dir).report_file,
                     json.dumps({**summary, "loss_curve": str(png) if png else None}, indent=1) + "\n")
    except OSError as e:  # a read-only run folder (someone else's run): report, write nothing
        png = None
        click.echo(f"note: cannot write report.json / loss_curve.png into {run_dir} ({e.strerror or e})", err=True)
    summary["loss_curve"] = str(png) if png else None
    if as_json:
        click.echo(json.dumps(summary, indent=1))
        return
    click.echo(format_summary(summary))
    click.echo(f"  loss curve: {png}" if png else '  loss curve: install matplotlib (pip install "accel-fsdp[plot]")')


# -------------------------------------------------------------------------------------------- generate


@click.command("generate")
@click.argument("model_dir", type=GivenPath(path_type=Path))
@click.option("--prompt", required=True, help="Text to continue (with --chat: the user's message); - reads it from "
              "standard input, @FILE from a UTF-8 text file (a prompt of several lines); @@ starts a text with @.")
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(1, 100_000))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0.0, 10.0),
              callback=lambda ctx, param, v: finite(param, v), help="0 is greedy; above 0 samples.")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0.0, 1.0, min_open=True),
              callback=lambda ctx, param, v: finite(param, v),
              help="Nucleus sampling: keep the most likely tokens up to this probability mass.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, SEED_MAX),
              help="Seed for sampling (the range of training.seed).")
@click.option("--chat", is_flag=True, help="Render the prompt as a user turn with the tokenizer's chat template.")
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]))
def generate_command(model_dir, prompt, max_new_tokens, temperature, top_p, seed, chat, device) -> None:
    """Sample from an exported model (a run folder, a consolidated folder, or a LoRA adapter folder).

    \b
    accel-fsdp generate runs/quickstart --prompt "alice has a"
    accel-fsdp generate out/llama-lora --chat --prompt "Name three prime numbers." --temperature 0.7 --top-p 0.9
    accel-fsdp generate runs/quickstart --prompt @prompt.txt
    """
    from accel_fsdp.tools.generate import generate, load_model, resolve_model_dir

    prompt = read_prompt(prompt)
    if not prompt.strip():
        raise UserError(Problem("--prompt", "is empty", 'give some text to continue, e.g. --prompt "alice has a"'))
    if temperature == 0:  # a note, not a refusal: a sweep over temperatures from 0 passes the same options to each
        from click.core import ParameterSource

        given = [f"--{name.replace('_', '-')}" for name in ("top_p", "seed")
                 if click.get_current_context().get_parameter_source(name) != ParameterSource.DEFAULT]
        if given:
            verb, them = ("apply", "them") if len(given) > 1 else ("applies", "it")
            click.echo(f"note: {' and '.join(given)} only {verb} to sampling (--temperature above 0): greedy decoding "
                       f"ignores {them}", err=True)
    folder = resolve_model_dir(model_dir)
    model, tokenizer = load_model(folder, device)
    text = generate(model, tokenizer, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                    seed=seed, chat=chat)
    click.echo(f"{prompt} {text}" if not chat else text)


def read_prompt(typed: str) -> str:
    """--prompt as typed: `-` is standard input, `@FILE` a UTF-8 text file, anything else the text itself. The
    line break that ends a file or an `echo` is not part of the prompt (it would be the first token continued)."""
    if typed == "-":
        return sys.stdin.read().rstrip("\r\n")
    if not typed.startswith("@") or typed == "@":
        return typed
    if typed.startswith("@@"):  # a prompt that itself starts with @
        return typed[1:]
    path = Path(typed[1:]).expanduser()
    fix = ("give a UTF-8 text file holding the prompt, e.g. --prompt @prompt.txt, or the text itself (@@ for a text "
           "that starts with @)")
    if path.is_dir():
        raise UserError(Problem(f"--prompt {typed}", f"{path} is a folder", fix))
    try:
        return path.read_text(encoding="utf-8").rstrip("\r\n")
    except FileNotFoundError:
        raise UserError(Problem(f"--prompt {typed}", f"{path} does not exist", fix)) from None
    except UnicodeDecodeError as e:
        raise UserError(Problem(f"--prompt {typed}", f"{path} is not UTF-8 text (byte {e.start})", fix)) from None
