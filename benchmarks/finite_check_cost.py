"""What the finite-step check costs (train/finite.py), three ways side by side: no check; the norm read by the host
before the optimizer step (`is_finite`: the host waits for the backward, then launches the optimizer step and the
next forward while the GPU idles; the check as it was first written); and the check as it runs now (`StepFlag`: the
fused AdamW skips a non-finite step on the device through `found_inf`, and the host reads the verdict one step later).

    python benchmarks/finite_check_cost.py              # one GPU: llama-3.2-1b (4 x 2,048) and gpt2 (8 x 1,024)
    python benchmarks/finite_check_cost.py --cpu        # one CPU rank, tiny models: the mechanism, not the figures
    torchrun --nproc_per_node 8 benchmarks/finite_check_cost.py

Each model is built from its config (random weights, no download; model/architectures.py), sharded with FSDP2 as a
run shards it (each block, then the root; bf16 parameters with fp32 reduction on a GPU), and trained with fused AdamW
on random tokens. The step is the loop's (train/loop.py) without its data and logging: forward and backward, clip,
the check of the variant, optimizer step, zero_grad. Nothing else in the step reads the device, so a difference is
the check's whole cost (an upper bound for a real run, whose logging steps read too). The variants alternate in blocks
of --steps steps, timed with one synchronization at each block's end; the figure is the median over --rounds blocks
of the mean step. Then one step with a nan loss through `StepFlag`: its weights must stay as they were and the host
must read the verdict (the mechanism on this device). Prints one line per model; exit 1 if the probe fails.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from accel_fsdp.model.architectures import KNOWN
from accel_fsdp.train.finite import StepFlag, is_finite

GPU_MODELS = (("llama-3.2-1b", 4, 2048, {}), ("gpt2", 8, 1024, {}))
CPU_MODELS = (("llama-3.2-1b", 2, 64, {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                        "vocab_size": 512, "bos_token_id": 0, "eos_token_id": 1}),
              ("gpt2", 2, 64, {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512, "bos_token_id": 0,
                               "eos_token_id": 1}))


def build(name: str, overrides: dict, device: torch.device, mesh, bf16: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = KNOWN[name]
    config = AutoConfig.for_model(arch.model_type, **{**arch.config_kwargs(), **overrides})
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else (
        MixedPrecisionPolicy())
    for block in model.base_model.h if arch.model_type == "gpt2" else model.base_model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model, config.vocab_size


VARIANTS = ("no check", "read before the step", "skipped on the device")


def train_step(model, optimizer, tokens: torch.Tensor, variant: str, flag: StepFlag, step: int, pending: list,
               poison: bool = False) -> None:
    loss = model(input_ids=tokens, labels=tokens).loss * (float("nan") if poison else 1.0)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if variant == VARIANTS[1] and not is_finite(norm):
        raise SystemExit("the gradient norm is not finite")
    if variant == VARIANTS[2]:
        if pending and not StepFlag.finite(pending.pop()):
            raise SystemExit("the gradient norm is not finite")
        pending.append(flag.set(step, norm, loss.detach()))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def time_steps(model, optimizer, tokens: torch.Tensor, steps: int, variant: str, flag: StepFlag, sync) -> float:
    """The mean seconds of `steps` optimizer steps, the host synchronized only at the ends."""
    sync()
    started, pending = time.perf_counter(), []
    for step in range(steps):
        train_step(model, optimizer, tokens, variant, flag, step, pending)
    if pending and not StepFlag.finite(pending.pop()):
        raise SystemExit("the gradient norm is not finite")
    sync()
    optimizer.found_inf = None
    return (time.perf_counter() - started) / steps


def probe(model, optimizer, tokens: torch.Tensor, flag: StepFlag) -> str:
    """One step of a nan loss through the flag: the weights and moments as they were, and the verdict read."""
    before = [p.detach().to_local().clone() if hasattr(p, "to_local") else p.detach().clone()
              for p in model.parameters()]
    moments = [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]
    pending: list = []
    train_step(model, optimizer, tokens, VARIANTS[2], flag, 0, pending, poison=True)
    seen = not StepFlag.finite(pending.pop())
    optimizer.found_inf = None
    kept = all(torch.equal(b, p.detach().to_local() if hasattr(p, "to_local") else p.detach())
               for b, p in zip(before, model.parameters()))
    kept_moments = all(torch.equal(m, optimizer.state[p]["exp_avg"]) for m, p in zip(moments, model.parameters()))
    return "PASS" if seen and kept and kept_moments else (
        f"FAIL (verdict read {seen}, weights kept {kept}, moments kept {kept_moments})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="one CPU rank over gloo, tiny models")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps of a timed block")
    parser.add_argument("--rounds", type=int, default=5, help="blocks of each variant, alternating")
    args = parser.parse_args()
    from accel_fsdp.quiet import quiet_libraries

    quiet_libraries()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    cuda = not args.cpu and torch.cuda.is_available()
    if not args.cpu and not cuda:
        raise SystemExit("finite_check_cost: no CUDA device visible; --cpu runs the mechanism on a CPU rank")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    where = torch.cuda.get_device_name(device) if cuda else "CPU"
    if rank == 0:
        print(f"finite-step check on {world} x {where} (torch {torch.__version__}), the mean step of blocks of "
              f"{args.steps} steps, median of {args.rounds} blocks per variant [each block]:", flush=True)
    failed = False
    for name, micro_batch, seq_len, overrides in CPU_MODELS if args.cpu else GPU_MODELS:
        model, vocab = build(name, overrides, device, mesh, bf16=cuda)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        flag = StepFlag(optimizer)
        generator = torch.Generator(device=device).manual_seed(rank)
        tokens = torch.randint(0, vocab, (micro_batch, seq_len), device=device, generator=generator)
        time_steps(model, optimizer, tokens, 2, VARIANTS[2], flag, sync)  # warm-up: allocator, kernels, state
        times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
        for _ in range(args.rounds):
            for variant in VARIANTS:
                times[variant].append(time_steps(model, optimizer, tokens, args.steps, variant, flag, sync))
        verdict = probe(model, optimizer, tokens, flag)
        failed = failed or verdict != "PASS"
        base = statistics.median(times[VARIANTS[0]])
        if rank == 0:
            figures = "; ".join(
                f"{variant} {1000 * statistics.median(times[variant]):.2f} ms"
                + ("" if variant == VARIANTS[0] else f" ({statistics.median(times[variant]) / base - 1:+.2%})")
                + f" [{', '.join(f'{1000 * t:.1f}' for t in times[variant])}]" for variant in VARIANTS)
            print(f"  {name} ({micro_batch} x {seq_len:,} tokens a rank): {figures}; a nan step through the "
                  f"device's skip: {verdict}", flush=True)
        del model, optimizer
        if cuda:
            torch.cuda.empty_cache()
    dist.destroy_process_group()
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
