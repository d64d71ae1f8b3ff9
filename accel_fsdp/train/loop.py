"""Training: runs inside every rank of a distributed launch. `setup` builds everything, `fit` is the loop.

recipe -> FSDP settings -> Accelerator (FSDP plugin) -> tokenizer, data -> model -> prepare (shard) ->
optimizer, schedule -> [resume] -> fit: for each optimizer step, accumulate micro-steps, clip, step, log,
evaluate, checkpoint -> final checkpoint, sample, export.

Loss normalization: the loss of an optimizer step is the mean over every loss-carrying token of the global
batch, however the batch is split over ranks and micro-steps. Each micro-step's loss is a token *sum* divided
by num_items_in_batch = (label tokens of the global batch) / (ranks x accumulation steps): FSDP averages
gradients over ranks and `accelerator.backward` divides by the accumulation steps, which undoes both factors.
So k micro-steps of batch b give the same update as one step of k x b (tests/test_training.py checks it).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import set_seed
from torch.distributed.tensor import DTensor

from accel_fsdp.checkpoint import store as ckpt
from accel_fsdp.data import batches
from accel_fsdp.data import prepare as data_lib
from accel_fsdp.train import probes
from accel_fsdp.train.cpu_fsdp import check_sharded, local_numel
from accel_fsdp.train.accelerator import apply_activation_checkpointing, build_accelerator, expected_shards
from accel_fsdp.errors import UserError
from accel_fsdp.train.faults import Faults, broken
from accel_fsdp.config.accelerate import (CONFIG_PATH_ENV, AccelerateConfig, FsdpSettings, check_settings,
                                      config_from_environment, detect_wrap_classes, load_accelerate_config,
                                      resolve_settings)
from accel_fsdp.train.metrics import (MetricsWriter, PeakMemory, StartupClock, device_peak_flops, flops_per_token,
                                peak_memory_bytes, perplexity, reset_peak_memory)
from accel_fsdp.model.build import build_model, count_parameters, meta_model, model_config, view_of
from accel_fsdp.model.checks import context_problems, human_count, wrap_class_problems
from accel_fsdp.model.tokenizer import build_tokenizer
from accel_fsdp.quiet import quiet_libraries
from accel_fsdp.train.lifetime import Preempted, Preemption
from accel_fsdp.run.folder import Decision, FolderLock, RunLayout, decide, prepare

TRACE_ENV = "ACCEL_FSDP_TRACE_ROWS"
"""Set to 1 to record, per rank and step, the training rows read (in <run>/trace/); used by resume tests."""


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


@dataclass
class Run:
    """Everything the loop needs, built by `setup`."""

    request: RunRequest
    settings: FsdpSettings
    accelerator: Any
    tokenizer: Any
    data: data_lib.PreparedData
    model: Any
    optimizer: Any
    scheduler: Any
    sampler: batches.GlobalBatchSampler
    total_steps: int
    start_step: int
    metrics: MetricsWriter
    layout: RunLayout
    decision: Decision
    preemption: Preemption
    locks: list
    use_position_ids: bool
    batch_layout: str
    """data.PADDED or data.PADDING_FREE (varlen flash attention), from the model's attention kernel."""
    parameters: int
    trainable_parameters: int
    flops_per_token: float
    faults: Any
    clock: StartupClock
    tokens_seen: int = 0
    last_saved_step: int | None = None
    last_eval_step: int | None = None
    peak_memory: list[int] | None = None
    """Highest per-rank peak memory of any logging window so far."""
    progress: Any = None
    """The main process's progress bar while the loop runs."""

    def say(self, text: str) -> None:
        """A line for the person at the terminal (main process only), written above the progress bar."""
        if self.accelerator.is_main_process:
            if self.progress is not None:
                self.progress.write(text)
            else:
                print(text, flush=True)


def current_accelerate_config() -> AccelerateConfig:
    """The accelerate config this rank was launched with: the file (when the CLI launched itself), else what
    `accelerate launch` exported, else none (defaults)."""
    path = os.environ.get(CONFIG_PATH_ENV)
    if path:
        return load_accelerate_config(path)
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return config_from_environment(os.environ)
    return AccelerateConfig(values={}, label="no accelerate config")


