"""Everything a rank builds before its first optimizer step, in the order it happens:

recipe -> settings of this launch (checked) -> Accelerator -> run folder claimed -> tokenizer and a meta model
(checked) -> data -> model, sharded, with its optimizer -> batches and schedule -> [resume] -> the components
of the loop (metrics logger, evaluator, checkpointer, test hooks) and the training state (new, or the checkpoint's).

`start_engine`, `describe_model` and `build_sharded_model` are also the whole setup of the hand-written baseline
(tools/baseline.py): only the loop differs between the two.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import set_seed

from accel_fsdp import hardware
from accel_fsdp.config.accelerate import (
    CONFIG_PATH_ENV,
    AccelerateConfig,
    config_from_environment,
    load_accelerate_config,
)
from accel_fsdp.config.binder import flatten
from accel_fsdp.config.methods import trains_with_dropout
from accel_fsdp.config.precision import compute_dtype
from accel_fsdp.config.settings import FsdpSettings, cpu_guess_note
from accel_fsdp.data import batches
from accel_fsdp.data import prepare as data_lib
from accel_fsdp.data.identity import starting_weights_record
from accel_fsdp.data.sampler import GlobalBatchSampler, total_steps
from accel_fsdp.data.store import Sequence
from accel_fsdp.errors import UserError
from accel_fsdp.hardware import PeakMemory, usable_cores
from accel_fsdp.layout import SCRATCH_BASE_DIR, RunLayout
from accel_fsdp.model.build import (
    build_model,
    count_parameters,
    load_model_code,
    meta_model,
    model_config,
    turn_off_dropout,
    turn_off_dropout_layers,
    view_of,
    write_scratch_base,
)
from accel_fsdp.model.quantize import QuantizedBase
from accel_fsdp.model.streaming_load import adapters_to_send
from accel_fsdp.model.tokenizer import build_tokenizer, built_once_per_machine
from accel_fsdp.preflight import model_problems, settings_for_launch
from accel_fsdp.run.folder import Decision, FolderLock, apply_decision, decide
from accel_fsdp.train.accelerator import (
    apply_activation_checkpointing,
    build_accelerator,
    expected_shards,
    process_group_kwargs,
    stock_launch_gloo_interface,
)
from accel_fsdp.train.checkpointing import Checkpointer
from accel_fsdp.train.cpu_fsdp import check_sharded
from accel_fsdp.train.evaluate import Evaluator
from accel_fsdp.train import probes
from accel_fsdp.train.faults import Faults
from accel_fsdp.train.finite import FiniteSteps
from accel_fsdp.train.hooks import NO_SWITCHES, TestHooks, TestSwitches, substituted
from accel_fsdp.train.knobs import Knobs, after_sharding, before_sharding, compile_now
from accel_fsdp.train.lifetime import WHEREABOUTS, Preemption, doing, rank
from accel_fsdp.train.loading import agreed_base, leave_nf4_unsharded, load_streamed, read_digests, streams_weights
from accel_fsdp.train.methods import LossIndex, LossPath, Objective, build_loss_path, build_objective
from accel_fsdp.train.metrics import MetricsWriter, StartupClock, flops_per_token
from accel_fsdp.train.observe import Terminal, TrainLogger
from accel_fsdp.train.optimizer import build_optimizer, decayed_names, lr_schedule, offload_threads
from accel_fsdp.train.profiling import ProfileWindow, StepProfiler
from accel_fsdp.train.reference import build_reference
from accel_fsdp.train.sharding import ShardingRecord, check_same_data, check_same_layout
from accel_fsdp.train.start_summary import quantize_summary, startup_summary
from accel_fsdp.train.state import TrainingState
from accel_fsdp.train.waiting import wait_for_every_rank


@dataclass
class RunRequest:
    recipe: Any
    run_dir: Path
    resume: str | None = None
    """None, "latest" (--resume) or "auto" (--resume auto)."""
    verbose: bool = False
    """Print the resolved recipe and every FSDP setting with its source at start."""
    resume_from: str | None = None
    overwrite: bool = False
    benchmark: bool = False
    """accel-fsdp bench: skip the final evaluation, checkpoint, sample and export."""
    cpu: bool = False
    """--cpu: run the accelerate config on CPU ranks whatever it was written for."""
    accept_data_change: bool = False
    """--accept-data-change: resume although a data source changed since the checkpoint."""
    profile: ProfileWindow | None = None
    """--profile K-L: torch's profiler over optimizer steps K to L (train/profiling.py)."""


