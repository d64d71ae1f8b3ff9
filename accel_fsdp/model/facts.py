"""What a GPT-2 or Llama model is, from its configuration values alone: parameter counts, the block class FSDP wraps,
the module classes, the linear layers LoRA can target, the context length and the shape the memory formulas use.

`recipe list`, `recipe validate` and `estimate` answer from these facts in a fraction of a second: importing torch
and transformers' modeling code to build the model on the meta device takes seconds. tests/test_model_facts.py holds
every fact here against transformers' own classes (checked with transformers 5.23.0). For any other model type, or
remote code, `facts_for` returns None and callers build the real model on the meta device.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from accel_fsdp.config.recipe import ALL_LINEAR
from accel_fsdp.data.synthetic import BUILTIN_TOKENIZER, vocabulary
from accel_fsdp.model import architectures

# Config keys each model type accepts: GPT2Config / LlamaConfig `to_dict()` keys plus their attribute_map aliases.
CONFIG_KEYS: dict[str, frozenset[str]] = {
    "gpt2": frozenset([
        "_name_or_path", "activation_function", "add_cross_attention", "architectures", "attn_pdrop", "bos_token_id",
        "chunk_size_feed_forward", "dtype", "embd_pdrop", "eos_token_id", "hidden_size", "id2label",
        "initializer_range", "is_encoder_decoder", "label2id", "layer_norm_epsilon", "max_position_embeddings",
        "model_type", "n_embd", "n_head", "n_inner", "n_layer", "n_positions", "num_attention_heads",
        "num_hidden_layers", "output_attentions", "output_hidden_states", "pad_token_id", "problem_type",
        "reorder_and_upcast_attn", "resid_pdrop", "return_dict", "scale_attn_by_inverse_layer_idx",
        "scale_attn_weights", "summary_activation", "summary_first_dropout", "summary_proj_to_labels",
        "summary_type", "summary_use_proj", "tie_word_embeddings", "transformers_version", "use_cache", "vocab_size"]),
    "llama": frozenset([
        "_name_or_path", "architectures", "attention_bias", "attention_dropout", "bos_token_id",
        "chunk_size_feed_forward", "dtype", "eos_token_id", "head_dim", "hidden_act", "hidden_size", "id2label",
        "initializer_range", "intermediate_size", "is_encoder_decoder", "label2id", "max_position_embeddings",
        "mlp_bias", "model_type", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
        "output_attentions", "output_hidden_states", "pad_token_id", "pretraining_tp", "problem_type", "return_dict",
        "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "transformers_version", "use_cache", "vocab_size"]),
}
CONFIG_CLASS = {"gpt2": "GPT2Config", "llama": "LlamaConfig"}
ALIASES = {"gpt2": {"hidden_size": "n_embd", "max_position_embeddings": "n_positions",
                     "num_attention_heads": "n_head", "num_hidden_layers": "n_layer"}, "llama": {}}
# Defaults of the fields used here (the config classes' own defaults).
_DEFAULTS = {
    "gpt2": {"n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024, "vocab_size": 50257, "n_inner": None,
             "tie_word_embeddings": True},
    "llama": {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
              "num_key_value_heads": None, "vocab_size": 32000, "max_position_embeddings": 2048,
              "tie_word_embeddings": False, "head_dim": None, "attention_bias": False, "mlp_bias": False},
}
_CLASSES = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Block", frozenset([
        "Conv1D", "Dropout", "Embedding", "GPT2Attention", "GPT2Block", "GPT2LMHeadModel", "GPT2MLP", "GPT2Model",
        "LayerNorm", "Linear", "ModuleList", "NewGELUActivation"])),
    "llama": ("LlamaForCausalLM", "LlamaDecoderLayer", frozenset([
        "Embedding", "Linear", "LlamaAttention", "LlamaDecoderLayer", "LlamaForCausalLM", "LlamaMLP", "LlamaModel",
        "LlamaRMSNorm", "LlamaRotaryEmbedding", "ModuleList", "SiLUActivation"])),
}


LOSS_CHUNK_BUDGET = 256 * 2**20
"""Bytes of fp32 logits one chunk of the chunked loss holds at most when training.loss_chunk_tokens is null
(train/methods/chunked.py): 512 tokens of Llama 3's 128,256-token vocabulary, 1,280 of GPT-2's 50,257."""


def loss_chunk_tokens(vocab: int) -> int:
    """The chunk the planner picks: as many tokens as keep one chunk's fp32 logits within LOSS_CHUNK_BUDGET, a multiple
    of 64 (matmul tiles), at least 64. The hidden size does not enter: a chunk's logits are tokens x vocabulary, and
    its share of the hidden states is 1/vocabulary of that; what the head's width costs (its weight's gradient) is the
    same whatever the chunk (planning/memory.py `logits_bytes`)."""
    return max(64, LOSS_CHUNK_BUDGET // (4 * vocab) // 64 * 64)


@dataclass(frozen=True)
class Shape:
    """What the memory and FLOP formulas need of a model (planning/memory.py, train/metrics.py); built only by
    `ModelFacts.shape`."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    gated_mlp: bool


