"""Recipes: what to train. YAML files loaded into typed dataclasses, checked before anything runs.

A recipe has seven sections (`model`, `data`, `training`, `preference`, `fsdp`, `checkpoint`, `logging`) and three
metadata keys (`name`, `description`, `output_dir`). Loading rejects unknown keys, checks types and ranges, and reports
*all* problems at once, each with its file, line, dotted key, value and fix. `--set dotted.key=value`
overrides are parsed as YAML scalars (so `true`, `3`, `1e-4`, `[q_proj, v_proj]` get their types) and
checked exactly like the file. The schema is here; binding YAML data to it (types, unknown keys, overrides) is
binder.py's, and the ranges of its keys and their relations recipe_checks.py's.

What depends on the machine (number of processes, the model's context length, the data file) is checked
later, in `preflight.py`; this module must never touch the hub, the disk beyond the recipe file, or torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from accel_fsdp.config import precision
from accel_fsdp.config.accelerate import STRATEGIES
from accel_fsdp.config.binder import apply_override, bind, flatten, schema_keys, to_plain, yaml_key
from accel_fsdp.config.recipe_checks import check_recipe
from accel_fsdp.config.methods import METHODS, NAMES
from accel_fsdp.config.yaml_file import load_yaml, read_text
from accel_fsdp.errors import Problem, UserError
from accel_fsdp.layout import CHECKPOINTS_DIR


@dataclass(kw_only=True)
class LoraConfig:
    """Parameter-efficient fine-tuning with PEFT LoRA adapters."""

    enabled: bool = False
    """Train LoRA adapters instead of all weights: each target layer computes W x + (alpha / r) B A dropout(x), the
    base W frozen; only A (r x in, drawn as nn.Linear's weight from training.seed + 1) and B (out x r, zeros) train.
    GPT-2's Conv1D layers hold W as in x out (x W + b): A and B the same, and a merge adds (alpha / r) (B A)^T."""
    r: int = 16
    """Rank of the adapter matrices."""
    alpha: int = 32
    """Scaling numerator: the adapter output is multiplied by alpha / r (not rsLoRA's alpha / sqrt(r))."""
    dropout: float = 0.0
    """Dropout on the adapter input x (torch's: kept entries scaled by 1 / (1 - p); the base layer sees x whole; off in
    evaluation); preference tuning turns it off (docs/PREFERENCE.md: preference.keep_dropout keeps it)."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    """Names of the Linear modules that get adapters, in every block: a module whose name ends in one of them (GPT-2:
    c_attn, c_proj (attention and MLP output), c_fc; Llama: q_proj, k_proj, v_proj, o_proj...). `all-linear` (PEFT's
    shorthand): every linear layer of the blocks, the output head left out (add lm_head to adapt it too)."""


ALL_LINEAR = "all-linear"
"""model.lora.target_modules: PEFT's name for every linear layer but the output head (peft 0.21.2, utils/constants.py
INCLUDE_LINEAR_LAYERS_SHORTHAND); expanded to the model's own names (model/facts.py `lora_targets`)."""

QUANTIZE_METHODS = ("nf4",)
"""model.quantize: how the frozen base may be held in fewer bits (model/quantize.py)."""


@dataclass(kw_only=True)
class ModelConfig:
    """Which model to train and how it is built."""

    name_or_path: str | None = None
    """Hub id (gpt2-xl, meta-llama/Llama-3.2-1B) or local folder with pretrained weights."""
    architecture: str | None = None
    """Build from scratch with random weights instead: a known architecture (gpt2, llama-3.2-1b) or a
    transformers model_type (gpt2, llama). Exclusive with name_or_path."""
    config_overrides: dict[str, Any] = field(default_factory=dict)
    """Keys set on the transformers config, e.g. {n_layer: 2, n_embd: 64} for a tiny model."""
    tokenizer: str | None = None
    """Tokenizer: hub id, local folder, builtin:quickstart, or bpe:N (a byte-level BPE tokenizer of N tokens
    trained on this recipe's data, cached; for models built from scratch on your own text). Default:
    name_or_path."""
    trust_remote_code: bool = False
    """Allow model code from the hub repository to run. Only for repositories you trust."""
    activation_checkpointing: bool | None = None
    """Recompute each wrapped block in the backward pass: less activation memory, about 30% more compute.
    Default: the accelerate config's fsdp_activation_checkpointing."""
    attn_implementation: str | None = None
    """Attention kernel: sdpa, eager or flash_attention_2. Default: transformers' choice."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (PEFT)."""
    quantize: Literal[QUANTIZE_METHODS] | None = None
    """QLoRA: hold the frozen linear weights of every decoder block in 4 bits (nf4: NormalFloat blocks of 64 with
    double-quantized scales, torchao), sharded by FSDP2; needs model.lora. Default: null (the base in the compute
    dtype)."""