@dataclass
class Engine:
    """The settings of this launch, checked, and the Accelerator built from them."""

    settings: FsdpSettings
    accelerator: Any
    world: int
    local_world: int
    notes: list[str] = dataclasses.field(default_factory=list)
    """What the main process says about these settings once the run starts (e.g. CPU ranks by default)."""


@dataclass
class ShardedModel:
    """The model after `accelerator.prepare`, its optimizer, and what the loop needs to know about it."""

    model: Any
    optimizer: Any
    parameters: int
    trainable_parameters: int
    model_class: str
    use_position_ids: bool
    batch_layout: str
    """data.PADDED or data.PADDING_FREE (varlen flash attention), from the model's attention kernel."""
    rank0_only_loading: bool
    loading_growth: int
    """This rank's peak resident-memory growth while the weights were loaded and sharded."""
    knobs: Knobs
    """What fp8, compile and activation offloading did to the model (train/knobs.py)."""
    loading_baseline: int = 0
    """This rank's resident memory when the loading began (what `loading_growth` grows from)."""
    quantized_base: QuantizedBase | None = None
    """What the 4-bit base is (model.quantize), agreed on by every rank: saved in checkpoints, checked on resume."""


@dataclass(frozen=True)
class Run:
    """Everything the loop needs, built by `setup` and read-only afterwards."""

    request: RunRequest
    settings: FsdpSettings
    accelerator: Any
    tokenizer: Any
    data: data_lib.PreparedData
    model: Any
    optimizer: Any
    scheduler: Any
    sampler: GlobalBatchSampler
    total_steps: int
    layout: RunLayout
    preemption: Preemption
    terminal: Terminal
    use_position_ids: bool
    batch_layout: str
    parameters: int
    trainable_parameters: int
    flops_per_token: float
    clock: StartupClock
    sharding: ShardingRecord
    collator: Callable[[list[Sequence]], dict]
    """Sequences -> the batch's tensors on the CPU, in the layout the attention kernel needs (data/batches.py)."""
    knobs: Knobs
    """The speed and memory knobs of the model and its micro-steps (train/knobs.py)."""
    loss_path: LossPath
    """How log-probabilities are read from the model: chunked from the hidden states, or the full logits
    (train/methods/logps.py)."""
    objective: Objective | None = None
    """What a micro-step's loss is, what it logs and how it evaluates (train/methods/), with its reference."""

    @property
    def recipe(self):
        return self.request.recipe

    def say(self, text: str) -> None:
        """A line for the person at the terminal (main process only), written above the progress bar."""
        self.terminal.say(text)

    def batch(self, units: list[int]) -> dict:
        """The tensors of these training units (global unit ids) on this rank's device (see `batch_of`)."""
        return self.batch_of([self.data.split(u) for u in units], "train")

    def batch_of(self, where: list[tuple[int, int]], split: str) -> dict:
        """The one batch builder, for training and held-out evaluation alike: the units `where` (source index, unit
        of that source's `split` table) as tensors on this rank's device, their sequences (a pair's chosen and
        rejected side by side), and the reference log-probabilities the method's reference attaches."""
        batch = self.collate([s for i, j in where for s in self.data.sources[i].sequences(j, split)])
        self.objective.reference.attach(batch, where, split)
        return batch

    def collate(self, sequences: list[Sequence]) -> dict:
        """Sequences as tensors on this rank's device, in the layout the attention kernel needs, with the index of
        their loss-carrying positions (computed here, on the host: the micro-step never asks the device for one).
        On a GPU the tensors are pinned first, so the copies are asynchronous (from pageable memory a copy makes the
        host wait)."""
        batch = self.collator(sequences)
        batch["loss_index"] = LossIndex.of(batch)
        device = self.accelerator.device
        pin = device.type == "cuda"
        return {k: (v.pin_memory() if pin else v).to(device, non_blocking=True) if hasattr(v, "pin_memory") else v
                for k, v in batch.items()}

    def norm(self, units: list[int]):
        """What every micro-step of an optimizer step over the global batch `units` divides its loss sums by: the
        global batch's counts / (ranks x accumulation steps), from the per-sequence counts the data stores, so no
        communication is needed (see train/loop.py and train/methods/base.py)."""
        return self.objective.norm(self.data, units, self.accelerator.num_processes,
                                   self.sampler.accumulation_steps)

    def step_tokens(self, units: list[int]) -> int:
        return sum(self.data.length(u) for u in units)