@dataclass(frozen=True)
class ModelFacts:
    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    context: int
    tied: bool
    attention_bias: bool = False
    mlp_bias: bool = False

    @property
    def class_name(self) -> str:
        return _CLASSES[self.model_type][0]

    @property
    def no_split_modules(self) -> list[str]:
        return [_CLASSES[self.model_type][1]]

    @property
    def module_classes(self) -> frozenset[str]:
        return _CLASSES[self.model_type][2]

    def block_linears(self) -> dict[str, list[tuple[int, int, bool]]]:
        """Leaf name -> [(in features, out features, has bias)] of the Linear/Conv1D modules of one block."""
        h, i = self.hidden, self.intermediate
        if self.model_type == "gpt2":  # c_proj is both the attention output and the MLP output projection
            return {"c_attn": [(h, 3 * h, True)], "c_proj": [(h, h, True), (i, h, True)], "c_fc": [(h, i, True)]}
        q, kv, ab, mb = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.attention_bias, self.mlp_bias
        return {"q_proj": [(h, q, ab)], "k_proj": [(h, kv, ab)], "v_proj": [(h, kv, ab)], "o_proj": [(q, h, ab)],
                "gate_proj": [(h, i, mb)], "up_proj": [(h, i, mb)], "down_proj": [(i, h, mb)]}

    def linear_layers(self) -> dict[str, list[tuple[int, int, bool]]]:
        """The same for the whole model: every block's, and the output head."""
        out = {name: layers * self.layers for name, layers in self.block_linears().items()}
        out["lm_head"] = [(self.hidden, self.vocab, False)]
        return out

    @property
    def linear_names(self) -> frozenset[str]:
        return frozenset(self.linear_layers())

    def block_params(self) -> int:
        linears = sum(i * o + (o if b else 0) for layers in self.block_linears().values() for i, o, b in layers)
        norms = 4 * self.hidden if self.model_type == "gpt2" else 2 * self.hidden  # LayerNorm has a bias, RMSNorm not
        return linears + norms

    def params(self) -> int:
        embeddings = self.vocab * self.hidden + (self.context * self.hidden if self.model_type == "gpt2" else 0)
        final_norm = 2 * self.hidden if self.model_type == "gpt2" else self.hidden
        head = 0 if self.tied else self.vocab * self.hidden
        return embeddings + self.layers * self.block_params() + final_norm + head

    def lora_params(self, targets: list[str], r: int) -> int:
        """Adapter parameters PEFT adds for these target module names (A: in x r, B: r x out, no bias)."""
        layers = self.linear_layers()
        return sum(r * (i + o) for name in lora_targets(targets, layers) for i, o, _ in layers.get(name, []))

    def shape(self) -> Shape:
        return Shape(layers=self.layers, hidden=self.hidden, heads=self.heads, kv_heads=self.kv_heads,
                     intermediate=self.intermediate, vocab=self.vocab, gated_mlp=self.model_type != "gpt2")