FORMATS = ("text", "instruction", "chat", "preference")
"""data.format: what a row of a source holds."""
MIX_BY = ("tokens", "rows")
SOURCE_KEYS = ("path", "format", "text_field", "instruction_field", "input_field", "output_field", "messages_field",
               "prompt_field", "chosen_field", "rejected_field", "hub_config", "split", "max_rows")
"""The keys of `data` that describe one source; an entry of data.sources that leaves one out takes data's value."""


@dataclass(kw_only=True)
class SourceConfig:
    """One dataset of a mixture (an entry of data.sources). A key left out takes the value of the same key in
    `data` (so `data.format: chat` once serves every entry)."""

    name: str | None = None
    """Name in the summary and the metrics (source_tokens, eval_loss_by_source). Default: the file stem, the hub
    dataset's name, or the built-in name."""
    path: str | None = None
    """Local .jsonl/.json/.csv/.parquet/.txt file (gzip-compressed: .jsonl.gz), a hub dataset (owner/name or
    hub:name), or builtin:NAME."""
    weight: float = 1.0
    """Share of the mixture: of the loss-carrying tokens (data.mix_by: tokens) or of the training units (rows:
    sequences, or preference pairs). Weights are relative: they are divided by their sum."""
    format: Literal[FORMATS] | None = None
    """text, instruction, chat or preference (see data.format)."""
    text_field: str | None = None
    """Column holding the text (format: text)."""
    instruction_field: str | None = None
    """Column holding the instruction (format: instruction)."""
    input_field: str | None = None
    """Optional column with extra input for the instruction (format: instruction)."""
    output_field: str | None = None
    """Column holding the response (format: instruction)."""
    messages_field: str | None = None
    """Column holding the list of {role, content} messages (format: chat)."""
    prompt_field: str | None = None
    """Column holding the prompt (format: preference)."""
    chosen_field: str | None = None
    """Column holding the preferred answer (format: preference)."""
    rejected_field: str | None = None
    """Column holding the other answer (format: preference)."""
    hub_config: str | None = None
    """Configuration name of a hub dataset."""
    split: str | None = None
    """Split of a hub dataset to read."""
    max_rows: int | None = None
    """Read at most this many rows of this source."""


