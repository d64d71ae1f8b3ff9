"""training.compile: each block's forward compiled (model/compile.py) trains like the eager model on 2 CPU ranks, with
no graph break on GPT-2 and Llama (SDPA and a flash kernel), at most two graphs per block whatever the shapes, the
compiler's cache kept between runs, and one message before launch where it cannot compile."""

from __future__ import annotations

import json
import types

import pytest
import torch
from click.testing import CliRunner
from conftest import read_metrics, run_cli, save_tiny_model, tiny_recipe
from flash_standin import NAME as FLASH_STANDIN
from flash_standin import install as install_flash_standin

from accel_fsdp.cli import main
from accel_fsdp.config.accelerate import load_accelerate_config
from accel_fsdp.config.recipe import recipe_from_text
from accel_fsdp.config.settings import Setting, Source, resolve_settings
from accel_fsdp.data.batches import batch_layout, collate
from accel_fsdp.data.store import Sequence
from accel_fsdp.layout import COMPILE_CACHE_ENV
from accel_fsdp.model.compile import compile_blocks, compile_problems, compile_statistics
from accel_fsdp.tools.noise import equivalence_tolerance

TINY = """
model: {architecture: gpt2, tokenizer: "builtin:quickstart", config_overrides: {n_layer: 2, n_embd: 64, n_head: 4}}
data: {path: "builtin:quickstart", seq_len: 64}
training: {micro_batch_size: 1, global_batch_size: 8, max_steps: 4, compile: true}
"""


def sequences_of(lengths: list[list[int]]) -> list[Sequence]:
    """One sequence per list of document lengths, its documents' positions restarting, every token but each
    document's first carrying a loss."""
    out = []
    for docs in lengths:
        ids = torch.arange(5, 5 + sum(docs)) % 200 + 5
        positions = torch.cat([torch.arange(n) for n in docs])
        labels = ids.clone()
        labels[positions == 0] = -100
        out.append(Sequence(ids.numpy(), labels.numpy(), positions.numpy()))
    return out


def blocks_of(model) -> torch.nn.ModuleList:
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def block_inputs(model, batch: dict) -> tuple[tuple, dict]:
    """The arguments the model's first block gets for `batch`."""
    seen = {}

    def grab(module, args, kwargs):
        seen.update(args=args, kwargs=kwargs)

    handle = blocks_of(model)[0].register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False)
    handle.remove()
    return seen["args"], seen["kwargs"]


@pytest.fixture
def flash_standin(monkeypatch):
    return install_flash_standin(monkeypatch.setitem, monkeypatch.setattr)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("kernel", ["sdpa", "flash"])
def test_a_block_compiles_in_one_graph_with_sdpa_and_a_flash_kernel(tmp_path, monkeypatch, kind, kernel):
    """dynamo traces the block's forward whole: one graph, no break, with the batch layout the trainer gives each
    kernel (padded rows for SDPA, one padding-free row with cu_seq_lens for flash)."""
    from transformers import AutoModelForCausalLM

    attention = "sdpa"
    if kernel == "flash":
        install_flash_standin(monkeypatch.setitem, monkeypatch.setattr)
        attention = FLASH_STANDIN
    model = AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / kind, kind),
                                                 attn_implementation=attention)
    batch = collate(sequences_of([[7, 9], [12, 4]]), 0, True, layout=batch_layout(attention, True))
    args, kwargs = block_inputs(model, batch)
    explanation = torch._dynamo.explain(blocks_of(model)[0].forward)(*args, **kwargs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.slow
@pytest.mark.parametrize("kernel,lengths,graphs", [
    # packed rows, one length: rows of one document each attend with no mask (transformers' sdpa_mask skips it for
    # is_causal), rows of several with one, and the block's code branches on it (use_gqa_in_sdpa): 2 graphs
    ("sdpa", [[[64], [64]], [[64], [64]], [[30, 34], [64]]], 2),
    ("sdpa", [[[20], [9]], [[40], [33]], [[12], [57]]], 2),  # padded rows of changing length
    ("flash", [[[20, 9]], [[40, 33, 5]], [[12]]], 2),  # padding-free rows of changing token count
])
def test_a_run_of_changing_shapes_compiles_the_blocks_at_most_twice(tmp_path, monkeypatch, kernel, lengths, graphs):
    """Training steps of changing shapes compile one graph for all blocks, and one more with symbolic sizes at the
    first new shape; evaluation (no gradients) runs eagerly and compiles nothing. Compiled and eager losses agree
    within fp32 reordering."""
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    attention = "sdpa"
    if kernel == "flash":
        install_flash_standin(monkeypatch.setitem, monkeypatch.setattr)
        attention = FLASH_STANDIN
    folder = save_tiny_model(tmp_path / "llama", "llama")
    compiled = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attention)
    eager = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attention)
    assert compile_blocks(compiled).count == 2
    torch._dynamo.reset()
    counters.clear()
    for step in lengths:
        batch = collate(sequences_of(step), 0, True, layout=batch_layout(attention, True))
        losses = []
        for model in (compiled, eager):
            loss = model(**batch, use_cache=False).loss
            loss.backward()
            losses.append(loss.item())
        tokens = sum(sum(docs) for docs in step)
        assert losses[0] == pytest.approx(losses[1], rel=equivalence_tolerance("fp32", tokens, 1, 1)["loss"])
        with torch.no_grad():
            compiled(**batch, use_cache=False)
    statistics = compile_statistics()
    assert statistics["graph_breaks"] == 0
    assert statistics["graphs"] == graphs


