"""Architecture facts of the models we ship recipes for, so that planning, validation and dry runs work offline.

Training loads real weights (and the real config) from the hub or a local folder; these facts only let us build
the same model on the meta device, count its parameters and check the wrap class and context length without
downloading anything. tests/test_recipes.py and tests/test_model_facts.py check them against transformers' own
classes; their parameter counts and shapes are model/facts.py's (`facts_of`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Architecture:
    name: str
    """Short name used in recipes and `accel-fsdp estimate` (gpt2-xl, llama-3.1-8b)."""
    hub_id: str
    """Where the pretrained weights live."""
    model_type: str
    """transformers model_type (gpt2, llama)."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    context: int
    intermediate: int
    tied_embeddings: bool
    block_class: str
    """The transformer block: the natural FSDP unit."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Further config keys (rope scaling, norm epsilon)."""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def config_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `AutoConfig.for_model(model_type, **kwargs)`."""
        if self.model_type == "gpt2":
            kw = dict(n_layer=self.layers, n_embd=self.hidden, n_head=self.heads, vocab_size=self.vocab,
                      n_positions=self.context, n_inner=None)
        else:
            kw = dict(num_hidden_layers=self.layers, hidden_size=self.hidden, num_attention_heads=self.heads,
                      num_key_value_heads=self.kv_heads, vocab_size=self.vocab, max_position_embeddings=self.context,
                      intermediate_size=self.intermediate, tie_word_embeddings=self.tied_embeddings,
                      head_dim=self.head_dim)
        kw.update(self.extra)
        return kw


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
_LLAMA31_ROPE = {**_LLAMA3_ROPE, "factor": 8.0}


def _gpt2(name, hub, layers, hidden, heads):
    return Architecture(name, hub, "gpt2", layers, hidden, heads, heads, 50257, 1024, 4 * hidden, True, "GPT2Block")


def _llama(name, hub, layers, hidden, heads, intermediate, tied, rope):
    return Architecture(name, hub, "llama", layers, hidden, heads, 8, 128256, 131072, intermediate, tied,
                        "LlamaDecoderLayer",
                        extra={"rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": rope,
                               "bos_token_id": 128000, "eos_token_id": 128001})


KNOWN: dict[str, Architecture] = {a.name: a for a in [
    _gpt2("gpt2", "openai-community/gpt2", 12, 768, 12),
    _gpt2("gpt2-medium", "openai-community/gpt2-medium", 24, 1024, 16),
    _gpt2("gpt2-large", "openai-community/gpt2-large", 36, 1280, 20),
    _gpt2("gpt2-xl", "openai-community/gpt2-xl", 48, 1600, 25),
    _llama("llama-3.2-1b", "meta-llama/Llama-3.2-1B", 16, 2048, 32, 8192, True, _LLAMA3_ROPE),
    _llama("llama-3.2-3b", "meta-llama/Llama-3.2-3B", 28, 3072, 24, 8192, True, _LLAMA3_ROPE),
    _llama("llama-3.1-8b", "meta-llama/Llama-3.1-8B", 32, 4096, 32, 14336, False, _LLAMA31_ROPE),
    _llama("llama-3.1-70b", "meta-llama/Llama-3.1-70B", 80, 8192, 64, 28672, False, _LLAMA31_ROPE),
]}


def lookup(name_or_hub_id: str | None) -> Architecture | None:
    """The known architecture behind a short name (gpt2-xl, llama-3.1-8b) or its hub id, instruct variants
    included (meta-llama/Llama-3.1-8B-Instruct); else None. Another owner's repository of the same name is not
    assumed to be the same model, nor is a local path that happens to end in one."""
    if not name_or_hub_id:
        return None
    text = name_or_hub_id.strip().rstrip("/").lower()
    owner, _, name = text.rpartition("/")
    for suffix in ("-instruct", "-hf"):
        name = name.removesuffix(suffix)
    for arch in KNOWN.values():
        hub_owner, _, hub_name = arch.hub_id.lower().partition("/")
        bare = name.removeprefix("meta-")  # Meta-Llama-3.1-8B: the older name of meta-llama/Llama-3.1-8B
        if ((not owner and (name in (arch.name, hub_name) or bare == arch.name))
                or (owner == hub_owner and hub_name in (name, bare))):
            return arch
    return None
