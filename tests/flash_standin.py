"""A CPU stand-in for flash_attention_2, for the tests and for `benchmarks/gpu_check.py --cpu`.

A kernel registered under a name with "flash" in it: transformers routes it as a flash kernel (no mask;
utils/generic.py, is_flash_attention_requested; 5.24.0), so the trainer lays batches out padding-free for it, and it
attends within each document of the varlen arguments it gets (cu_seq_lens) with SDPA. It asserts what a varlen flash
kernel needs: no mask, and the sequence boundaries. Nothing here imports pytest.
"""

from __future__ import annotations

import operator

NAME = "cpu_flash_standin"


def install(setitem=operator.setitem, set_attribute=setattr) -> list[list[int]]:
    """Register the stand-in under NAME; returns the list each call appends its `cu_seq_lens_q` to. `setitem` and
    `set_attribute` make the changes: a test passes monkeypatch's, so they are undone after it."""
    import torch
    import torch.nn.functional as F
    import transformers.modeling_flash_attention_utils as fa
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    calls = []

    def standin(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        assert attention_mask is None, "a flash kernel gets no mask"
        for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
            assert kwargs.get(name) is not None, name
        cu = kwargs["cu_seq_lens_q"].tolist()
        calls.append(cu)
        if key.shape[1] != query.shape[1]:  # grouped keys and values
            key = key.repeat_interleave(query.shape[1] // key.shape[1], 1)
            value = value.repeat_interleave(query.shape[1] // value.shape[1], 1)
        out = torch.cat([F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
                                                         is_causal=True, scale=scaling)
                         for a, b in zip(cu[:-1], cu[1:])], 2)
        return out.transpose(1, 2).contiguous(), None

    setitem(AttentionInterface._global_mapping, NAME, standin)
    setitem(AttentionMaskInterface._global_mapping, NAME, flash_attention_mask)
    # transformers loads a flash implementation by name unless it is the one loaded already
    # (modeling_flash_attention_utils.py, lazy_import_flash_attention; 5.24.0)
    set_attribute(fa, "_loaded_implementation", NAME)
    return calls