def facts_from_values(model_type: str, values: dict) -> ModelFacts | None:
    """Facts of a gpt2/llama model from its config values (missing ones take the config class defaults)."""
    if model_type not in _DEFAULTS:
        return None
    v = dict(_DEFAULTS[model_type])
    for key, value in values.items():
        v[ALIASES[model_type].get(key, key)] = value
    try:
        if model_type == "gpt2":
            h = int(v["n_embd"])
            return ModelFacts("gpt2", layers=int(v["n_layer"]), hidden=h, heads=int(v["n_head"]),
                              kv_heads=int(v["n_head"]), head_dim=h // int(v["n_head"]),
                              intermediate=int(v["n_inner"] or 4 * h), vocab=int(v["vocab_size"]),
                              context=int(v["n_positions"]), tied=bool(v["tie_word_embeddings"]))
        h, heads = int(v["hidden_size"]), int(v["num_attention_heads"])
        return ModelFacts("llama", layers=int(v["num_hidden_layers"]), hidden=h, heads=heads,
                          kv_heads=int(v["num_key_value_heads"] or heads), head_dim=int(v["head_dim"] or h // heads),
                          intermediate=int(v["intermediate_size"]), vocab=int(v["vocab_size"]),
                          context=int(v["max_position_embeddings"]), tied=bool(v["tie_word_embeddings"]),
                          attention_bias=bool(v["attention_bias"]), mlp_bias=bool(v["mlp_bias"]))
    except (TypeError, ValueError, ZeroDivisionError):
        return None  # a value of the wrong type: transformers will say what is wrong


def facts_of(arch: architectures.Architecture) -> ModelFacts:
    """Facts of a known architecture (`accel-fsdp estimate gpt2-xl`)."""
    facts = facts_from_values(arch.model_type, arch.config_kwargs())
    assert facts is not None, arch.name
    return facts


def shape_of(config) -> Shape:
    """The shape of any transformers config with GPT-2 or Llama field names (also remote code of that naming)."""
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    facts = ModelFacts(getattr(config, "model_type", "") or "", layers=layers, hidden=hidden, heads=heads,
                       kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=hidden // heads,
                       intermediate=(getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
                                     or 4 * hidden),
                       vocab=config.vocab_size, context=0, tied=False)
    return facts.shape()


def base_values(recipe) -> tuple[str, dict] | None:
    """(model_type, config values before overrides) of the recipe's model, from the architectures table, a local
    folder's config.json, or a from-scratch model type; None when only transformers can tell."""
    m = recipe.model
    if m.trust_remote_code:
        return None
    if m.architecture:
        arch = architectures.lookup(m.architecture)
        if arch is not None:
            return arch.model_type, arch.config_kwargs()
        return (m.architecture, {}) if m.architecture in _DEFAULTS else None
    folder = Path(m.name_or_path or "").expanduser()
    if m.name_or_path and folder.is_dir():
        try:
            values = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):
            return None
        return (values.get("model_type"), values) if isinstance(values, dict) else None
    arch = architectures.lookup(m.name_or_path)
    return (arch.model_type, arch.config_kwargs()) if arch is not None else None


def facts_for(recipe) -> ModelFacts | None:
    """Facts of the recipe's model, overrides applied; None when this module cannot tell (then build it on meta)."""
    base = base_values(recipe)
    if base is None or base[0] not in _DEFAULTS:
        return None
    model_type, values = base
    values = dict(values)
    m = recipe.model
    if m.architecture and "vocab_size" not in m.config_overrides:
        vocab = builtin_vocab_size(m.tokenizer)
        if vocab is None:
            return None  # a from-scratch model takes its vocabulary from a tokenizer we would have to load
        values["vocab_size"] = vocab
    values.update(m.config_overrides)
    return facts_from_values(model_type, values)


def builtin_vocab_size(tokenizer: str | None) -> int | None:

    return len(vocabulary()) if tokenizer == BUILTIN_TOKENIZER else None


OUTPUT_HEAD = "lm_head"
"""The output head's name in the GPT-2 and Llama families (and in transformers' other causal LMs)."""


def lora_targets(targets, linear_names) -> list[str]:
    """model.lora.target_modules as names of the model's linear layers: `all-linear` (config/recipe.py ALL_LINEAR) is
    every one but the output head, as PEFT reads it; other names stay as given, in their order."""
    names = list(targets)
    if ALL_LINEAR not in names:
        return names
    every = sorted(name for name in linear_names if name != OUTPUT_HEAD)
    return list(dict.fromkeys(every + [name for name in names if name != ALL_LINEAR]))