@dataclass(kw_only=True)
class DataConfig:
    """What the model learns from: one source (data.path and its keys) or a weighted mixture (data.sources)."""

    path: str = ""
    """One source: a local .jsonl/.json/.csv/.parquet/.txt file (gzip-compressed: .jsonl.gz), a hub dataset
    (owner/name or hub:name), or builtin:quickstart. For several, use data.sources instead."""
    sources: list[SourceConfig] = field(default_factory=list)
    """A mixture: a list of sources, each with a path, a weight and optionally its own format and field names
    (the keys below serve as their defaults). Exclusive with data.path."""
    mix_by: Literal[MIX_BY] = "tokens"
    """What the weights of data.sources share out: tokens (loss-carrying tokens of each optimizer step) or rows
    (training units: sequences, or preference pairs)."""
    format: Literal[FORMATS] = "text"
    """text: language modelling on text_field; instruction: alpaca rows, loss on the response only;
    chat: a list of messages rendered with the tokenizer's chat template, loss on assistant turns only;
    preference: a prompt with a chosen and a rejected answer (strings, or message lists that share the conversation
    before the last assistant turn), for training.method dpo, simpo or orpo."""
    text_field: str = "text"
    """Column holding the text (format: text)."""
    instruction_field: str = "instruction"
    """Column holding the instruction (format: instruction)."""
    input_field: str = "input"
    """Optional column with extra input for the instruction (format: instruction)."""
    output_field: str = "output"
    """Column holding the response (format: instruction)."""
    messages_field: str = "messages"
    """Column holding the list of {role, content} messages (format: chat)."""
    prompt_field: str = "prompt"
    """Column holding the prompt (format: preference; may be absent when chosen and rejected are conversations)."""
    chosen_field: str = "chosen"
    """Column holding the preferred answer: a string, or the conversation ending in it (format: preference)."""
    rejected_field: str = "rejected"
    """Column holding the other answer: a string, or the conversation ending in it (format: preference)."""
    hub_config: str | None = None
    """Configuration name of a hub dataset (e.g. wikitext-2-raw-v1)."""
    split: str = "train"
    """Split of a hub dataset to read."""
    seq_len: int = 1024
    """Tokens per training sequence. Must not exceed the model's context length."""
    packing: bool | None = None
    """Pack short examples into full seq_len sequences (documents kept apart). Default: on for text sources, off
    for the others."""
    eval_fraction: float = 0.05
    """Share of each source's rows held out for evaluation (deterministic split). 0 disables evaluation."""
    max_rows: int | None = None
    """Read at most this many rows of each source, for quick experiments."""
    num_proc: int | None = None
    """Threads of the tokenizer's Rust batch encoder. Default: the cores this process may use."""

    def resolved_sources(self) -> list[SourceConfig]:
        """Every source with every key filled in (data.path is a mixture of one, named after its file)."""
        entries = self.sources or ([SourceConfig(path=self.path)] if self.path else [])
        out = []
        for entry in entries:
            filled = {k: getattr(self, k) if getattr(entry, k) is None else getattr(entry, k) for k in SOURCE_KEYS
                      if k != "path"}
            path = entry.path or ""
            out.append(SourceConfig(name=entry.name or default_source_name(path), path=path, weight=entry.weight,
                                    **filled))
        return out

    def packs(self, source: SourceConfig) -> bool:
        """Whether this source's examples are packed into full sequences."""
        return source.format == "text" if self.packing is None else self.packing


def default_source_name(path: str) -> str:
    """`stories` for data/stories.jsonl (and stories.jsonl.gz), `ultrachat_200k` for HuggingFaceH4/ultrachat_200k,
    `quickstart` for builtin:quickstart."""
    text = path.removeprefix("hub:").removeprefix("builtin:").rstrip("/")
    if text.lower().endswith(".gz"):  # stories.jsonl.gz, compressed: stories
        text = text[:-3]
    return Path(text).stem if Path(text).suffix else (text.rsplit("/", 1)[-1] or path)


