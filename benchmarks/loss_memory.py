"""The loss step's memory and time with the loss in chunks from the hidden states (training.chunked_loss: true, the
default) and with the full logits (false), side by side in one run on 2 CPU ranks (gloo, FSDP2 sharded as Accelerate
shards a run: one unit per block, [final norm, embedding, head] one unit gathered from forward to backward, the root),
for an SFT step and a DPO step, through the trainer's own loss paths (train/methods/logps.py).

    torchrun --nproc_per_node 2 benchmarks/loss_memory.py [--tokens 4096] [--repeats 3]

The model: Llama 3.2 1B's width (2,048), vocabulary (128,256, tied) and one of its blocks, so the loss dominates;
bf16 compute where the CPU has native bf16 (as a run picks it), else fp32. "Peak" is the largest total of tensor
bytes alive during a step that the step created (train/probes.py `PeakTensorBytes`: what a GPU allocator would hold
for it, on top of the sharded weights), the larger of the two ranks. Times are medians of the repeats, the variants
alternating. SFT: every token carries a loss. DPO: 2 pairs a rank, each answer 3/4 of its sequence (the prompt,
1/4, is never projected by the chunked loss).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from accel_fsdp.config.recipe import recipe_from_text
from accel_fsdp.data.batches import collate
from accel_fsdp.data.store import IGNORE_INDEX, Sequence
from accel_fsdp.hardware import cpu_bf16
from accel_fsdp.model.facts import loss_chunk_tokens
from accel_fsdp.train.methods import LossIndex, Norm, build_objective
from accel_fsdp.train.methods.chunked import find_head
from accel_fsdp.train.methods.logps import ChunkedPath, PlainPath
from accel_fsdp.train.probes import PeakTensorBytes
from accel_fsdp.train.reference import NoReference

VOCAB, WIDTH, MLP = 128_256, 2_048, 8_192


def sharded_model(dtype: torch.dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", num_hidden_layers=1, hidden_size=WIDTH, intermediate_size=MLP,
                                  num_attention_heads=32, num_key_value_heads=8, vocab_size=VOCAB,
                                  max_position_embeddings=8192, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 else None
    kwargs = {"mp_policy": policy} if policy else {}
    for block in model.model.layers:
        fully_shard(block, **kwargs)
    # as accelerate/utils/fsdp_utils.py fsdp2_prepare_model (1.15.0) carves the tail of a tied model
    fully_shard([model.model.norm, model.model.embed_tokens, model.lm_head], reshard_after_forward=False, **kwargs)
    fully_shard(model, **kwargs)
    return model


def batches(tokens: int) -> dict[str, dict]:
    rng = np.random.default_rng(dist.get_rank())
    rows = []
    for _ in range(tokens // 1024):
        ids = rng.integers(0, VOCAB, 1024)
        labels = ids.copy()
        labels[0] = IGNORE_INDEX
        rows.append(Sequence(ids, labels, np.arange(1024)))
    sft = collate(rows, 0, True)
    pairs = [Sequence(s.ids, np.where(np.arange(1024) < 256, IGNORE_INDEX, s.labels), s.positions) for s in rows]
    dpo = collate(pairs, 0, True)
    for batch in (sft, dpo):
        batch["loss_index"] = LossIndex.of(batch)
    dpo["reference_logps"] = torch.full((len(pairs),), -9000.0)
    return {"sft": sft, "dpo": dpo}


def step(model, objective, batch, dtype) -> tuple[int, float]:
    """One micro-step's forward and backward: the peak bytes it created, its seconds."""
    model.zero_grad(set_to_none=True)
    dist.barrier()
    start = time.perf_counter()
    with PeakTensorBytes() as memory:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss, _ = objective(model, batch, Norm(tokens=float(batch["loss_index"].tokens), pairs=2.0))
        loss.backward()
    seconds = time.perf_counter() - start
    return memory.peak, seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096, help="tokens a rank a micro-step (a multiple of 1024)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    native, _ = cpu_bf16()
    dtype = torch.bfloat16 if native else torch.float32
    model = sharded_model(dtype)
    head, _ = find_head(model)
    paths = {"plain": PlainPath("benchmark"), "chunked": ChunkedPath(head, loss_chunk_tokens(VOCAB), vocab=VOCAB)}
    data = batches(args.tokens)
    model_key = "model: {architecture: llama-3.2-1b}\n"
    recipes = {"sft": recipe_from_text(model_key + "data: {path: builtin:quickstart}", source="b.yaml"),
               "dpo": recipe_from_text(model_key + "data: {path: builtin:quickstart-pref, format: preference}\n"
                                       "training: {method: dpo}", source="b.yaml")}
    objectives = {(method, name): build_objective(recipes[method], NoReference(), path)
                  for method in recipes for name, path in paths.items()}
    results: dict[tuple[str, str], list[tuple[int, float]]] = {key: [] for key in objectives}
    for repeat in range(args.repeats):
        for method in ("sft", "dpo"):
            order = ("plain", "chunked") if repeat % 2 == 0 else ("chunked", "plain")
            for name in order:
                results[(method, name)].append(step(model, objectives[(method, name)], data[method], dtype))
    summary = {key: (max(p for p, _ in runs), statistics.median(s for _, s in runs)) for key, runs in results.items()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, summary)
    if dist.get_rank() == 0:
        print(f"loss step: Llama vocabulary {VOCAB:,}, width {WIDTH:,}, one block, {args.tokens:,} tokens a rank, "
              f"{str(dtype).removeprefix('torch.')}, {dist.get_world_size()} ranks (gloo, FSDP2), torch "
              f"{torch.__version__}; peak: the larger rank's; time: median of {args.repeats}")
        print(f"{'step':<6}{'plain peak MiB':>16}{'chunked peak MiB':>18}{'peak ratio':>12}"
              f"{'plain s':>10}{'chunked s':>11}{'time ratio':>12}")
        for method in ("sft", "dpo"):
            plain = (max(g[(method, 'plain')][0] for g in gathered), gathered[0][(method, "plain")][1])
            chunked = (max(g[(method, 'chunked')][0] for g in gathered), gathered[0][(method, "chunked")][1])
            print(f"{method:<6}{plain[0] / 2**20:>16,.0f}{chunked[0] / 2**20:>18,.0f}{chunked[0] / plain[0]:>12.3f}"
                  f"{plain[1]:>10.2f}{chunked[1]:>11.2f}{chunked[1] / plain[1]:>12.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
