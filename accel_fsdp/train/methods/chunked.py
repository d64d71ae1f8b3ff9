"""The language-model head applied to the loss-carrying positions only, chunk by chunk, never to the whole sequence:
the log-probability of each loss token from the decoder's last hidden state, with the log-softmax in fp32 and each
chunk's logits recomputed in backward, so memory holds one chunk's logits (a fraction of a GiB) where the full
logits of a 128K vocabulary at 8K tokens take 4 GiB in bf16 and three times that with the loss's fp32 copies.

How the model runs without its head: for the duration of one forward, the head module's `forward` is replaced
(`projecting`) by one that gathers the loss positions of the hidden states it is given and returns their token
log-probabilities; transformers returns that tensor as `.logits`. The head is still *called* once, through its
module hooks, inside the model's forward: under FSDP2 its unit's pre-forward all-gathers the weight once, the
chunks all read that one unsharded weight, and the unit's pre-backward hook (registered on the head's output)
makes it available again before the chunks are recomputed. That is exactly the plain path's communication: one
all-gather per micro-step (Accelerate gives [final norm, head] a unit of its own that stays gathered from forward to
backward, accelerate/utils/fsdp_utils.py fsdp2_prepare_model, 1.15.0), never one per chunk (trl#6076), and FSDP is
never asked to reshard the root in the middle (torchtune PR#2800). Calling the head once per chunk through its
module (`head(chunk)`) would run FSDP's hooks per chunk.

This relies on the model's forward passing the head's output through unchanged as its logits: true of the
`*ForCausalLM` classes of CHUNKABLE in transformers 5.24 (`logits = self.lm_head(hidden_states[...])`, nothing
after it); Gemma 2 soft-caps its logits after the head, Cohere scales them, so only the types read are trusted
(tests/test_chunked_loss.py holds every type against the plain path).

Two ways to project a chunk, both exact (the same products as the plain path, summed in other orders):
- a plain `nn.Linear` head (GPT-2's tied to the embedding, Llama's own): `ProjectedLogps`, one autograd Function
  that keeps no logits between forward and backward and adds the weight's gradient over the chunks in fp32;
- a head LoRA adapted (model.lora.target_modules lists it): the adapted layer's own forward on each chunk under
  torch.utils.checkpoint (it honours the adapters switched off for the DPO reference, and LoRA's dropout mask is
  replayed in the recompute).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CHUNKABLE = frozenset({"gpt2", "llama", "mistral", "qwen2", "qwen3", "phi3"})
"""Model types whose `*ForCausalLM.forward` returns the head's output unchanged as `.logits` (transformers 5.24)."""


def find_head(model) -> tuple[torch.nn.Module | None, str | None]:
    """The model's head if the chunked loss can replace it, else None and why (for the start summary)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in CHUNKABLE:
        return None, (f"model type {model_type!r}: its head's output is not known to reach the loss unchanged (some "
                      f"models scale or cap their logits after the head); known: {', '.join(sorted(CHUNKABLE))}")
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        return None, f"model type {model_type!r}: no output embedding (get_output_embeddings) found"
    if linear_of(head) is None:
        return None, f"the head is a {type(head).__name__}, not a linear layer (or a LoRA layer over one)"
    return head, None


def linear_of(head: torch.nn.Module) -> torch.nn.Linear | None:
    """The linear layer that holds the head's weight: the head itself, or the base layer PEFT wrapped."""
    if isinstance(head, torch.nn.Linear):
        return head
    base = getattr(head, "base_layer", None)  # peft/tuners/lora/layer.py LoraLayer.base_layer (peft 0.21.2)
    return base if isinstance(base, torch.nn.Linear) and hasattr(head, "lora_A") else None


@contextlib.contextmanager
def projecting(head: torch.nn.Module, positions: torch.Tensor, targets: torch.Tensor, chunk_tokens: int):
    """While it is open, the head given hidden states (..., H) returns the fp32 log-probabilities (N,) of `targets`
    at the flat `positions` of those states, computed `chunk_tokens` at a time."""
    adapted = not isinstance(head, torch.nn.Linear)
    own = head.__dict__.get("forward")  # an instance-level forward someone else set: put back as it was
    original = head.forward

    def forward(hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        gathered = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)
        if adapted:
            return checkpointed_logps(original, gathered, targets, chunk_tokens)
        return ProjectedLogps.apply(gathered, head.weight, head.bias, targets, chunk_tokens,
                                    compute_dtype(head.weight))

    head.forward = forward
    try:
        yield
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


def compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype a linear layer computes in here: autocast's where it is on (as F.linear under autocast), else the
    weight's (FSDP's mixed precision has already cast it)."""
    device = weight.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def chunk_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] of each row, in fp32."""
    logits = logits.float()
    return logits.gather(1, targets[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)


def checkpointed_logps(head_forward, hidden: torch.Tensor, targets: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """Through the head's own forward (not its module call: that would run FSDP's hooks per chunk), each chunk under
    a non-reentrant checkpoint that restores the RNG state (the same LoRA dropout mask in the recompute)."""
    out = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, y = hidden[start:start + chunk_tokens], targets[start:start + chunk_tokens]
        if torch.is_grad_enabled():
            out.append(checkpoint(lambda h, y: chunk_logps(head_forward(h), y), h, y, use_reentrant=False,
                                  preserve_rng_state=True))
        else:
            out.append(chunk_logps(head_forward(h), y))
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)


class ProjectedLogps(torch.autograd.Function):
    """log softmax(h W^T + b)[y] of each row of `hidden` (N, H), in fp32, holding at most `chunk_tokens` x V logits.

    Forward runs over chunks of `chunk_tokens` rows and keeps each row's log-sum-exp (N floats), not its logits.
    Backward runs over blocks of the vocabulary instead, as many rows of W as make the same number of elements over
    all N positions: a block's logits are recomputed and turned in place into d logp / d logits = g (onehot(y) -
    softmax), rounded to the compute dtype as the plain path rounds its gradient of the logits before the matmuls.
    So each element of W's gradient is one matmul over all N positions, rounded once, as in the plain path (token
    chunks would round it once per chunk, or need an fp32 V x H sum: 1 GiB for Llama 3 at 1B); the hidden states'
    gradient is summed over the blocks in fp32 (N x H) and rounded once at the end; with 16-bit compute each block's
    share is rounded before it is added, like a gradient accumulated over micro-steps."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_tokens: int, dtype: torch.dtype):
        n = hidden.shape[0]
        logps = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
            for start in range(0, n, chunk_tokens):
                end = min(n, start + chunk_tokens)
                logits = F.linear(hidden[start:end].to(dtype), w, b).float()
                lse[start:end] = torch.logsumexp(logits, dim=-1)
                logps[start:end] = logits.gather(1, targets[start:end, None])[:, 0] - lse[start:end]
                del logits
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk_tokens, ctx.dtype = chunk_tokens, dtype
        return logps

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        dtype = ctx.dtype
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        n, vocab = hidden.shape[0], weight.shape[0]
        rows = vocabulary_block(ctx.chunk_tokens, vocab, n)
        h, g = hidden.to(dtype), grad.float()[:, None]
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_hidden else None
        grad_weight = torch.empty_like(weight) if need_weight else None
        grad_bias = torch.empty_like(bias) if need_bias else None
        for first in range(0, vocab, rows):
            last = min(vocab, first + rows)
            w = weight[first:last].to(dtype)
            probs = F.linear(h, w, None if bias is None else bias[first:last].to(dtype)).float()
            probs.sub_(lse[:, None]).exp_().mul_(-g)
            here = (targets >= first) & (targets < last)  # the target's onehot term falls in this block
            probs.scatter_add_(1, (targets - first).clamp_(0, last - first - 1)[:, None], g * here[:, None])
            grad_logits = probs.to(dtype)
            del probs
            if need_hidden:
                if dtype == torch.float32:
                    grad_hidden.addmm_(grad_logits, w)
                else:
                    grad_hidden.add_(grad_logits @ w)
            if need_weight:
                grad_weight[first:last] = grad_logits.t() @ h
            if need_bias:
                grad_bias[first:last] = grad_logits.sum(0)
            del grad_logits
        return (None if grad_hidden is None else grad_hidden.to(hidden.dtype), grad_weight, grad_bias, None, None,
                None)


def vocabulary_block(chunk_tokens: int, vocab: int, positions: int) -> int:
    """Rows of W a backward block takes: as many as hold chunk_tokens x vocab logits over all the positions, a multiple
    of 64 where it is not the whole vocabulary."""
    rows = chunk_tokens * vocab // max(1, positions)
    return vocab if rows >= vocab else max(64, rows // 64 * 64)
