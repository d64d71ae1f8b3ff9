"""A CPU stand-in for flash_attention_2, for the tests and for `benchmarks/gpu_check.py --cpu`.

A kernel registered under a name with "flash" in it: transformers routes it as a flash kernel (no mask;
utils/generic.py, is_flash_attention_requested; 5.24.0), so the trainer lays batches out padding-free for it, and it
attends within each document of the varlen arguments it gets (cu_seq_lens) with SDPA. It asserts what a varlen flash
kernel needs: no mask, and the sequence boundaries. The attention itself is a torch custom op, opaque to
torch.compile as flash-attn's own kernels are (flash_attn registers torch.ops.flash_attn.*), so a compiled block
that calls it has no graph break of the stand-in's making. Nothing here imports pytest.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

NAME = "cpu_flash_standin"
_CALLS: list[list[int]] = []
"""Where each call appends its `cu_seq_lens_q` (replaced by every `install`)."""


def _attend(query, key, value, cu: list[int], scale: float):
    return torch.cat([F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
                                                     is_causal=True, scale=scale)
                      for a, b in zip(cu[:-1], cu[1:])], 2).contiguous()


@torch.library.custom_op("accel_fsdp_tests::varlen_attention", mutates_args=())
def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_lens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Causal attention within each document of a padding-free row; query, key, value: (1, heads, T, head dim)."""
    cu = cu_seq_lens.tolist()
    _CALLS.append(cu)
    return _attend(query, key, value, cu, scale)


@varlen_attention.register_fake
def _(query, key, value, cu_seq_lens, scale):
    return query.new_empty(query.shape)  # contiguous, as torch.cat makes it (whatever the query's strides)


@torch.library.custom_op("accel_fsdp_tests::varlen_attention_backward", mutates_args=())
def varlen_attention_backward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_lens: torch.Tensor,
                              scale: float, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `varlen_attention`'s inputs, written out (a compiled backward runs its ops below autograd, so
    torch.autograd.grad cannot be asked): per document, with P = softmax(scale Q K^T, causal) and O = P V,
    dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ = scale dS K, dK = scale dS^T Q."""
    grads = [t.new_zeros(t.shape) for t in (query, key, value)]  # contiguous, as the fake says
    for a, b in zip(cu_seq_lens.tolist()[:-1], cu_seq_lens.tolist()[1:]):
        q, k, v, d_out = (t[:, :, a:b].to(torch.promote_types(t.dtype, torch.float32))
                          for t in (query, key, value, grad))
        scores = (q @ k.transpose(-1, -2)) * scale
        causal = torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).tril()
        p = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        d_p = d_out @ v.transpose(-1, -2)
        d_scores = p * (d_p - (d_p * p).sum(-1, keepdim=True))
        for full, part in zip(grads, (d_scores @ k * scale, d_scores.transpose(-1, -2) @ q * scale,
                                      p.transpose(-1, -2) @ d_out)):
            full[:, :, a:b] = part.to(full.dtype)
    return tuple(grads)


@varlen_attention_backward.register_fake
def _(query, key, value, cu_seq_lens, scale, grad):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4])
    ctx.scale = inputs[4]


def _backward(ctx, grad):
    query, key, value, cu = ctx.saved_tensors
    return (*varlen_attention_backward(query, key, value, cu, ctx.scale, grad), None, None)


varlen_attention.register_autograd(_backward, setup_context=_setup_context)


def install(setitem=operator.setitem, set_attribute=setattr) -> list[list[int]]:
    """Register the stand-in under NAME; returns the list each call appends its `cu_seq_lens_q` to. `setitem` and
    `set_attribute` make the changes: a test passes monkeypatch's, so they are undone after it."""
    global _CALLS
    import transformers.modeling_flash_attention_utils as fa
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    _CALLS = calls = []

    def standin(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        assert attention_mask is None, "a flash kernel gets no mask"
        for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
            assert kwargs.get(name) is not None, name
        if key.shape[1] != query.shape[1]:  # grouped keys and values
            key = key.repeat_interleave(query.shape[1] // key.shape[1], 1)
            value = value.repeat_interleave(query.shape[1] // value.shape[1], 1)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = varlen_attention(query, key, value, kwargs["cu_seq_lens_q"], float(scale))
        return out.transpose(1, 2).contiguous(), None

    setitem(AttentionInterface._global_mapping, NAME, standin)
    setitem(AttentionMaskInterface._global_mapping, NAME, flash_attention_mask)
    # transformers loads a flash implementation by name unless it is the one loaded already
    # (modeling_flash_attention_utils.py, lazy_import_flash_attention; 5.24.0)
    set_attribute(fa, "_loaded_implementation", NAME)
    return calls