@dataclass(frozen=True)
class Components:
    """The parts of the loop that own a cadence (train/observe.py, evaluate.py, checkpointing.py) and the test
    hooks (hooks.py); each keeps its own state and reads the run's."""

    logger: TrainLogger
    evaluator: Evaluator
    checkpointer: Checkpointer
    hooks: TestHooks
    profiler: StepProfiler
    finite: FiniteSteps
    """Stops the run at a step whose gradients are not finite, before the step."""


def current_accelerate_config() -> AccelerateConfig:
    """The accelerate config this rank was launched with: the file (when the CLI launched itself), else what
    `accelerate launch` exported, else none (defaults)."""
    path = os.environ.get(CONFIG_PATH_ENV)
    if path:
        return load_accelerate_config(path)
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return config_from_environment(os.environ)
    return AccelerateConfig(values={}, label="no accelerate config")


def start_engine(recipe, *, run_dir: Path | None, trackers=(), switches: TestSwitches = NO_SWITCHES,
                 cpu: bool = False) -> Engine:
    """Settings of this launch (checked like `recipe validate` does, now on the real GPUs), then the Accelerator.
    `cpu`: the config on CPU ranks whatever it was written for (--cpu)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    interface, note = stock_launch_gloo_interface(os.environ, max(1, world // local_world),
                                                  hardware.network_interfaces)
    if interface:
        os.environ["GLOO_SOCKET_IFNAME"] = interface  # before the process group: gloo reads it then
    if note and os.environ.get("LOCAL_RANK", "0") == "0":  # no Accelerator yet: each machine says its own, once
        print(f"note: {note}", file=sys.stderr, flush=True)
    config = current_accelerate_config()
    if cpu:
        config.values["use_cpu"] = True
    settings = settings_for_launch(recipe, config, cuda_available=torch.cuda.is_available(),
                                   num_processes=world, num_machines=max(1, world // local_world))
    accelerator = build_accelerator(settings, gradient_accumulation_steps=recipe.training.accumulation_steps(world),
                                    run_dir=run_dir, trackers=trackers,
                                    reduce_dtype=torch.bfloat16 if switches.broken("bf16-reduce") else torch.float32,
                                    shard_cpu_ranks=not switches.broken("unsharded"))
    note = cpu_guess_note(settings, config, hardware.cuda_unavailable_reason)
    return Engine(settings, accelerator, world, local_world, notes=[note] if note else [])


def describe_model(recipe, engine: Engine):
    """The tokenizer and the model's config; the model is checked on the meta device before any weight is read."""
    # A tokenizer trained on the data (bpe:N) or downloaded is made once per machine, by its first rank, for as long
    # as that takes: the others wait for it in the store (train/waiting.py), not in a collective that it could
    # outlast. One only read (built in, a local folder) every rank loads at once: waiting for it serialized the ranks'
    # first import of transformers' tokenizer code (a second or more); its mistakes every rank finds, said once.
    acc, tokenizer, error = engine.accelerator, None, None
    if built_once_per_machine(recipe):
        if acc.is_local_main_process:
            try:
                tokenizer = build_tokenizer(recipe)
            except UserError as e:
                e.rank_local, error = not acc.is_main_process, e
        wait_for_every_rank(acc, "tokenizer", "build the tokenizer", error)
    if tokenizer is None:
        tokenizer = build_tokenizer(recipe)  # read, or from the cache this machine's first rank wrote
    config = model_config(recipe, tokenizer=tokenizer)
    problems = model_problems(recipe, engine.settings, view_of(meta_model(config, recipe.model.trust_remote_code),
                                                               config))
    if problems:
        raise UserError(problems)
    return tokenizer, config