def setup(request: RunRequest) -> Run:
    clock = StartupClock()
    clock.mark("imports")
    recipe = request.recipe
    t = recipe.training
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    config = current_accelerate_config()
    settings = resolve_settings(recipe, config, cuda_available=torch.cuda.is_available(), num_processes=world,
                                num_machines=max(1, world // local_world))
    problems = check_settings(settings, recipe,
                              visible_gpus=torch.cuda.device_count() if settings.device.value == "cuda" else None)
    if problems:
        raise UserError(problems, title=f"{len(problems)} problems with this recipe on this hardware")
    accumulation = t.global_batch_size // (t.micro_batch_size * world)
    run_dir = request.run_dir
    accelerator = build_accelerator(settings, gradient_accumulation_steps=accumulation, run_dir=run_dir,
                                    trackers=recipe.logging.trackers)
    layout = RunLayout.of(recipe, run_dir)
    decision, locks = claim_run_folder(accelerator, layout, request)
    preemption = Preemption().install()
    preemption.join_group()

    # What the model is, before loading any weights: context length and wrap class are checked on a meta model.
    with accelerator.local_main_process_first():  # a tokenizer trained on the data (bpe:N): built once per machine
        tokenizer = build_tokenizer(recipe)
    model_cfg = model_config(recipe, tokenizer=tokenizer)
    skeleton = view_of(meta_model(model_cfg, recipe.model.trust_remote_code), model_cfg)
    detect_wrap_classes(settings, skeleton.no_split_modules)
    problems = context_problems(recipe, skeleton.context) + wrap_class_problems(settings, skeleton, recipe)
    if problems:
        raise UserError(problems)
    del skeleton

    if accelerator.is_main_process:
        prepare(layout, recipe, settings, decision, resumed_from=request.resume_from)
    accelerator.wait_for_everyone()
    say = accelerator.print
    what = {Decision.NEW: "new run", Decision.OVERWRITE: "replacing the run there", Decision.RESUME: "resuming",
            Decision.RESTART: "starting it again: no complete checkpoint"}[decision]
    say(f"accel-fsdp: {recipe.name} ({recipe.source}) -> {run_dir} ({what})")
    if request.verbose:
        say(f"--- resolved recipe ---\n{recipe.to_yaml().rstrip()}\n--- FSDP settings (value, source) ---\n"
            f"{settings.format()}")

    data = data_lib.prepare_data(recipe, tokenizer, accelerator)
    clock.mark("data")
    for warning in data.stats.warnings(recipe):
        say(f"warning: {warning}")
    threads = offload_threads(settings, os.environ, _usable_cores(), local_world)
    if threads:
        torch.set_num_threads(threads)  # the offloaded optimizer step runs on this rank's share of the cores
    # LoRA keeps the frozen base weights in the compute dtype (no fp32 master copy needed: they never change).
    frozen_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(settings.mixed_precision.value, torch.float32)
    # With fsdp_cpu_ram_efficient_loading only global rank 0 reads the weights; `prepare` sends every rank its
    # shards from there (accelerate/utils/fsdp_utils.py, fsdp2_load_full_state_dict; FSDP1: sync_module_states).
    rank0_only = bool(settings.cpu_ram_efficient_loading.value)
    loading = PeakMemory()
    model = build_model(recipe, model_cfg, dtype=frozen_dtype if recipe.model.lora.enabled else torch.float32,
                        empty=rank0_only and not accelerator.is_main_process)
    parameters, trainable = count_parameters(model), count_parameters(model, trainable_only=True)
    use_position_ids = "position_ids" in _forward_parameters(model)
    model_class = type(model).__name__
    batch_layout = batches.batch_layout(getattr(model.config, "_attn_implementation", None), use_position_ids)
    model = apply_activation_checkpointing(model, settings)
    clock.mark("model")

    if settings.fsdp_version.value == 1:
        # FSDP1 replaces the parameters when it wraps the model: the optimizer is built from the wrapped one.
        model = accelerator.prepare(model)
        optimizer = accelerator.prepare(build_optimizer(model, recipe, settings))
    else:
        # FSDP2 takes both at once and swaps the optimizer's parameters for the sharded DTensors.
        model, optimizer = accelerator.prepare(model, build_optimizer(model, recipe, settings))
    loading.stop()
    clock.mark("sharding")
    if not broken("unsharded"):
        check_sharded(accelerator, model, parameters, expected_shards(settings))
    shards = _shard_layout(accelerator, model)
    held = [int(row[0]) for row in shards]
    loading_growth = _gather_ints(accelerator, [loading.growth])  # collective: every rank takes part
    if accelerator.is_main_process:
        layout.sharding_file.unlink(missing_ok=True)  # a resumed or overwritten run starts it afresh
        _record_sharding(run_dir, parameters=parameters, local_parameters=held,
                         expected_shards=expected_shards(settings), strategy=settings.sharding_strategy.value,
                         ranks=_layout_rows(shards), rank0_only_loading=rank0_only,
                         loading_peak_rss_growth_bytes=loading_growth, process_group=_process_group_record())

    sampler = batches.GlobalBatchSampler(len(data.train), global_batch=t.global_batch_size,
                                          micro_batch=t.micro_batch_size, world_size=world,
                                          rank=accelerator.process_index, seed=t.seed)
    little = data_lib.too_little_data(recipe, len(data.train))
    if little:
        raise UserError(little)
    total_steps = batches.total_steps(recipe, sampler.steps_per_epoch)
    say(startup_summary(recipe, settings, layout, data, model_class, parameters, trainable, held, total_steps,
                        sampler, rank0_only))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lr_schedule(recipe, total_steps))

    run = Run(request=request, settings=settings, accelerator=accelerator, tokenizer=tokenizer, data=data,
              model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler, total_steps=total_steps,
              start_step=0, metrics=None, layout=layout, decision=decision, preemption=preemption, locks=locks,
              use_position_ids=use_position_ids, batch_layout=batch_layout,
              parameters=parameters, trainable_parameters=trainable,
              flops_per_token=flops_per_token(model_cfg, recipe.data.seq_len, trainable / max(1, parameters)),
              faults=Faults.from_env(accelerator.process_index), clock=clock)
    # Dropout and any other randomness of the loop: seeded, different on each rank, and saved in checkpoints.
    set_seed(t.seed, device_specific=True)
    if decision == Decision.RESUME or request.resume_from:
        _resume(run)
    run.metrics = MetricsWriter(accelerator, layout.metrics_file, run.start_step)
    probes.install(model, layout.trace, accelerator.process_index)
    if recipe.logging.trackers:
        from accel_fsdp.config.recipe import flatten

        accelerator.init_trackers(recipe.logging.project or recipe.name,
                                  config={k: v for k, v in flatten(recipe.to_dict()).items()
                                          if isinstance(v, (int, float, str, bool))})
    return run


def startup_summary(recipe, settings, layout: RunLayout, data, model_class: str, parameters: int, trainable: int,
                    held: list[int], total_steps: int, sampler, rank0_only: bool) -> str:
    """What a person checks before walking away: model, data, batch arithmetic, sharding, where files go. Every
    setting with its source is in fsdp_settings.json (and printed by --verbose)."""
    s, t = settings, recipe.training
    source = "from scratch" if recipe.model.architecture else \
        ("read by rank 0 only, shards sent to the others" if rank0_only else "read by every rank")
    trained = "all trainable" if trainable == parameters else f"{trainable:,} trainable (LoRA)"
    epochs = total_steps / max(1, sampler.steps_per_epoch)
    every = recipe.checkpoint.every_steps
    lines = [
        f"  model     {model_class}, {human_count(parameters)} parameters ({trained}); weights {source}",
        f"  data      {recipe.data.path}: {data.stats.summary()}",
        f"  batch     global {t.global_batch_size} = micro {t.micro_batch_size} x {sampler.W} rank(s) x "
        f"{sampler.accumulation_steps} accumulation step(s); {total_steps:,} optimizer steps ({epochs:.2f} epochs)",
        f"  sharding  FSDP{s.fsdp_version.value} {s.sharding_strategy.value} on {s.device.value}: ranks hold "
        f"{' / '.join(f'{n:,}' for n in held)} of {parameters:,} parameters; units "
        f"{', '.join(s.wrap_classes.value) or s.wrap_policy.value}; {s.mixed_precision.value} compute"
        + (f" ({s.mixed_precision.source})" if s.mixed_precision.source.startswith("detected") else "")
        + (", CPU offload" if s.cpu_offload.value else "") + (", activation checkpointing"
                                                              if s.activation_checkpointing.value else ""),
        f"  files     {layout.root}: recipe.yaml, fsdp_settings.json (every setting and its source), metrics.jsonl; "
        f"checkpoints {'every ' + str(every) + ' steps and ' if every else ''}at the end in {layout.checkpoints}",
    ]
    return "\n".join(lines)


def build_optimizer(model, recipe, settings) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay on matrices only (not on biases and norm weights).

    The fused kernel runs wherever the parameters are: on the GPU, and on the CPU (torch 2.13 has a CPU fused
    AdamW; with FSDP2 DTensor shards it measured 4x faster per step than the default foreach path on 2 CPU
    ranks), so also for CPU offload, where the step runs on the host."""
    t = recipe.training
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                             fused=fused_optimizer(settings))


def fused_optimizer(settings) -> bool:
    """The fused AdamW kernel exists for the parameters' device: CUDA, and the CPU (offloaded shards, CPU ranks)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    device = "cpu" if settings.cpu_offload.value else settings.device.value
    return device in _get_fused_kernels_supported_devices()


def offload_threads(settings, env, cores: int, local_world: int) -> int | None:
    """CPU threads of a GPU rank under CPU offload: its share of the machine's cores. torchrun (and so
    `accelerate launch`) sets OMP_NUM_THREADS=1 for every rank (torch/distributed/run.py), which would run the
    offloaded optimizer step on one core per rank. An OMP_NUM_THREADS above 1 is the user's choice and kept."""
    if not settings.cpu_offload.value or settings.device.value != "cuda":
        return None
    if env.get("OMP_NUM_THREADS", "1") not in ("", "1"):
        return None
    return max(1, cores // max(1, local_world))


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # what this process may use (cgroups, SLURM, taskset)
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def lr_schedule(recipe, total_steps: int):
    """Linear warm-up to lr, then cosine (or linear) decay to lr x min_lr_ratio at the last step."""
    t = recipe.training

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / (t.warmup_steps + 1)
        if t.scheduler == "constant":
            return 1.0
        progress = min(1.0, (step - t.warmup_steps) / max(1, total_steps - t.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if t.scheduler == "cosine" else 1 - progress
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * shape

    return factor


def claim_run_folder(acc, layout: RunLayout, request: RunRequest) -> tuple[Decision, list]:
    """The main process locks the run folder (and an outside checkpoint folder) for the life of the run, then decides
    what the start does with it; every rank gets the decision, or stops with the same error."""
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
    return Decision(outcome[0]), locks


def _resume(run: Run) -> None:
    request, recipe, acc = run.request, run.request.recipe, run.accelerator
    info = ckpt.checkpoint_to_resume(run.layout.checkpoints, request.resume_from)
    ckpt.verify_files(info, acc)  # a file damaged since it was saved is named before anything reads it
    for note in ckpt.check_resume(info, recipe, run.settings):
        run.say(f"resume: {note}")
    state = ckpt.load_checkpoint(acc, run.model, run.optimizer, run.scheduler, info, lora=recipe.model.lora.enabled)
    run.start_step = run.last_saved_step = state["step"] + broken("skip-batch")
    run.tokens_seen = state.get("tokens_seen", 0)
    run.say(f"resume: continuing from {info.path} at step {run.start_step} of {run.total_steps} "
              f"(epoch {state.get('epoch')}, {state.get('rows_consumed', 0):,} rows consumed)")


def fit(run: Run) -> None:
    """The training loop: one optimizer step per iteration, its micro-steps accumulated."""
    acc, model, optimizer, scheduler, sampler = run.accelerator, run.model, run.optimizer, run.scheduler, run.sampler
    recipe = run.request.recipe
    t, log_every = recipe.training, recipe.logging.every_steps
    world, k = acc.num_processes, sampler.accumulation_steps
    label_counts, lengths = list(run.data.train["n_labels"]), list(run.data.train["length"])  # plain lists: O(1)
    pad_id = run.tokenizer.pad_token_id
    max_norm = t.max_grad_norm if t.max_grad_norm is not None else float("inf")
    trace = _trace_file(run) if os.environ.get(TRACE_ENV) else None

    layout = run.batch_layout
    peak_flops = device_peak_flops(acc.device, run.settings.mixed_precision.value)
    normalize_globally = not broken("mean-loss")
    progress = run.progress = _progress_bar(acc, run.total_steps, run.start_step)
    window_loss = torch.zeros((), device=acc.device)
    window_norm = torch.zeros((), device=acc.device)
    window_tokens, window_steps, window_start = 0, 0, time.perf_counter()
    model.train()
    for step in range(run.start_step, run.total_steps):
        global_rows = sampler.global_rows(step)
        # Loss normalization (see the module docstring): every rank computes the global token count from the
        # dataset's per-row counts, so no communication is needed.
        num_items = max(1, sum(label_counts[i] for i in global_rows)) / (world * k) if normalize_globally else None
        micro_batches = sampler.micro_batches(step)
        for rows in micro_batches:
            batch = _to_device(batches.collate(run.data.train[rows], pad_id, run.use_position_ids, layout=layout),
                               acc.device)
            with acc.accumulate(model):
                with acc.autocast():
                    # use_cache=False: with a KV cache transformers skips the packed-document mask
                    # (masking_utils.py, _preprocess_mask_arguments needs past_key_values None; 5.23.0).
                    loss = model(**batch, num_items_in_batch=num_items, use_cache=False).loss
                acc.backward(loss)
                if acc.sync_gradients:  # the last micro-step: gradients are now reduced over ranks
                    grad_norm = acc.clip_grad_norm_(model.parameters(), max_norm)
                optimizer.step()  # skipped by Accelerate until the last micro-step
                if acc.sync_gradients and step == run.start_step:
                    _record_state_bytes(run)  # gradients and optimizer state both exist only here
                optimizer.zero_grad(set_to_none=True)
            window_loss += loss.detach()
        step_lr = advance_schedule(acc, scheduler)
        done = step + 1
        window_norm += _full(grad_norm).detach()
        step_tokens = sum(lengths[i] for i in global_rows)
        window_tokens += step_tokens
        run.tokens_seen += step_tokens
        window_steps += 1
        if trace:
            trace.write(json.dumps({"step": done, "rows": [r for rows in micro_batches for r in rows]}) + "\n")
            trace.flush()
        run.faults.after_step(done)
        if done == run.start_step + 1:
            report_startup(run, progress)

        if done % log_every == 0 or done == run.total_steps:
            # The only synchronizing point of a logging window: reduce the window's sums over ranks.
            loss_sum = acc.reduce(window_loss, reduction="sum").item()
            elapsed = time.perf_counter() - window_start
            window_peak = _gather_ints(acc, [peak_memory_bytes(acc.device)])
            run.peak_memory = [max(a, b) for a, b in zip(run.peak_memory or window_peak, window_peak)]
            row = {"kind": "train", "step": done, "loss": loss_sum / (world * k * window_steps),
                   "lr": step_lr, "grad_norm": window_norm.item() / window_steps,
                   "tokens_per_s": window_tokens / elapsed, "tokens_per_s_per_rank": window_tokens / elapsed / world,
                   "step_time_s": elapsed / window_steps, "tokens_seen": run.tokens_seen,
                   "peak_memory_bytes": window_peak, "peak_memory_bytes_run": run.peak_memory}
            if peak_flops:
                row["mfu"] = run.flops_per_token * row["tokens_per_s_per_rank"] / peak_flops
            run.metrics.write(row, done)
            if progress is not None:
                progress.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:,.0f}",
                                     **({"mfu": f"{row['mfu']:.1%}"} if "mfu" in row else {}))
            window_loss.zero_()
            window_norm.zero_()
            reset_peak_memory(acc.device)
            window_tokens, window_steps, window_start = 0, 0, time.perf_counter()
        if progress is not None:
            progress.update(1)
        if t.eval_every_steps and done % t.eval_every_steps == 0 and done != run.total_steps:
            evaluate(run, done)
        every = recipe.checkpoint.every_steps
        if every and done % every == 0 and done != run.total_steps:
            save(run, done)
        if run.preemption.agreed():
            stop_preempted(run, done, progress)
    if progress is not None:
        progress.close()
        run.progress = None
    if trace:
        trace.close()


def report_startup(run: Run, progress) -> None:
    """Time to the first optimizer step, by phase (rank 0's clock), in the metrics and on the terminal."""
    run.clock.mark("first step")
    if run.accelerator.is_main_process:
        phases = run.clock.phases()
        run.metrics.write({"kind": "startup", "step": run.start_step + 1,
                           "time_to_first_step_s": round(sum(phases.values()), 3), "phases_s": phases},
                          run.start_step + 1)
        (progress.write if progress is not None else print)(run.clock.summary())


def advance_schedule(acc, scheduler) -> float:
    """Step the LR schedule after an optimizer step; return the rate that step used. A step the fp16 grad scaler
    skipped (inf/nan gradients) does not advance it: the next step gets the rate this one would have had."""
    used = scheduler.get_last_lr()[0]
    if not acc.optimizer_step_was_skipped:
        scheduler.step()
    return used


def evaluate(run: Run, step: int) -> dict | None:
    """Mean token loss and perplexity on the held-out split, exact over ranks."""
    if run.data.eval is None or len(run.data.eval) == 0:
        return None
    acc, model = run.accelerator, run.model
    t = run.request.recipe.training
    total = torch.zeros(2, device=acc.device, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        for rows in batches.iter_eval_batches(run.data.eval, micro_batch=t.micro_batch_size,
                                               world_size=acc.num_processes, rank=acc.process_index,
                                               max_batches=t.eval_max_batches):
            dummy = rows is None  # this rank ran out of rows but must join the collective forward
            batch = batches.collate(run.data.eval[rows or [0]], run.tokenizer.pad_token_id, run.use_position_ids,
                                     layout=run.batch_layout)
            if dummy:
                batch["labels"].fill_(data_lib.IGNORE_INDEX)
            batch = _to_device(batch, acc.device)
            with acc.autocast():
                loss_sum = model(**batch, num_items_in_batch=1, use_cache=False).loss
            total[0] += loss_sum.double()
            total[1] += batches.label_count(batch["labels"])
    model.train()
    total = acc.reduce(total, reduction="sum")
    loss = (total[0] / total[1].clamp(min=1)).item()
    row = {"kind": "eval", "step": step, "eval_loss": loss, "eval_ppl": perplexity(loss),
           "eval_tokens": int(total[1].item())}
    run.metrics.write(row, step)
    run.last_eval_step = step
    run.say(f"eval @ step {step}: loss {loss:.4f}, perplexity {row['eval_ppl']:.2f} ({row['eval_tokens']:,} tokens)")
    return row


def save(run: Run, step: int) -> Path:
    recipe = run.request.recipe
    position = run.sampler.position(step)
    state = {"step": step, **position, "tokens_seen": run.tokens_seen, "total_steps": run.total_steps,
             "parameters": run.parameters, "trainable_parameters": run.trainable_parameters}
    path = ckpt.save_checkpoint(run.accelerator, run.model, run.optimizer, run.scheduler, root=run.layout.checkpoints,
                                step=step, trainer_state=state, recipe=recipe, settings=run.settings,
                                tokenizer=run.tokenizer, lora=recipe.model.lora.enabled,
                                keep_last=recipe.checkpoint.keep_last, faults=run.faults,
                                run_id=_run_id(run))
    run.last_saved_step = step
    run.say(f"checkpoint: {path}")
    return path


def stop_preempted(run: Run, step: int, progress) -> None:
    """Every rank agreed to stop after `step`: checkpoint it (unless just saved), say so, and leave resumable."""
    if progress is not None:
        progress.close()
    path = run.layout.checkpoints / ckpt.checkpoint_name(step) if run.last_saved_step == step else save(run, step)
    run.preemption.finish()
    if run.accelerator.is_main_process:
        import json as _json

        run.layout.preempted_file.write_text(_json.dumps({"step": step, "checkpoint": str(path),
                                                          "signal": run.preemption.signal_name}))
    run.accelerator.wait_for_everyone()
    ckpt.wait_for_rotations()
    raise Preempted(step, path, run.preemption.signal_name or "a signal")


def finish(run: Run) -> None:
    """Final evaluation, checkpoint, sample generation; then the main process exports the model alone."""
    acc, recipe = run.accelerator, run.request.recipe
    last = run.total_steps
    if run.request.benchmark:
        run.preemption.finish()
        acc.wait_for_everyone()
        acc.end_training()
        ckpt.wait_for_rotations()
        return
    if run.last_eval_step != last:
        evaluate(run, last)
    # Where every rank stands after training: replicas must still agree (their gradients were all-reduced).
    layout = _shard_layout(acc, run.model)
    if acc.is_main_process:
        _record_sharding(run.layout.root, ranks_after_training=_layout_rows(layout))
    if run.last_saved_step != last:
        save(run, last)
    sample = None
    if recipe.logging.sample_prompt:
        sample = generate_sample(run, recipe.logging.sample_prompt, recipe.logging.sample_max_new_tokens)
    run.preemption.finish()
    acc.wait_for_everyone()
    acc.end_training()  # closes the trackers and destroys the process group
    ckpt.wait_for_rotations()
    if not acc.is_main_process:
        return
    # Exported by the main process alone, after the other ranks have left: a long export of a large model
    # must not hold them at a barrier (and into a collective timeout).
    if recipe.checkpoint.export_final:
        from accel_fsdp.checkpoint.consolidate import consolidate

        info = ckpt.latest_complete(run.layout.checkpoints)
        report = consolidate(info, run.layout.final, dtype=recipe.checkpoint.export_dtype)
        print(f"export: {report.summary()}")
    if sample is not None:
        print(f"sample: {recipe.logging.sample_prompt!r} -> {sample!r}")
    print(f"done: {run.total_steps} steps; run folder {run.request.run_dir}")


def generate_sample(run: Run, prompt: str, max_new_tokens: int) -> str:
    """Greedy continuation with the sharded model (every rank takes part in each forward)."""
    tok, model, acc = run.tokenizer, run.model, run.accelerator
    ids = tok(prompt, return_tensors="pt")["input_ids"].to(acc.device)
    model.eval()
    with torch.no_grad(), acc.autocast():
        for _ in range(max_new_tokens):  # a fixed number of steps: every rank must run the same forwards
            logits = model(input_ids=ids).logits[:, -1, :]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    model.train()
    new = ids[0, -max_new_tokens:].tolist()
    if tok.eos_token_id in new:
        new = new[:new.index(tok.eos_token_id)]
    return tok.decode(new, skip_special_tokens=True).strip()


def run_training(request: RunRequest) -> None:
    """Entry point inside each rank."""
    quiet_libraries()
    run = setup(request)
    fit(run)
    finish(run)


# ------------------------------------------------------------------------------------------------ helpers


def _forward_parameters(model) -> set[str]:
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return set(inspect.signature(base.forward).parameters)


def _record_sharding(run_dir: Path, **fields) -> None:
    """Add fields to <run>/sharding.json (main process): what each rank holds, and what it stores."""
    path = run_dir / "sharding.json"
    info = json.loads(path.read_text()) if path.exists() else {}
    info.update(fields)
    path.write_text(json.dumps(info, indent=1) + "\n")


def _layout_rows(layout: list[list[float]]) -> list[dict]:
    return [{"rank": r, "replica": int(row[2]), "shard": int(row[3]), "checksum": row[1]}
            for r, row in enumerate(layout)]


def _shard_layout(acc, model) -> list[list[float]]:
    """Per rank: parameters held, a checksum of them, and its (replica, shard) coordinates in the device mesh.
    Replicas of one shard hold identical values; the ranks of a shard group hold different pieces."""
    checksum = sum(float((p.to_local() if isinstance(p, DTensor) else p).detach().double().sum())
                   for p in model.parameters())
    mesh = getattr(acc, "torch_device_mesh", None)
    if mesh is not None and "dp_replicate" in (mesh.mesh_dim_names or ()):
        coordinate = mesh.get_coordinate()
        names = list(mesh.mesh_dim_names)
        replica, shard = coordinate[names.index("dp_replicate")], coordinate[names.index("dp_shard")]
    else:
        replica, shard = 0, acc.process_index
    mine = torch.tensor([local_numel(model), checksum, replica, shard], device=acc.device, dtype=torch.float64)
    return acc.gather(mine).view(acc.num_processes, 4).tolist()


def state_bytes(optimizer) -> dict[str, int]:
    """Bytes this rank stores for the parameters the optimizer updates, their gradients and the optimizer state
    (local shards only), plus frozen parameters: what the memory estimate predicts per rank."""
    def local(t) -> int:
        if t is None or not isinstance(t, torch.Tensor):
            return 0
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    out = {"params": 0, "grads": 0, "optimizer": 0}
    for group in optimizer.param_groups:
        for p in group["params"]:
            out["params"] += local(p)
            out["grads"] += local(p.grad)
            out["optimizer"] += sum(local(v) for v in optimizer.state.get(p, {}).values() if getattr(v, "ndim", 0))
    return out


def _record_state_bytes(run: Run) -> None:
    acc = run.accelerator
    mine = state_bytes(run.optimizer)
    trainable = {id(p) for g in run.optimizer.param_groups for p in g["params"]}
    mine["frozen_params"] = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
                                for p in run.model.parameters() if id(p) not in trainable)
    keys = sorted(mine)
    gathered = acc.gather(torch.tensor([mine[k] for k in keys], device=acc.device, dtype=torch.int64))
    if acc.is_main_process:
        per_rank = gathered.view(acc.num_processes, len(keys)).tolist()
        _record_sharding(run.layout.root, state_bytes=[dict(zip(keys, row)) for row in per_rank])


def _full(t):
    """A DTensor's full value (clip_grad_norm_ returns one under FSDP2)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _gather_ints(acc, values: list[int]) -> list[int]:
    """`values` of every rank, concatenated in rank order (collective: every rank calls it)."""
    mine = torch.tensor(values, device=acc.device, dtype=torch.int64)
    return [int(x) for x in acc.gather(mine).tolist()]


def _to_device(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _progress_bar(acc, total: int, initial: int):
    """The main process's bar (ETA, loss, tokens/s, MFU on GPUs). Warnings and log records of the libraries are
    written above it, like our own lines, instead of being glued onto it."""
    if not acc.is_main_process:
        return None
    import logging
    import warnings

    from tqdm.auto import tqdm

    bar = tqdm(total=total, initial=initial, desc="training", unit="step", dynamic_ncols=True, mininterval=1.0)
    warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: tqdm.write(
        warnings.formatwarning(message, category, filename, lineno, line).rstrip())

    class _AboveTheBar(logging.Handler):
        def emit(self, record):
            tqdm.write(self.format(record))

    handler = _AboveTheBar()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger().handlers = [handler]
    return bar


def _process_group_record() -> dict:
    """The backends and collective timeout the default process group really has (private c10d fields, read for
    the record only: torch 2.13.0 keeps them in _world.pg_backend_config and each backend's options)."""
    import torch.distributed as dist

    group = dist.distributed_c10d._get_default_group()
    record: dict = {"world_size": dist.get_world_size()}
    try:
        record["backends"] = dist.distributed_c10d._world.pg_backend_config[group]
        record["timeout_s"] = group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, KeyError, RuntimeError):
        record["backends"] = str(dist.get_backend())
    return record


def _run_id(run: Run) -> str | None:
    from accel_fsdp.run.folder import RunIdentity

    try:
        return RunIdentity.read(run.layout.run_file).run_id
    except UserError:
        return None


def _trace_file(run: Run):
    folder = run.layout.trace
    folder.mkdir(parents=True, exist_ok=True)
    return (folder / f"rows-rank{run.accelerator.process_index}.jsonl").open("a")