@dataclass(kw_only=True)
class TrainingConfig:
    """Batch, schedule and precision."""

    method: Literal[NAMES] = "sft"
    """sft: next-token prediction on the data; dpo (Rafailov et al., 2023), simpo (Meng et al., 2024) or orpo (Hong
    et al., 2024): preference tuning on pairs of answers (data.format: preference), parameters in `preference`."""
    micro_batch_size: int = 1
    """Training sequences (preference pairs) per rank per micro-step (forward + backward)."""
    global_batch_size: int = 8
    """Training sequences (examples, or packed sequences of up to seq_len tokens; preference pairs) per optimizer step
    over all ranks. Gradient accumulation steps are derived: global_batch_size / (micro_batch_size x processes),
    which must be a whole number."""
    max_steps: int | None = None
    """Optimizer steps to run. Exclusive with epochs."""
    epochs: float | None = None
    """Passes over the training sequences (may be fractional). Used when max_steps is not set; default 1: the run
    takes ceil(epochs x training sequences / global_batch_size) optimizer steps (at least 1)."""
    lr: float = 2e-5
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """r: after warm-up, optimizer step s of the run's N (max_steps, or as `epochs` says) uses lr x (r + (1 - r) x
    shape(p)), p = (s - 1 - warmup_steps) / (N - warmup_steps); the last step's p is 1 - 1 / (N - warmup_steps), as in
    transformers' and torchtune's."""
    warmup_steps: int = 0
    """W: optimizer step s <= W uses lr x s / (W + 1) (nanoGPT's linear warm-up: no step at 0), step W + 1 uses lr."""
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warm-up: shape(p) = (1 + cos(pi p)) / 2 (cosine), 1 - p (linear), or lr throughout (constant)."""
    weight_decay: float = 0.0
    """wd: AdamW's decoupled decay. Before its update, optimizer step s multiplies every trainable parameter of 2 or
    more dimensions by 1 - lr_s x wd: the linear layers' and the embeddings' matrices (a tied output projection is its
    embedding), LoRA's A and B; never biases and norm weights (nanoGPT's rule)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon. Step s moves a parameter by -lr_s m^ / (sqrt(v^) + eps), m^ = m / (1 - beta1^s), v^ = v / (1 -
    beta2^s) (torch.optim.AdamW), m and v the moving averages of the clipped gradient and its square, from 0."""
    max_grad_norm: float | None = 1.0
    """c: the gradient of the step's loss (the whole global batch, every trainable parameter, over all ranks) is
    multiplied by min(1, c / (norm + 1e-6)), norm its L2 norm (torch.nn.utils.clip_grad_norm_). null: no clipping."""
    seed: int = 42
    """Seed for weights created from scratch, data order, and dropout."""
    mixed_precision: Literal[precision.TRAINING] | None = None
    """bf16: bf16 compute with fp32 master weights (README, "An optimizer step, exactly", says which numbers are
    bf16); fp32: full precision; fp16: needs a GPU and a grad scaler; fp8:
    the blocks' linear layers in float8 (torchao), the rest bf16, for Llama on GPUs of compute capability 8.9+ (not
    exact: `verify` bounds it against bf16). Default: the accelerate config's mixed_precision, else bf16."""
    compile: bool = False
    """Compile each transformer block (torch.compile, inductor) before sharding: faster steps for a compile at the
    start, cached between runs; the same loss within rounding. GPT-2 and Llama blocks."""
    activation_offload: bool = False
    """Move the activations the backward needs to host memory as the forward saves them and bring them back in the
    backward (pinned memory, a side stream): less GPU memory for host traffic, the same loss exactly. With
    model.activation_checkpointing only each block's input moves."""
    eval_every_steps: int | None = None
    """Evaluate on the held-out split every N optimizer steps (and at the end). Default: at the end only."""
    eval_max_batches: int | None = None
    """Evaluate on at most this many micro-batches per rank (of each source): its first eval_max_batches x
    micro_batch_size x processes held-out sequences (pairs), rank r taking r, r + processes, ... Default: the whole
    held-out split."""
    chunked_loss: bool = True
    """Compute the loss from the hidden states of the loss-carrying positions only, a chunk at a time, never the full
    logits: the same loss and gradients, a fraction of the memory (docs/PERFORMANCE.md). false: the full logits."""
    loss_chunk_tokens: int | None = None
    """Positions projected at once by the chunked loss. null: the planner's pick (one chunk's fp32 logits within
    256 MiB: 512 tokens at a 128K vocabulary)."""

    # The batch arithmetic, in one place (global = micro x ranks x accumulation).
    def rows_per_micro_step(self, ranks: int) -> int:
        """Sequences one micro-step reads over all ranks."""
        return self.micro_batch_size * ranks

    def splits_evenly(self, ranks: int) -> bool:
        """The global batch is a whole number of micro-steps on `ranks` ranks."""
        return self.global_batch_size % self.rows_per_micro_step(ranks) == 0

    def accumulation_steps(self, ranks: int) -> int:
        """Micro-steps per optimizer step on `ranks` ranks (checked to divide before any run starts)."""
        return self.global_batch_size // self.rows_per_micro_step(ranks)

    def sequences_per_micro_step(self) -> int:
        """Sequences one rank's micro-step puts through the model: a preference pair is two (chosen, rejected)."""
        return self.micro_batch_size * METHODS[self.method].sequences_per_unit