def compile_line(stdout: str) -> str:
    """The start summary's line about the compile (compiled blocks, time, the cache and its hits and misses)."""
    return next(line for line in stdout.splitlines() if line.startswith("  compile "))


CACHE_TEST = "test_the_compilers_cache_is_kept_in_the_cache_folder_between_runs"


@pytest.fixture(scope="module")
def compiled_and_eager_runs(request, tmp_path_factory, tiny_gpt2, stories):
    """An eager and a compiled run of one recipe on 2 ranks. Where CACHE_TEST runs too (the whole suite), the compiled
    one has a cache folder of its own that starts empty: the first run of that cache, which CACHE_TEST runs a second
    time. Elsewhere (the fast tier) it keeps the tests' shared compile cache, which spares it a cold compile."""
    folder = tmp_path_factory.mktemp("compiled-and-eager")
    recipe = tiny_recipe(folder / "r.yaml", tiny_gpt2, stories, training={"max_steps": 3, "mixed_precision": "fp32",
                                                                        "eval_every_steps": 1},
                         checkpoint={"export_final": False})
    cache = folder / "cache"
    fresh = any(getattr(item, "originalname", None) == CACHE_TEST for item in request.session.items)
    runs = {}
    for compiled in (False, True):
        with pytest.MonkeyPatch.context() as env:
            if compiled and fresh:
                env.delenv(COMPILE_CACHE_ENV)
                env.setenv("ACCEL_FSDP_CACHE", str(cache))
            run = folder / f"compiled-{compiled}"
            proc = run_cli("recipe", "run", recipe, "--output-dir", run, "--set", f"training.compile={compiled}",
                           env={"ACCEL_FSDP_PROBE": "knobs"}, check=0)
        runs[compiled] = types.SimpleNamespace(folder=run, stdout=proc.stdout)
    return types.SimpleNamespace(recipe=recipe, cache=cache, fresh_cache=fresh, eager=runs[False],
                                 compiled=runs[True])