def build_sharded_model(recipe, engine: Engine, config, clock: StartupClock | None = None,
                        switches: TestSwitches = NO_SWITCHES) -> ShardedModel:
    """Weights (read by global rank 0 only when the settings say so), LoRA, activation checkpointing, then
    `accelerator.prepare`: the model sharded and its optimizer over the shards."""
    settings, accelerator = engine.settings, engine.accelerator
    threads = offload_threads(settings, os.environ, usable_cores(), engine.local_world)
    if threads:
        torch.set_num_threads(threads)  # the offloaded optimizer step runs on this rank's share of the cores
    # LoRA keeps the frozen base weights in the compute dtype (no fp32 master copy needed: they never change).
    frozen_dtype = compute_dtype(settings.mixed_precision.value) if recipe.model.lora.enabled else torch.float32
    # With fsdp_cpu_ram_efficient_loading only global rank 0 reads the weights: under FSDP2 it streams each rank its
    # shards once `prepare` has cut them (train/loading.py); under FSDP1 `prepare` broadcasts (sync_module_states).
    rank0_only, streaming = bool(settings.cpu_ram_efficient_loading.value), streams_weights(settings)
    load_model_code(recipe, config, frozen_dtype)  # the code's memory before the loading's is measured
    loading = PeakMemory()
    model = build_model(recipe, config, dtype=frozen_dtype,
                        empty=streaming or (rank0_only and not accelerator.is_main_process),
                        draw=not streaming or accelerator.is_main_process)
    if rank0_only and not streaming and accelerator.num_processes > 1:
        check_same_layout(accelerator, model, recipe)  # before rank 0 sends a single weight
    digests = None if streaming else read_digests(accelerator, model, recipe)
    parameters, trainable = count_parameters(model), count_parameters(model, trainable_only=True)
    use_position_ids = "position_ids" in _forward_parameters(model)
    model_class = type(model).__name__
    batch_layout = batches.batch_layout(getattr(model.config, "_attn_implementation", None), use_position_ids)
    # fp8 layers, compiled blocks: before checkpointing wraps them
    knobs = before_sharding(model, recipe, settings, lossy_compile=switches.broken("compile-skew"))
    model = apply_activation_checkpointing(model, settings, preserve_rng_state=not switches.broken("ac-rng"))
    if clock is not None:
        clock.mark("model")
    # rank 0's drawn adapters, whole, for the stream (the other ranks' are unwritten)
    adapters = adapters_to_send(model) if streaming and accelerator.is_main_process else None
    if settings.fsdp_version.value == 1:
        # FSDP1 replaces the parameters when it wraps the model: the optimizer is built from the wrapped one, the
        # parameters it decays chosen by their shapes before wrapping flattens them.
        decayed = decayed_names(model)
        model = accelerator.prepare(model)
        optimizer = accelerator.prepare(build_optimizer(model, recipe, settings, decayed))
    else:
        # FSDP2 takes both at once and swaps the optimizer's parameters for the sharded DTensors.
        leave_nf4_unsharded(accelerator, model, settings)
        model, optimizer = accelerator.prepare(model, build_optimizer(model, recipe, settings))
    if streaming:
        digests = load_streamed(accelerator, model, recipe, config, frozen_dtype, block_elements=switches.load_block,
                                adapters=adapters)
        del adapters
    loading.stop()
    knobs = after_sharding(knobs, recipe, model, optimizer, accelerator.device,
                           lossy_offload=switches.broken("offload-bf16"))
    if clock is not None:
        clock.mark("sharding")
    if not switches.broken("unsharded"):
        check_sharded(accelerator, model, parameters, expected_shards(settings))
    return ShardedModel(model, optimizer, parameters, trainable, model_class, use_position_ids, batch_layout,
                        rank0_only, loading.growth, knobs, loading.baseline,
                        quantized_base=agreed_base(accelerator, recipe, digests, frozen_dtype))