@dataclass(kw_only=True)
class PreferenceConfig:
    """Preference tuning (training.method dpo, simpo or orpo): each pair's loss compares the chosen and the rejected
    answer's log-probabilities (docs/PREFERENCE.md)."""

    beta: float | None = None
    """DPO: scale of the difference of the two answers' log-ratios to the reference (default 0.1); SimPO: scale of
    the difference of their mean token log-probabilities (default 2.0); ORPO: not used."""
    label_smoothing: float = 0.0
    """DPO and SimPO: the assumed probability that a pair's preference is wrong (conservative DPO); 0 trusts every
    pair. In [0, 0.5)."""
    gamma: float = 1.0
    """SimPO: the target margin between the chosen and the rejected answer's scaled mean log-probabilities."""
    lambda_: float = field(default=0.1, metadata={"key": "lambda"})
    """ORPO: weight of the log odds-ratio term added to the SFT loss of the chosen answer (YAML key: lambda)."""
    keep_dropout: bool = False
    """Train with the model's dropout (its config's dropout keys, LoRA's dropout). Off by default for preference
    tuning: the reference log-probabilities come from the model without dropout, so with it the first step's margin
    is dropout noise, not 0, and the loss compares noisy log-probabilities throughout."""

    def beta_for(self, method: str) -> float | None:
        """beta, or the method's default when the recipe leaves it null (config/methods.py)."""
        return self.beta if self.beta is not None else METHODS[method].default_beta


@dataclass(kw_only=True)
class FsdpConfig:
    """Overrides of the accelerate config's FSDP settings, for what depends on the model rather than the machine."""

    wrap_class: str | None = None
    """Module class that becomes one FSDP unit (GPT2Block, LlamaDecoderLayer). Default: the accelerate
    config's fsdp_transformer_layer_cls_to_wrap, else the model's own _no_split_modules."""
    sharding_strategy: Literal[STRATEGIES] | None = None
    """Override the accelerate config's strategy. Default: the accelerate config."""
    cpu_offload: bool | None = None
    """Keep parameters, gradients and optimizer state in CPU memory. Default: the accelerate config."""
    reduce_every_micro_step: bool = True
    """Reduce-scatter gradients after every micro-step, so each rank only ever holds its gradient shard. false
    defers the reduction to the last micro-step of an optimizer step: less communication, but between micro-steps
    every rank holds the unsharded fp32 gradients of the whole model (on the GPU even with CPU offload): only for
    models small enough that this fits. Refused under FSDP1 with 16-bit compute, which would add them up in bf16."""
    collective_timeout_minutes: float = 60.0
    """How long a collective (all-gather, barrier, broadcast) may wait before the run fails, naming the rank that
    stopped making progress. Generous, because the first run tokenizes the data on one rank while the others wait,
    and large checkpoints take time. Fractions allowed (0.5 is 30 s)."""


@dataclass(kw_only=True)
class CheckpointConfig:
    """Where and how often training state is saved."""

    dir: str = CHECKPOINTS_DIR
    """Checkpoint folder; relative paths are inside the run folder."""
    every_steps: int | None = None
    """Save every N optimizer steps. Default: only at the end of the run."""
    keep_last: int | None = 2
    """Keep only the newest N checkpoints. null keeps all."""
    state_dict_type: Literal["SHARDED_STATE_DICT", "FULL_STATE_DICT"] | None = None
    """SHARDED_STATE_DICT (each rank writes its shard) or FULL_STATE_DICT (gathered to rank 0).
    Default: the accelerate config's fsdp_state_dict_type."""
    export_final: bool = True
    """At the end, write a consolidated Hugging Face model folder to <run>/final."""
    export_dtype: Literal["bf16", "fp16", "fp32"] = "fp32"
    """Weight dtype of the final export."""


@dataclass(kw_only=True)
class LoggingConfig:
    """What is reported while training."""

    every_steps: int = 10
    """Write a train row of metrics.jsonl (and update the progress bar's numbers) every N optimizer steps and at
    the last; a row's numbers are over the steps since the previous one (README, "What a run logs")."""
    trackers: list[str] = field(default_factory=list)
    """Experiment trackers through Accelerate: tensorboard, wandb."""
    project: str | None = None
    """Tracker project name. Default: the recipe name."""
    sample_prompt: str | None = None
    """Prompt for the short generation printed at the end. null skips it."""
    sample_max_new_tokens: int = 24
    """Tokens generated for the sample."""