@pytest.mark.slow  # a knob's own promise: the whole suite's (docs/ARCHITECTURE.md, Tests)
@pytest.mark.multiprocess
def test_compiled_blocks_train_like_eager_on_two_ranks(compiled_and_eager_runs):
    """The core promise: the same losses and gradient norms within the noise model of fp32 sums added in other orders,
    at most two graphs and no graph break, the compile time in the start summary."""
    runs = compiled_and_eager_runs
    stdout = runs.compiled.stdout
    assert "  compile   2 GPT2Block blocks compiled (inductor) in" in stdout
    assert "compile" in stdout.split("first optimizer step after", 1)[1].splitlines()[0]  # the startup clock
    train = {name: [r for r in read_metrics(run.folder) if r["kind"] == "train"]
             for name, run in (("eager", runs.eager), ("compiled", runs.compiled))}
    # 8 sequences of 64 tokens a step, 2 micro-steps of 4 a rank
    tolerance = equivalence_tolerance("fp32", 8 * 64, 2, 3)
    for eager, compiled in zip(train["eager"], train["compiled"], strict=True):
        assert compiled["loss"] == pytest.approx(eager["loss"], rel=tolerance["loss"])
        assert compiled["grad_norm"] == pytest.approx(eager["grad_norm"], rel=tolerance["grad_norm"])
    for rank in (0, 1):
        lines = [json.loads(x) for x in (runs.compiled.folder / "trace" / f"knobs-rank{rank}.jsonl")
                 .read_text().splitlines()]
        assert [x["step"] for x in lines] == [1, 2, 3]
        assert lines[-1]["compile"]["graphs"] <= 2 and lines[-1]["compile"]["graph_breaks"] == 0  # after evaluations


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_compilers_cache_is_kept_in_the_cache_folder_between_runs(tmp_path, compiled_and_eager_runs, monkeypatch):
    """The first run of an empty cache folder (the fixture's compiled run) says where the cache is and hits nothing;
    a second run of the same recipe finds every graph there (0 misses)."""
    runs = compiled_and_eager_runs
    assert runs.fresh_cache  # the fixture saw this test collected
    monkeypatch.delenv(COMPILE_CACHE_ENV)
    monkeypatch.setenv("ACCEL_FSDP_CACHE", str(runs.cache))
    proc = run_cli("recipe", "run", runs.recipe, "--output-dir", tmp_path / "run2", "--set", "training.compile=true",
                   env={"ACCEL_FSDP_PROBE": "knobs"}, check=0)
    said = [compile_line(runs.compiled.stdout), compile_line(proc.stdout)]
    where = f"cache {runs.cache / 'compile'}:"
    assert where in said[0] and "0 hit(s)" in said[0]
    assert where in said[1] and " 0 miss(es)" in said[1] and "0 hit(s)" not in said[1]


# ----------------------------------------------------------------------------- where it cannot compile


def settings_and_recipe(config="fsdp_cpu", overrides=()):
    recipe = recipe_from_text(TINY, source="r.yaml", overrides=overrides)
    return recipe, resolve_settings(recipe, load_accelerate_config(config), cuda_available=False)


def view(*blocks: str):
    return types.SimpleNamespace(class_name="SomeModelForCausalLM", no_split_modules=list(blocks))


def test_compile_problems_name_every_reason_in_one_message(monkeypatch):
    recipe, settings = settings_and_recipe()
    assert compile_problems(recipe, settings, view("GPT2Block")) == []
    monkeypatch.setenv("CXX", "/nowhere/g++")
    problems = compile_problems(recipe, settings, view("OPTDecoderLayer"))
    assert len(problems) == 1
    text = str(problems[0])
    assert text.startswith("r.yaml:4: training.compile: cannot compile here: ")
    assert "SomeModelForCausalLM's blocks (OPTDecoderLayer) are not ones compilation is proven on" in text
    assert "'/nowhere/g++' ($CXX) is not on PATH" in text and "training.compile: false" in text
    recipe, settings = settings_and_recipe(overrides=["training.compile=false"])
    assert compile_problems(recipe, settings, view("OPTDecoderLayer")) == []


def test_compile_is_refused_for_fsdp1_and_a_gpu_config_is_not_judged_by_this_machine(monkeypatch):
    recipe, settings = settings_and_recipe("fsdp1_2gpu")
    assert "this config uses FSDP1" in str(compile_problems(recipe, settings, view("GPT2Block"))[0])
    monkeypatch.setenv("CXX", "/nowhere/g++")
    recipe, settings = settings_and_recipe("fsdp_2gpu")
    settings.device = Setting("cuda", Source.TARGET_HARDWARE, "this machine has no GPU")
    assert compile_problems(recipe, settings, view("LlamaDecoderLayer")) == []


def test_without_a_cpp_compiler_a_compiled_run_is_refused_before_launch(monkeypatch):
    monkeypatch.setenv("CXX", "/nowhere/g++")
    result = CliRunner().invoke(main, ["recipe", "run", "quickstart", "--set", "training.compile=true"])
    assert result.exit_code == 2, result.output
    assert "training.compile: cannot compile here: inductor builds CPU kernels with a C++ compiler" in result.output
    assert "Traceback" not in result.output


def test_a_model_compile_is_not_proven_on_is_refused_before_launch():
    result = CliRunner().invoke(main, ["recipe", "validate", "quickstart", "--set", "model.architecture=gpt_neox",
                                       "--set", "model.config_overrides={num_hidden_layers: 2, hidden_size: 64, "
                                       "num_attention_heads: 4, intermediate_size: 128}",
                                       "--set", "training.compile=true"])
    assert result.exit_code == 2, result.output
    assert "GPTNeoXForCausalLM's blocks (GPTNeoXLayer) are not ones compilation is proven on" in result.output