def setup(request: RunRequest) -> tuple[Run, Components, TrainingState]:
    """Everything a rank builds before its first optimizer step, in the order of the module docstring."""
    clock = StartupClock()
    clock.mark("imports")
    # The one read of the test switches (fault injection, `verify`'s broken properties): below, plain parameters or
    # substituted parts (train/hooks.py).
    switches = TestSwitches.from_env()
    Faults(switches.fault, rank()).at_start()
    recipe = request.recipe
    doing("the creation of the process group")
    engine = start_engine(recipe, run_dir=request.run_dir, trackers=recipe.logging.trackers, switches=switches,
                          cpu=request.cpu)
    WHEREABOUTS.timeout_minutes = engine.settings.collective_timeout_minutes.value
    doing("the claim of the run folder (rank 0 decides, the others wait)")
    layout = RunLayout.of(recipe, request.run_dir)
    WHEREABOUTS.folders = tuple(dict.fromkeys((layout.root, layout.checkpoints)))
    decision = claim_run_folder(engine.accelerator, layout, request)
    preemption = Preemption().install()
    preemption.join_group(timeout=process_group_kwargs(engine.settings)["timeout"])
    doing("the tokenizer and the model's description (the first rank of each machine builds a tokenizer, the others "
          "wait)")
    tokenizer, config = describe_model(recipe, engine)
    # Before the model is built from the config: dropout of a method that trains without it (config/methods.py).
    dropout_off = {} if trains_with_dropout(recipe) else turn_off_dropout(config)
    terminal = open_run_folder(request, engine, layout, decision)
    doing("the data preparation (the first rank of each machine builds it, the others wait)")
    data = prepare_run_data(recipe, tokenizer, engine.accelerator, terminal, switches)  # before any weight is read
    clock.mark("data")
    for warning in data.stats.warnings(recipe):
        terminal.say(f"warning: {warning}")
    doing("the loading and sharding of the model")
    built = build_sharded_model(recipe, engine, config, clock, switches)
    if not trains_with_dropout(recipe):
        dropout_off.update(turn_off_dropout_layers(built.model))  # LoRA's, and any a config key did not reach
    sharding = ShardingRecord.measure(engine.accelerator, built, engine.settings)  # collective
    if recipe.model.architecture and recipe.model.quantize:
        name_scratch_base(engine, recipe, config, tokenizer, built.model, layout.root / SCRATCH_BASE_DIR)
    if engine.accelerator.is_main_process:
        sharding.write(layout.sharding_file)  # a resumed or overwritten run starts it afresh
    run = build_run(request, engine, config, tokenizer, data, built, layout=layout, preemption=preemption,
                    terminal=terminal, clock=clock, sharding=sharding)
    run = substituted(with_objective(run, config), switches)
    if run.knobs.compiled is not None:
        doing("the compilation of the blocks (the first micro-step, run once)")
        compile_now(run)
        clock.mark("compile")
    terminal.say(startup_summary(recipe, engine.settings, layout, data, built, sharding.local_parameters,
                                 run.total_steps, run.sampler, run.objective, dropout_off)
                 + quantize_summary(recipe, sharding))
    # Dropout and any other randomness of the loop: seeded, different on each rank, and saved in checkpoints.
    set_seed(recipe.training.seed, device_specific=True)
    parts = build_components(run, switches)
    state = TrainingState()
    if decision == Decision.RESUME or request.resume_from:
        doing("the resume from a checkpoint")
        state = parts.checkpointer.resume(request.resume_from, accept_data_change=request.accept_data_change)
        parts.hooks.after_resume(state)
    evaluated = parts.logger.metrics.start_at(state.step)
    if state.step and state.step >= run.total_steps:
        parts.evaluator.resumed_at_end(state.step, evaluated)
    if recipe.logging.trackers:
        engine.accelerator.init_trackers(recipe.logging.project or recipe.name,
                                         config={k: v for k, v in flatten(recipe.to_dict()).items()
                                                 if isinstance(v, (int, float, str, bool))})
    return run, parts, state


def open_run_folder(request: RunRequest, engine: Engine, layout: RunLayout, decision: Decision) -> Terminal:
    """The main process writes the run folder's records for this start; the terminal says what the start does."""
    recipe, accelerator = request.recipe, engine.accelerator
    if accelerator.is_main_process:
        apply_decision(layout, recipe, engine.settings, decision, resumed_from=request.resume_from)
    accelerator.wait_for_everyone()
    terminal = Terminal(accelerator)
    what = {Decision.NEW: "new run", Decision.OVERWRITE: "replacing the run there", Decision.RESUME: "resuming",
            Decision.RESTART: "starting it again: it saved no checkpoint"}[decision]
    terminal.say(f"accel-fsdp: {recipe.name} ({recipe.source}) -> {request.run_dir} ({what})")
    for note in engine.notes:
        terminal.say(note)
    if request.verbose:
        terminal.say(f"--- resolved recipe ---\n{recipe.to_yaml().rstrip()}\n--- FSDP settings (value, source) ---\n"
                     f"{engine.settings.format()}")
    return terminal