@dataclass(kw_only=True)
class Recipe:
    """A training job: model, data, schedule, sharding overrides, checkpoints, logging."""

    name: str = ""
    """Short name (defaults to the file name)."""
    description: str = ""
    """One line shown by `accel-fsdp recipe list`."""
    output_dir: str | None = None
    """Run folder. Default: runs/<name>."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    # Not part of the YAML: where the recipe came from, for messages.
    source: str = field(default="", repr=False, compare=False, metadata={"internal": True})
    overridden: tuple[str, ...] = field(default=(), repr=False, compare=False, metadata={"internal": True})
    lines: dict[str, int] = field(default_factory=dict, repr=False, compare=False, metadata={"internal": True})

    def to_dict(self) -> dict[str, Any]:
        return {yaml_key(f): to_plain(getattr(self, f.name)) for f in dataclasses.fields(self)
                if not f.metadata.get("internal")}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    def fingerprint(self) -> str:
        """Stable hash of the resolved recipe."""
        blob = json.dumps(flatten(self.to_dict()), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def is_overridden(self, key: str) -> bool:
        """The value of `key` came from `--set`: the key, or a key above it (`--set data.sources=[...]` sets
        data.sources.0.path), was set on the command line."""
        return any(key == set_key or key.startswith(set_key + ".") for set_key in self.overridden)

    def where(self, key: str) -> str:
        """`file:line: key` (or `--set key`) for messages about one key."""
        if self.is_overridden(key):
            return f"--set {key}"
        if not self.source:
            return key
        line = self.lines.get(key)
        return f"{self.source}:{line}: {key}" if line else f"{self.source}: {key}"


# Keys that may change between a checkpoint and the run resuming from it: they change how the run is observed,
# how long it lasts or how the same global batch is split over ranks, not what is being trained.
RESUME_SAFE_KEYS = (
    "name", "description", "output_dir", "logging.", "checkpoint.every_steps", "checkpoint.keep_last",
    "checkpoint.dir", "checkpoint.export_final", "checkpoint.export_dtype", "checkpoint.state_dict_type",
    "training.max_steps", "training.epochs", "training.micro_batch_size", "training.eval_every_steps",
    "training.eval_max_batches", "data.num_proc", "model.attn_implementation", "model.activation_checkpointing",
    "training.compile", "training.activation_offload", "training.chunked_loss", "training.loss_chunk_tokens", "fsdp.",
)


def read_saved_recipe(path, *, then: str = "", fix: str = "") -> dict:
    """A resolved recipe we saved (the recipe.yaml of a run folder or of a checkpoint) as the dict it was written
    from, or one UserError naming the file: "is unreadable ({why}){then}" and `fix`. The one reader of them."""
    from pathlib import Path

    try:
        saved = yaml.safe_load(Path(path).read_text())
        sections = [f.name for f in dataclasses.fields(Recipe) if dataclasses.is_dataclass(f.default_factory)]
        if not isinstance(saved, dict) or not all(isinstance(saved.get(k, {}), dict) for k in sections):
            raise ValueError("not a recipe mapping")
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as e:
        raise UserError(Problem(str(path), f"is unreadable ({type(e).__name__}){then}", fix)) from None
    return saved


def incompatible_keys(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """Dotted keys whose values differ between two recipe dicts and that a resume must not change."""
    a, b = flatten(saved), flatten(current)
    out = []
    for key in sorted(set(a) | set(b)):
        if any(key == s or (s.endswith(".") and key.startswith(s)) for s in RESUME_SAFE_KEYS):
            continue
        if a.get(key) != b.get(key):
            out.append((key, a.get(key), b.get(key)))
    return out


# ----------------------------------------------------------------------------------------------- loading

OTHER_NAMES = {
    "learning_rate": "training.lr", "lr_scheduler": "training.scheduler", "lr_scheduler_type": "training.scheduler",
    "batch_size": "training.micro_batch_size", "per_device_train_batch_size": "training.micro_batch_size",
    "train_batch_size": "training.global_batch_size", "total_batch_size": "training.global_batch_size",
    "gradient_accumulation_steps": "training.global_batch_size (accumulation is derived from it)",
    "num_epochs": "training.epochs", "num_train_epochs": "training.epochs", "steps": "training.max_steps",
    "num_steps": "training.max_steps", "max_iters": "training.max_steps", "warmup": "training.warmup_steps",
    "num_warmup_steps": "training.warmup_steps", "grad_clip": "training.max_grad_norm",
    "gradient_clipping": "training.max_grad_norm", "precision": "training.mixed_precision",
    "bf16": "training.mixed_precision", "fp16": "training.mixed_precision",
    "max_seq_length": "data.seq_len", "max_length": "data.seq_len", "seq_length": "data.seq_len",
    "block_size": "data.seq_len", "context_length": "data.seq_len", "dataset": "data.path",
    "model_name_or_path": "model.name_or_path", "model_name": "model.name_or_path",
    "rank": "model.lora.r", "lora_r": "model.lora.r", "lora_alpha": "model.lora.alpha",
    "lora_dropout": "model.lora.dropout", "lora_target_modules": "model.lora.target_modules",
    "save_steps": "checkpoint.every_steps", "save_total_limit": "checkpoint.keep_last",
    "logging_steps": "logging.every_steps", "report_to": "logging.trackers",
    "gradient_checkpointing": "model.activation_checkpointing",
}
"""What other fine-tuning tools (transformers' TrainingArguments, PEFT, torchtune) call a recipe key: an unknown
key by one of these names is answered "did you mean <ours>?" (binder.py `unknown_key_fix`)."""


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a recipe file, apply `--set` overrides, and check it. Raises one `UserError` with every problem."""
    path = Path(path)
    shown = str(path)
    try:
        text = read_text(path, shown, "the recipe file")
    except FileNotFoundError:
        raise UserError(Problem(shown, "recipe file not found",
                                "check the path, or use a shipped name from `accel-fsdp recipe list`")) from None
    return recipe_from_text(text, source=shown, overrides=overrides, default_name=path.stem)


def recipe_from_text(text: str, *, source: str, overrides=(), default_name: str = "") -> Recipe:
    raw, lines, duplicates = load_yaml(text, source)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(Problem(source, f"the recipe must be a mapping of sections, found {type(raw).__name__}",
                                "start from `accel-fsdp recipe copy quickstart my.yaml`"))
    problems: list[Problem] = list(duplicates)
    overridden = []
    for item in overrides:
        overridden += apply_override(raw, item, problems, Recipe, OTHER_NAMES)

    located = Recipe(source=source, overridden=tuple(overridden), lines=lines)
    recipe = bind(Recipe, raw, "", located.where, problems, other_names=OTHER_NAMES)
    recipe.source, recipe.overridden, recipe.lines = source, tuple(overridden), lines
    if not recipe.name:
        recipe.name = default_name
    # Range checks run too (on defaults where a value had the wrong type), so one pass reports everything.
    # A key whose value could not be read is not judged again, neither alone nor in a relation to another key
    # (training.method: 'dpoo' would also read as "training.method is sft"); a problem found twice is said once.
    # A problem about a key below one that could not be read (data.sources.1.name under data.sources.1), or naming
    # one in its text (its fix included: "no data given" when data.sources could not be read), is about a default.
    unreadable = {p.where for p in problems}
    unread = {k for k in (p.where.split(" ")[-1] for p in problems) if "." in k}
    for p in check_recipe(recipe):
        key = p.where.split(" ")[-1]
        about_unread = any(u in p.message or u in p.fix or key.startswith(u + ".") for u in unread)
        if p.where not in unreadable and not about_unread and p not in problems:
            problems.append(p)
    if problems:
        raise UserError(problems, title=f"recipe {source} has {len(problems)} problems")
    return recipe


# ------------------------------------------------------------------------------------------------ helpers


def key_reference() -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, documentation) of every recipe key, in schema order."""
    return schema_keys(Recipe)
