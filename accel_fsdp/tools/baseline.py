"""The yardstick of `accel-fsdp bench --compare-baseline`: a minimal, hand-written Accelerate FSDP training loop.

Built by the same setup as a real run (train/setup.py: the settings checked the same way, the same Accelerator
and FSDP plugin, tokenizer, model, LoRA, activation checkpointing, `prepare` order and optimizer); only the loop
differs: one global batch collated once and fed again every step, no loss normalization over the global batch, no
metrics files, no checkpoints, and the global loss all-reduced every step (as `bench` makes our loop log every
step). Whatever our loop costs on top of Accelerate shows up as the ratio.

Run inside a launch:
    python -m accel_fsdp.tools.baseline RECIPE_PATH OUT_JSON --steps N --warmup W [--set ...] [--cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from accel_fsdp.config.recipe import load_recipe
from accel_fsdp.data.batches import collate
from accel_fsdp.files import write_atomic
from accel_fsdp.quiet import quiet_libraries
from accel_fsdp.train.observe import Terminal


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--cpu", action="store_true", help="the config on CPU ranks (bench --cpu)")
    args = parser.parse_args()

    from accel_fsdp.train.setup import build_sharded_model, describe_model, prepare_run_data, start_engine

    quiet_libraries()
    recipe = load_recipe(args.recipe, args.overrides)
    t = recipe.training
    engine = start_engine(recipe, run_dir=None, cpu=args.cpu)
    acc, world = engine.accelerator, engine.world
    tokenizer, config = describe_model(recipe, engine)
    built = build_sharded_model(recipe, engine, config)
    model, optimizer = built.model, built.optimizer
    # The micro-batches of the run's first optimizer step, collated once, outside the timed loop: the model sees
    # what it sees in our loop (packed documents kept apart by their positions, the attention kernel's layout),
    # so the ratio measures the loop, not the mask. Reading and collating every step is part of ours.
    data = prepare_run_data(recipe, tokenizer, acc, Terminal(acc))
    sampler = data.sampler(t, world_size=world, rank=acc.process_index)
    micro_batches = [{key: value.to(acc.device) if isinstance(value, torch.Tensor) else value
                      for key, value in collate([data.sequence(u) for u in units], tokenizer.pad_token_id,
                                                built.use_position_ids, layout=built.batch_layout).items()}
                     for units in sampler.micro_batches(0)]
    model.train()

    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        for batch in micro_batches:
            with acc.accumulate(model):
                with acc.autocast():
                    loss = model(**batch, use_cache=False).loss
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), t.max_grad_norm or float("inf"))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        acc.reduce(loss.detach(), reduction="sum").item()  # log the global loss every step, as bench runs ours
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    acc.wait_for_everyone()
    if acc.is_main_process:
        step_time = statistics.median(times)
        tokens = t.global_batch_size * recipe.data.seq_len
        write_atomic(args.out, json.dumps({"step_time_s": step_time, "tokens_per_s": tokens / step_time,
                                           "tokens_per_s_per_rank": tokens / step_time / world, "steps": args.steps}))
    acc.end_training()


if __name__ == "__main__":
    main()
