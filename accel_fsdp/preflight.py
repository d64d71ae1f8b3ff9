"""Everything that can be checked before a single process is launched, offline.

`recipe validate` runs exactly this; `recipe run` runs it before launching, so a user's mistake (a wrap class the
model lacks, a global batch that does not divide, a seq_len above the context, a data file without the text
field) is reported once, from one process, in seconds, with exit status 2, instead of from every rank after
the launch. It never downloads: hub models are answered from the known architectures table or the local
cache, and what cannot be checked offline is listed as a note.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from accel_fsdp import hardware
from accel_fsdp.checkpoint.index import check_resume, checkpoint_to_resume
from accel_fsdp.config import precision
from accel_fsdp.config.accelerate import AccelerateConfig, load_accelerate_config
from accel_fsdp.config.settings import (
    MODEL_DEFAULT,
    FsdpSettings,
    Setting,
    Source,
    check_settings,
    cuda_problems,
    detect_wrap_classes,
    gpu_count_problems,
    idle_gpu_note,
    resolve_settings,
    shard_group_size,
)
from accel_fsdp.config.shipped import shipped_accelerate_configs
from accel_fsdp.data import prepare as data_lib
from accel_fsdp.data.sampler import total_steps
from accel_fsdp.data.sources import ineffective_settings, locate, source_key
from accel_fsdp.errors import Problem, UserError
from accel_fsdp.layout import RunLayout
from accel_fsdp.model import checks as model_checks
from accel_fsdp.model import facts as model_facts
from accel_fsdp.model.compile import compile_problems
from accel_fsdp.model.fp8 import FP8, fp8_problems
from accel_fsdp.model.hub import hub_problems
from accel_fsdp.model.tokenizer import is_local, offline_tokenizer
from accel_fsdp.run.folder import Decision, decide, lock_problems, writable_problems


@dataclass
class PreflightReport:
    settings: FsdpSettings
    config: AccelerateConfig
    num_processes: int
    parameters: int | None = None
    model_class: str | None = None
    notes: list[str] = field(default_factory=list)
    data_stats: object | None = None
    """What preparing the data found (data/prepare.py DataStats), when it could be prepared here."""
    total_steps: int | None = None
    """Optimizer steps the run will take: training.max_steps, or from the data when it could be prepared here."""


def default_accelerate_config() -> tuple[Path, int | None, str]:
    """(config file, number of processes to override, why): 2 CPU ranks without a GPU, else one per local GPU."""
    shipped = shipped_accelerate_configs()
    n = hardware.visible_cuda_devices()
    if n:
        return shipped["fsdp_1gpu"], n, f"{n} local GPU(s) detected"
    return shipped["fsdp_cpu"], None, "no GPU detected"


def preflight(recipe, config: AccelerateConfig, *, num_processes: int | None = None, check_data: bool = True,
              run_dir: Path | None = None, resume: str | None = None, resume_from: str | None = None,
              overwrite: bool = False, for_target_hardware: bool = False, check_hub: bool = False,
              cpu_option: bool = False, accept_data_change: bool = False,
              check_weights: bool = False) -> PreflightReport:
    """Check recipe x accelerate config x model x data; raise one UserError listing every problem. (Long: the stages
    in the order they run, each a call; they gather problems into one list.)

    `for_target_hardware`: judge the config on the hardware it is written for (GPUs unless it says use_cpu),
    not on this machine: `recipe validate` of a GPU config on a laptop. `cpu_option`: the command has `--cpu`, which
    a refusal of a GPU config may then suggest. `check_weights`: read a local model folder's weight files' headers
    against the model (`recipe validate`; a run's ranks check them as they load)."""
    cuda_here = hardware.visible_cuda_devices()
    cuda = bool(cuda_here) or (for_target_hardware and not config.uses_cpu())
    settings = resolve_settings(recipe, config, cuda_available=cuda, num_processes=num_processes)
    if for_target_hardware and cuda and not cuda_here:
        settings.device = Setting(settings.device.value, Source.TARGET_HARDWARE, "this machine has no GPU")
    report = PreflightReport(settings=settings, config=config, num_processes=settings.num_processes.value,
                             total_steps=recipe.training.max_steps)
    theirs = config.get("mixed_precision")
    ours = recipe.training.mixed_precision
    if ours and theirs is not None and precision.FROM_ACCELERATE.get(str(theirs), ours) != ours:
        report.notes.append(f"{recipe.where('training.mixed_precision')}: {ours} is used; {config.label} says "
                            f"mixed_precision: {theirs} (the recipe's key wins)")
    here = cuda_here or None
    problems: list[Problem] = list(check_settings(settings, recipe, visible_gpus=None if for_target_hardware else here))
    if not for_target_hardware:  # about to run here: a GPU config must find CUDA
        problems += cuda_problems(settings, config, hardware.cuda_unavailable_reason, cpu_option=cpu_option)
    if here is not None:
        if for_target_hardware:  # judged for other hardware: what this machine would do is only a note
            report.notes += [f"on this machine: {p.message}" for p in gpu_count_problems(settings, here)]
        note = idle_gpu_note(settings, here)
        if note:
            report.notes.append(note)
    if run_dir is not None:
        layout = RunLayout.of(recipe, run_dir)
        locked, unwritable = lock_problems(layout), writable_problems(layout)
        problems += locked + unwritable
        if not locked and not unwritable:  # one message per mistake: a folder that cannot be written is enough
            try:
                decision = decide(layout, recipe, resume=resume, resume_from=resume_from, overwrite=overwrite)
                if decision == Decision.RESUME or resume_from:
                    report.notes += _check_resume(recipe, settings, layout, resume_from, accept_data_change)
                elif decision == Decision.RESTART:
                    report.notes.append(f"--resume auto: {layout.root} holds this run, which saved no "
                                        "checkpoint; starting it again")
            except UserError as e:
                problems += e.problems

    problems += _tracker_problems(recipe)
    if check_hub:  # about to launch: a hub id this machine cannot get stops here, once, not in every rank
        problems += hub_problems(recipe)
    try:
        view = model_view(recipe)
    except UserError as e:
        problems += e.problems
        view = None
    if view is None and not problems:
        report.notes.append(f"model {recipe.model.name_or_path!r} is not a known architecture and not in the local "
                            "cache: wrap class and context length are checked when training starts")
    if view is not None:
        report.model_class, report.parameters = view.class_name, view.params
        problems += model_problems(recipe, settings, view)
        if check_weights and not problems and model_checks.weights_header_folder(recipe) is not None:
            from accel_fsdp.model.build import weights_fit_problems  # imports torch: for a local folder alone

            problems += weights_fit_problems(recipe)

    if check_data and not problems:
        problems += _check_data(recipe, report)
    if problems:
        raise UserError(problems, title=f"{len(problems)} problems found before launching")
    report.notes += _cadence_notes(recipe, report.total_steps)
    return report


def _cadence_notes(recipe, steps: int | None) -> list[str]:
    """A cadence no step of the run reaches does nothing but what the end does anyway: said, not refused (a recipe
    may be shortened with --set training.max_steps on purpose)."""
    if not steps:
        return []
    out = []
    for key, every, what in (("checkpoint.every_steps", recipe.checkpoint.every_steps, "the final checkpoint alone is "
                              "saved"), ("training.eval_every_steps", recipe.training.eval_every_steps,
                                         "evaluation runs at the end alone")):
        if every is not None and every >= steps:
            out.append(f"{recipe.where(key)}: {every:,} is not below the run's {steps:,} optimizer steps: {what}")
    return out


# The stages of the check pipeline that the ranks run again on what they really built (train/setup.py, and so the
# baseline): the settings of this launch, then the model against them.


def settings_for_launch(recipe, config: AccelerateConfig, *, cuda_available: bool, num_processes: int,
                        num_machines: int) -> FsdpSettings:
    """The settings of the launch this process is part of, checked against this machine's GPUs."""
    settings = resolve_settings(recipe, config, cuda_available=cuda_available, num_processes=num_processes,
                                num_machines=num_machines)
    gpus = hardware.visible_cuda_devices() if settings.device.value == "cuda" else None
    problems = check_settings(settings, recipe, visible_gpus=gpus)
    problems += cuda_problems(settings, config, hardware.cuda_unavailable_reason)
    if problems:
        raise UserError(problems, title=f"{len(problems)} problems with this recipe on this hardware")
    return settings


def model_problems(recipe, settings: FsdpSettings, view) -> list[Problem]:
    """The model (facts or a meta-device build) against the recipe and the settings: context length, wrap class
    (detected from the model when no config names one), LoRA targets, the layers a quantized base holds in 4 bits,
    and whether the knobs the recipe turns on (compile, fp8) can run on this model and machine."""
    detect_wrap_classes(settings, view.no_split_modules)
    here = settings.device.value == "cuda" and settings.device.source != Source.TARGET_HARDWARE
    # The GPUs' capability only where fp8 asks for it: reading it initializes CUDA, which nothing else here needs.
    capability = hardware.cuda_capability() if here and settings.mixed_precision.value == FP8 else None
    return (model_checks.context_problems(recipe, view.context)
            + wrap_class_problems(settings, view, recipe)
            + model_checks.lora_target_problems(view, recipe)
            + model_checks.quantize_problems(view, recipe, shard_group_size(settings),
                                             remote_code=recipe.model.trust_remote_code)
            + compile_problems(recipe, settings, view)
            + fp8_problems(recipe, settings, view, capability))


VERIFY_BEFORE_LAUNCH_BYTES = 2 << 30
"""Checkpoints up to this size have their checksums verified before launching (the ranks verify every one)."""


def _tracker_problems(recipe) -> list[Problem]:
    """Trackers are optional packages: say which one is missing and how to get it, before launching."""
    import importlib.util

    packages = {"tensorboard": ("tensorboard", 'pip install "accel-fsdp[tensorboard]"'),
                "wandb": ("wandb", "pip install wandb (and `wandb login`, or WANDB_MODE=offline)")}
    out = []
    for tracker in recipe.logging.trackers:
        module, fix = packages[tracker]
        if importlib.util.find_spec(module) is None:
            out.append(Problem(recipe.where("logging.trackers"), f"tracker {tracker!r} needs the {module} package, "
                               "which is not installed", fix))
    return out


def _check_resume(recipe, settings, layout, resume_from: str | None, accept_data_change: bool) -> list[str]:
    """The checkpoint to resume exists, is complete, and was made by a compatible recipe from the same data: refused
    here, before launching. What changes safely (a damaged newest checkpoint passed over, a longer schedule) is not
    returned: the ranks say it when they resume (train/checkpointing.py `resume`), as they must under a stock
    `accelerate launch`, and the user would read each sentence twice."""
    # Small checkpoints are read through here; larger ones are checked by the ranks, in parallel.
    point = checkpoint_to_resume(layout.checkpoints, resume_from, verify_up_to=VERIFY_BEFORE_LAUNCH_BYTES)
    info = point.checkpoint
    check_resume(info, recipe, settings, recipe.training.max_steps, accept_data_change=accept_data_change)
    return [f"resuming from {info.path}"]


def model_view(recipe):
    """The recipe's model as the checks see it: from the model facts (GPT-2, Llama: arithmetic, in milliseconds),
    else built on the meta device from its config (seconds: transformers' modeling code); None when the config is
    neither known nor on this machine."""
    model_checks.raise_problems(model_checks.source_problems(recipe) + model_checks.override_value_problems(recipe))
    facts = model_facts.facts_for(recipe)
    if facts is not None:
        overrides = recipe.model.config_overrides
        model_checks.raise_problems(model_checks.override_problems(
            recipe, model_facts.CONFIG_CLASS[facts.model_type], model_facts.CONFIG_KEYS[facts.model_type], overrides,
            model_facts.ALIASES[facts.model_type]))
        size, tokenizer = _tokenizer_size(recipe)
        model_checks.raise_problems(model_checks.structure_problems(recipe, facts, size, tokenizer))
        return model_checks.view_from_facts(facts, recipe)
    from accel_fsdp.model import build as model_lib

    config = model_lib.model_config(recipe, tokenizer=offline_tokenizer(recipe), offline=True)
    if config is None:
        return None
    try:
        meta = model_lib.meta_model(config, recipe.model.trust_remote_code)
        if recipe.model.lora.enabled:
            meta = model_lib.apply_lora(meta, recipe)
    except UserError:
        raise
    except Exception as e:  # a model class that cannot be built from this config: report, don't crash
        raise UserError(Problem(recipe.where("model.config_overrides"), f"cannot build the model: {e}",
                                "check model.config_overrides")) from None
    return model_lib.view_of(meta, config)


def _tokenizer_size(recipe) -> tuple[int | None, object | None]:
    """The tokenizer's size where it costs no download: the built-in one's, or a local folder's, with the tokenizer
    itself for the latter (the launch compares it with the model's vocabulary, train/setup.py through model/build.py
    `model_config`; `recipe validate` must refuse what the launch would)."""
    size = model_facts.builtin_vocab_size(recipe.model.tokenizer)
    if size is None and is_local(recipe.model.tokenizer or recipe.model.name_or_path):
        tokenizer = offline_tokenizer(recipe)
        return len(tokenizer), tokenizer
    return size, None


def _check_data(recipe, report: PreflightReport) -> list[Problem]:
    """Every source read and checked; tokenized and packed now when the tokenizer is on this machine (cached: the
    ranks read the result), so what only tokenizing finds (no example keeps a loss token, a source without rows)
    stops here, before anything launches. Hub sources are checked when training starts (the network)."""
    ineffective = ineffective_settings(recipe)
    if ineffective:
        return ineffective
    sources = recipe.data.resolved_sources()
    local = []
    for i, source in enumerate(sources):
        if locate(recipe, source, source_key(recipe, i)).kind == "hub":
            report.notes.append(f"hub dataset {source.path!r}: checked when training starts (needs the network)")
        else:
            local.append(i)
    if not local:
        return []
    tokenizer = offline_tokenizer(recipe)
    if tokenizer is None:
        report.notes.append(f"tokenizer {recipe.model.tokenizer or recipe.model.name_or_path!r} is not on this "
                            "machine: the data is tokenized when training starts")
    if tokenizer is None or len(local) < len(sources):  # not all of it can be prepared here: what can be
        problems: list[Problem] = []
        for i in local:
            try:
                if tokenizer is None:
                    data_lib.check_source_rows(recipe, i, sources[i])
                else:
                    data_lib.prepare_source(recipe, tokenizer, i, sources[i])
            except UserError as e:
                problems += e.problems
        return problems
    try:  # the ranks' own path: built (cached) here, so they read the result
        data = data_lib.prepare_data(recipe, tokenizer)
    except UserError as e:
        return e.problems
    report.data_stats = data.stats
    report.total_steps = total_steps(recipe, len(data))
    report.notes += data.stats.warnings(recipe)
    return []


def load_config_or_default(name_or_path: str | None) -> tuple[AccelerateConfig, int | None, str]:
    """The accelerate config to use, the process count to force (GPU default), and why it was chosen."""
    if name_or_path:
        return load_accelerate_config(name_or_path), None, "given"
    path, n, why = default_accelerate_config()
    return load_accelerate_config(path), n, why


def wrap_class_problems(settings, view: model_checks.ModelView, recipe) -> list[Problem]:
    """A wrap class the model does not have would make FSDP wrap nothing (or Accelerate fail later)."""
    classes = settings.wrap_classes.value
    if settings.wrap_policy.value != "TRANSFORMER_BASED_WRAP":
        return []
    if classes in ([MODEL_DEFAULT], []):  # nothing named: the model's own blocks, if it names them
        if view.no_split_modules:
            return []
        return [Problem(settings.wrap_classes.source_text, f"{view.class_name} does not name its transformer "
                        "block (_no_split_modules is empty), so there is no default wrap class",
                        "set fsdp.wrap_class in the recipe to the model's block class")]
    missing = [c for c in classes if c not in view.module_classes]
    if not missing:
        return []
    blocks = view.no_split_modules or sorted(c for c in view.module_classes if "Block" in c or "Layer" in c)
    where = settings.wrap_classes.where(recipe, "fsdp.wrap_class", "fsdp_transformer_layer_cls_to_wrap")
    suggestion = blocks[0] if blocks else "the model's block class"
    return [Problem(where, f"wrap class {', '.join(missing)} is not in the model {view.class_name} "
                    f"(its transformer block is {', '.join(blocks) or 'unknown'})",
                    f"--set fsdp.wrap_class={suggestion} (or in the recipe: fsdp.wrap_class: {suggestion}), "
                    "or use an accelerate config that names no class (fsdp_cpu.yaml, fsdp_1gpu.yaml, fsdp_8gpu.yaml) "
                    "so the model's own _no_split_modules is used")]