def build_run(request: RunRequest, engine: Engine, config, tokenizer, data, built: ShardedModel, **parts) -> Run:
    """The run of this rank: the batch order and the schedule over the data (checked to fill a global batch by
    `prepare_run_data`, before any weight was read), and what was built before (`parts`: layout, preemption,
    terminal, clock, sharding). Its objective comes next (`with_objective`)."""
    recipe, accelerator = request.recipe, engine.accelerator
    sampler = data.sampler(recipe.training, world_size=engine.world, rank=accelerator.process_index)
    steps = total_steps(recipe, len(data))
    scheduler = torch.optim.lr_scheduler.LambdaLR(built.optimizer, lr_lambda=lr_schedule(recipe, steps))
    fpt = flops_per_token(config, recipe.data.seq_len, built.trainable_parameters / max(1, built.parameters))
    collator = functools.partial(batches.collate, pad_id=tokenizer.pad_token_id,
                                 use_position_ids=built.use_position_ids, layout=built.batch_layout)
    return Run(request=request, settings=engine.settings, accelerator=accelerator, tokenizer=tokenizer, data=data,
               model=built.model, optimizer=built.optimizer, scheduler=scheduler, sampler=sampler, total_steps=steps,
               use_position_ids=built.use_position_ids, batch_layout=built.batch_layout, collator=collator,
               loss_path=build_loss_path(recipe, built.model), parameters=built.parameters,
               trainable_parameters=built.trainable_parameters, flops_per_token=fpt, knobs=built.knobs, **parts)


def with_objective(run: Run, config) -> Run:
    """The run with its objective: what a micro-step's loss is, and the reference its batches get (a full DPO run's
    reference log-probabilities are computed here, before any checkpoint is loaded: the model holds the starting
    weights; a resumed run reads them, or computes them again when the cache lost them)."""
    doing("the reference (log-probabilities computed once, by every rank, where the method needs them)")
    reference = build_reference(run, run.settings)
    if reference.kind == "precomputed":
        run.clock.mark("reference")
    fpt = run.flops_per_token
    if reference.extra_forward:
        fpt += flops_per_token(config, run.recipe.data.seq_len) / 3  # one more forward (2N of 6N) per micro-step
    return dataclasses.replace(run, objective=build_objective(run.recipe, reference, run.loss_path),
                               flops_per_token=fpt)


def build_components(run: Run, switches: TestSwitches) -> Components:
    """The loop's components, each from what it uses: the test hooks, the logger and its metrics file, the
    evaluator, the checkpointer (which saves the logger's window with the training state)."""
    acc, recipe = run.accelerator, run.recipe
    hooks = TestHooks(switches, accelerator=acc, model=run.model, optimizer=run.optimizer, sampler=run.sampler,
                      sharding=run.sharding, layout=run.layout,
                      packing_probe=functools.partial(probes.packing, run.model, acc, run.data, run.collate,
                                                      run.batch_layout), knobs=run.knobs)
    metrics = MetricsWriter(acc, run.layout.metrics_file)
    logger = TrainLogger(acc, run.terminal, metrics, run.clock, every_steps=recipe.logging.every_steps,
                         total_steps=run.total_steps, accumulation_steps=run.sampler.accumulation_steps,
                         precision=run.settings.mixed_precision.value, flops_per_token=run.flops_per_token,
                         tokens_by_source=run.data.tokens_by_source, statistics=run.objective.statistics)
    checkpointer = Checkpointer(accelerator=acc, model=run.model, optimizer=run.optimizer, scheduler=run.scheduler,
                                sampler=run.sampler, logger=logger, recipe=recipe, settings=run.settings,
                                tokenizer=run.tokenizer, layout=run.layout, terminal=run.terminal,
                                preemption=run.preemption, total_steps=run.total_steps, parameters=run.parameters,
                                trainable_parameters=run.trainable_parameters, data_identity=run.data.identity,
                                faults=hooks.faults, quantized_base=run.sharding.quantized_base,
                                # read by the process that writes the manifest alone (checkpoint/store.py)
                                starting_weights=starting_weights_record(recipe) if acc.is_main_process else None)
    profiler = StepProfiler(run.request.profile, folder=run.layout.profile, rank=acc.process_index,
                            device_type=acc.device.type, say=run.terminal.say)
    finite = FiniteSteps(acc, run.model, recipe, accumulation_steps=run.sampler.accumulation_steps,
                         scaled=acc.scaler is not None, newest_checkpoint=checkpointer.newest_checkpoint,
                         started_from=checkpointer.started_from, optimizer=run.optimizer,
                         wait_for_checkpointer=checkpointer.wait)
    return Components(logger=logger, evaluator=Evaluator(run, metrics), checkpointer=checkpointer, hooks=hooks,
                      profiler=profiler, finite=finite)


def name_scratch_base(engine: Engine, recipe, config, tokenizer, model, folder: Path) -> None:
    """A 4-bit base built from scratch has no model files: the main process writes them into the run folder
    (model/build.py `write_scratch_base`), and the adapters name that folder as their base, so that
    `checkpoint consolidate --merge` needs nothing else."""
    if engine.accelerator.is_main_process:
        dtype = compute_dtype(engine.settings.mixed_precision.value)
        write_scratch_base(recipe, config, dtype, tokenizer, folder)
    unwrapped = engine.accelerator.unwrap_model(model)
    if hasattr(unwrapped, "peft_config"):
        unwrapped.peft_config["default"].base_model_name_or_path = str(folder)


def prepare_run_data(recipe, tokenizer, accelerator, terminal: Terminal,
                     switches: TestSwitches = NO_SWITCHES) -> data_lib.PreparedData:
    """The data of the run (data/prepare.py `prepare_data`, the path of `data prepare` and of the checks before the
    launch): the first rank of each machine builds what the cache lacks, for as long as that takes, while the others
    wait in the store (train/waiting.py); a failure there stops every rank, its message shown once."""

    def wait(error: UserError | None) -> None:
        if error is not None:
            error.rank_local = not accelerator.is_main_process  # another machine's builder: it says why
        wait_for_every_rank(accelerator, "data", "prepare the data", error, say=terminal.say)

    data = data_lib.prepare_data(recipe, tokenizer, build=accelerator.is_local_main_process, wait=wait,
                                 delay=switches.slow_data, say=terminal.say)
    check_same_data(accelerator, data)  # each machine prepared its own
    return data


def claim_run_folder(acc, layout: RunLayout, request: RunRequest) -> Decision:
    """The main process locks the run folder (and an outside checkpoint folder) for the life of the process (the
    kernel releases a flock when its holder exits or dies), then decides what the start does with it; every rank
    gets the decision, or stops with the same error."""
    from accelerate.utils import broadcast_object_list

    outcome: list = [None]
    locks: list[FolderLock] = []
    error: UserError | None = None
    if acc.is_main_process:
        try:
            locks.append(FolderLock(layout.root).acquire("run folder"))
            if layout.external_checkpoints:
                locks.append(FolderLock(layout.checkpoints).acquire("checkpoint folder"))
            outcome = [decide(layout, request.recipe, resume=request.resume, resume_from=request.resume_from,
                              overwrite=request.overwrite).value]
        except UserError as e:
            for lock in locks:
                lock.release(remove_if_created=True)
            error, outcome = e, ["error: " + e.format_message()]
    if acc.num_processes > 1:
        broadcast_object_list(outcome, from_process=0)
    if error is not None:
        raise error
    if outcome[0].startswith("error: "):
        raise UserError(outcome[0].removeprefix("error: "))
    return Decision(outcome[0])


def _forward_parameters(model) -> set[str]:
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return set(inspect.signature(base.forward).parameters)


__all__ = ["RunRequest", "Run", "TrainingState", "Components", "Engine", "ShardedModel", "setup", "start_engine",
           "describe_model", "build_sharded_model", "current_accelerate_config", "claim_run_folder",
           "prepare_run_data"]
