"""`accel-fsdp verify`: prove on the user's own hardware that their training setup is correct.

Each probe is a real `recipe run` of the user's recipe (its model, data, precision, wrapping, offload; a few
optimizer steps on a slice of its data; optionally a depth-reduced copy of the architecture), launched like any run,
in a folder of its own. The checks read what the probes wrote (metrics, sharding.json, the traces of
accel_fsdp/train/probes.py, the exported weights) and compare:

  sharding       every rank holds 1/shard-group of the parameters, of the optimizer state and of a 4-bit base's
                 bytes (model.quantize); trainable weights are fp32 masters, frozen (LoRA) ones stay frozen in
                 their dtype
  precision      the weights a layer multiplies with are in the configured dtype; gradients are reduced in fp32
  equivalence    the same global batch split differently (micro batch x ranks x accumulation; and on fewer ranks)
                 gives the same loss and gradient norm, within a tolerance set by the precision
  resume         save at step k, continue to n; restart from step k to n: the same weights
  packing        packed documents see only themselves (logits equal each document run alone), with the recipe's
                 attention kernel and the trainer's own batch layout
  data           the mixture as the run draws it: each unit once per epoch of its source, each source's share over
                 any 100 steps within 0.01 of its weight, the same sequences per step on 1 rank and on several
  activation checkpointing   with dropout on, losses and gradient norms with and without it agree
  chunked-loss, compile, activation-offload, fp8, quantize   the knobs (tools/knob_checks.py): for each the
                 recipe turns on, 2 steps as it is and 2 without it, losses and gradient norms within the knob's
                 bound
  memory         the model state each rank holds against `estimate`'s prediction (and the peak on GPUs)
  throughput     tokens/s per rank (and MFU on GPUs), for the record

What a pass proves and what it cannot (a passing verify on 2 GPUs does not prove a 64-GPU run) is in
docs/VERIFY.md. Each check is shown to fail when its property is broken on purpose (tests/test_verify.py, with
the switches of train/hooks.py).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from accel_fsdp.config import precision
from accel_fsdp.config.settings import FsdpSettings
from accel_fsdp.errors import UserError
from accel_fsdp.layout import checkpoint_name
from accel_fsdp.model.facts import facts_for
from accel_fsdp.planning.knob_advice import recipe_settings
from accel_fsdp.planning.memory import MemoryInputs, estimate
from accel_fsdp.preflight import preflight
from accel_fsdp.tools.knob_checks import FP8_BASELINE, KNOBS, Knob
from accel_fsdp.tools.noise import ROUNDOFF, adam_step_bound, compare_rows, equivalence_tolerance, reordered
from accel_fsdp.tools.verify_runs import (
    DROPOUT_KEYS,
    Check,
    Probe,
    RunParameters,
    Verification,
    base_sets,
    claim_folder,
    model_type,
    record_counts,
    run_probe,
    split_micro_batch,
    write_report,
)

CHECKS = ("sharding", "precision", "equivalence", "resume", "packing", "data", "activation-checkpointing",
          *(knob.check for knob in KNOBS), "memory", "throughput")
EXPORTED = ["checkpoint.export_final=true"]
"""Added to the reference and resume probes when the resume check runs: it compares their exported weights, and no
other check reads an export (on a large model, writing one is a good part of a probe)."""
SHARE_TOLERANCE = 0.01
"""A source's share of the loss-carrying tokens (or sequences) over any 100 consecutive steps, against its weight."""
PACKING_LIMIT = {"fp32": reordered(2**23), "bf16": 8 * ROUNDOFF["bf16"], "fp16": 8 * ROUNDOFF["fp16"]}
"""Largest logit difference (relative to the logit scale) of a packed document to it alone. fp32: the same products
summed in other orders, up to 2^23 of them on a logit's path (an 80-layer, 8192-wide model at 8K tokens has 7M), 2.4e-3.
16 bits: the layouts round the same fp32 sums and land a unit apart where one straddles a rounding boundary; 8 units.
A leak between documents moves logits by a large part of their scale (0.3 to 1 in the tests' models). fp8: float8
rounds each layer's input on a grid set by the largest element of the batch it sees (2^-4 a layer, packed or alone),
as large as a leak; the layouts do not depend on how the linear layers multiply, so an fp8 recipe's packing is measured
in its bf16 twin (FP8_TWIN) against bf16's limit."""
FP8_TWIN = "fp8-off"
"""The fp8 knob's probe at bf16 (tools/knob_checks.py): an fp8 recipe's packing is measured there."""
STATE_MARGIN = 0.10
"""Model state measured against the estimate: within 10%."""
PEAK_MARGIN = 1.30
"""GPU peak memory against the estimate: at most 30% above (allocator caching, temporaries the formula leaves out)."""
# ------------------------------------------------------------------------------------------------- checks


def check_sharding(v: Verification) -> Check:
    ref = v.probes["reference"]
    info = ref.sharding()
    if not info:
        return Check("sharding", "FAIL", ref.failure())
    total, held, shards = info.parameters, info.local_parameters, info.expected_shards
    fractions = [n / total for n in held]
    ok = all(abs(f - 1 / shards) <= 0.02 + 4096 / total for f in fractions)
    measured = f"ranks hold {', '.join(f'{f:.3f}' for f in fractions)} of the parameters"
    problems = []
    state = info.state_bytes or []
    counts = ref.counts()
    trainable = counts.trainable if counts else None
    if state:
        optimizer = [r["optimizer"] for r in state]
        expected = 8 * (trainable or total) / shards
        measured += f"; optimizer state {', '.join(f'{b / 2**20:,.1f}' for b in optimizer)} MiB per rank"
        if any(abs(b - expected) > 0.10 * expected + 4096 for b in optimizer):
            problems.append(f"optimizer state is not 1/{shards} of 8 bytes per trainable parameter "
                            f"({expected / 2**20:,.1f} MiB)")
    dtypes = ref.trace("dtypes")
    for rank, d in enumerate(dtypes):
        if d["trainable"] != ["torch.float32"]:
            problems.append(f"rank {rank}: trainable parameters are {d['trainable']}, not fp32 masters")
        if d["frozen"] and d["frozen"] != [compute_dtype(v.precision)]:
            problems.append(f"rank {rank}: frozen parameters are {d['frozen']}, not {compute_dtype(v.precision)}")
    if dtypes:
        measured += f"; trainable {dtypes[0]['trainable']}, frozen {dtypes[0]['frozen'] or 'none'}"
    if info.quantized_bytes and info.quantized_whole_bytes:
        text, over = quantized_shares(info.quantized_bytes, info.quantized_whole_bytes, shards)
        measured += f"; {text}"
        problems += over
    if not ok:
        problems.insert(0, f"not sharded over {shards} ranks")
    status = "PASS" if not problems else "FAIL"
    return Check("sharding", status, measured + ("; " + "; ".join(problems) if problems else ""),
                 f"each rank 1/{shards} (+-2%; of 4-bit bytes at most 1/{shards}); optimizer state +-10%; masters fp32",
                 {"fractions": fractions, "dtypes": dtypes, "state_bytes": state})


def quantized_shares(held: list[int], whole: int, shards: int) -> tuple[str, list[str]]:
    """What each rank holds of the 4-bit base (codes and scales, sharding.json) against its share, 1/`shards` of one
    copy (`whole` bytes): FSDP2 cuts each 4-bit weight's codes and scales with its rows, into equal parts
    (model/quantize.py layer_problems), so a rank holding more than its share holds another rank's."""
    share = whole / shards
    text = (f"4-bit bytes per rank {', '.join(f'{b / 2**20:,.2f}' for b in held)} MiB of {whole / 2**20:,.2f} "
            f"({', '.join(f'{b / whole:.3f}' for b in held)})")
    over = [rank for rank, b in enumerate(held) if b > share]
    return text, ([f"rank(s) {', '.join(map(str, over))} hold more than 1/{shards} of the 4-bit bytes "
                   f"({share / 2**20:,.2f} MiB)"] if over else [])


def compute_dtype(name: str) -> str:
    """The compute dtype of precision `name` as the probes record dtypes (`str(torch.bfloat16)`)."""
    return f"torch.{precision.TORCH[name]}"


def check_precision(v: Verification) -> Check:
    ref = v.probes["reference"]
    dtypes = ref.trace("dtypes")
    if not dtypes:
        return Check("precision", "FAIL", ref.failure() if not ref.ok else "no dtype record was written")
    want = compute_dtype(v.precision)
    compute = sorted({d.get("compute") for d in dtypes})
    reduce = sorted({x for d in dtypes for x in d["reduce"]})
    ok = compute == [want] and reduce == ["torch.float32"]
    return Check("precision", "PASS" if ok else "FAIL",
                 f"layers multiply with {', '.join(map(str, compute))} weights; gradients reduced in "
                 f"{', '.join(reduce) or 'nothing recorded'}", f"compute {want}, reduce torch.float32",
                 {"compute": compute, "reduce": reduce})


def tolerance_of(v: Verification, micro_batch: int, steps: int) -> dict[str, float]:
    """`equivalence_tolerance` of this recipe's global batch, with `micro_batch` the smallest micro batch of the runs
    compared (the most micro-steps, on 1 rank at worst)."""
    t = v.recipe.training
    return equivalence_tolerance(v.precision, t.global_batch_size * v.recipe.data.seq_len,
                                 t.global_batch_size // micro_batch, steps)


def check_equivalence(v: Verification) -> Check:
    ref = v.probes["reference"]
    micro = v.recipe.training.micro_batch_size
    tol = tolerance_of(v, min(micro, split_micro_batch(v.recipe, v.world) or micro), 2)
    others = [p for name, p in v.probes.items() if name in ("split", "fewer-ranks")]
    if not others:
        return Check("equivalence", "SKIP", "no other split of the global batch divides evenly here")
    parts, data, ok = [], {}, True
    for probe in others:
        if not probe.ok or not ref.ok:
            return Check("equivalence", "FAIL", (probe if not probe.ok else ref).failure())
        same, dl, dg = compare_rows(probe.train_rows(), ref.train_rows(), tol, 2)
        ok &= same
        parts.append(f"{probe.name}: loss {dl:.1e}, grad norm {dg:.1e}")
        data[probe.name] = {"loss_rel": dl, "grad_norm_rel": dg}
    return Check("equivalence", "PASS" if ok else "FAIL", "largest relative difference over 2 steps: " +
                 "; ".join(parts), f"loss {tol['loss']:g}, grad norm {tol['grad_norm']:g} ({v.precision})", data)


def weight_differences(a: Path, b: Path, typical: float) -> tuple[float, float]:
    """The largest absolute difference of two exports' weights, and the fraction of weights that differ by more than
    `typical` (inf and 1 where they do not hold the same tensors)."""
    from safetensors.torch import load_file

    def load(folder):
        out = {}
        for f in sorted(folder.glob("*.safetensors")):
            out.update(load_file(f))
        return out

    wa, wb = load(a), load(b)
    if set(wa) != set(wb) or not wa:
        return math.inf, 1.0
    largest, above, total = 0.0, 0, 0
    for k in wa:
        d = (wa[k].float() - wb[k].float()).abs()
        largest = max(largest, float(d.max()))
        above += int((d > typical).sum())
        total += d.numel()
    return largest, above / total


def check_resume(v: Verification) -> Check:
    ref, res = v.probes["reference"], v.probes.get("resume")
    if res is None:
        return Check("resume", "SKIP", "fewer than 3 steps: nothing to resume between")
    if not ref.ok or not res.ok:
        return Check("resume", "FAIL", (res if not res.ok else ref).failure())
    exact = v.device == "cpu"
    if exact:
        limit = typical = 0.0
    else:
        # GPU kernels need not be deterministic: rounding moves an AdamW step by its share of the gradient, and the step
        # of a gradient that is rounding noise itself by the whole step either way. All within that, most the share.
        t, rows = v.recipe.training, ref.train_rows()
        after = rows[2:]
        limit = 2 * adam_step_bound(t.adam_beta1, t.adam_beta2, len(rows)) * sum(r.lr for r in after)
        typical = limit * tolerance_of(v, t.micro_batch_size, len(after))["grad_norm"]
    diff, spread = weight_differences(ref.layout.final, res.layout.final, typical)
    ok = diff <= limit and (exact or spread <= 0.5)
    return Check("resume", "PASS" if ok else "FAIL",
                 f"largest weight difference after resuming from step 2: {diff:.3g}" +
                 ("" if exact else f"; {spread:.1%} of the weights differ by more than {typical:.3g}"),
                 "bit-identical (CPU kernels are deterministic)" if exact else
                 f"largest {limit:.3g} (the runs' largest AdamW steps apart), at least half within {typical:.3g} "
                 "(GPU kernels need not be deterministic)",
                 {"max_abs_difference": diff, "fraction_above_typical": spread})


def check_activation_checkpointing(v: Verification) -> Check:
    on, off = v.probes.get("ac-on"), v.probes.get("ac-off")
    if on is None:
        return Check("activation-checkpointing", "SKIP", "no dropout setting known for this model type")
    if not on.ok or not off.ok:
        return Check("activation-checkpointing", "FAIL", (on if not on.ok else off).failure())
    exact = v.device == "cpu"
    tol = {"loss": 0.0, "grad_norm": 0.0} if exact else tolerance_of(v, v.recipe.training.micro_batch_size, 2)
    same, dl, dg = compare_rows(on.train_rows(), off.train_rows(), tol, 2)
    return Check("activation-checkpointing", "PASS" if same else "FAIL",
                 f"with dropout 0.1, with vs without: loss {dl:.1e}, grad norm {dg:.1e} relative difference",
                 "identical (CPU)" if exact else f"loss {tol['loss']:g}, grad norm {tol['grad_norm']:g}",
                 {"loss_rel": dl, "grad_norm_rel": dg})


def check_knob(v: Verification, knob: Knob) -> Check:
    """The recipe with the knob and without it (tools/knob_checks.py): losses and gradient norms within its bound."""
    on, off = v.probes.get(f"{knob.check}-on"), v.probes.get(f"{knob.check}-off")
    if on is None:
        return Check(knob.check, "SKIP", f"{knob.key} is {knob.value(v.recipe, v.precision)} in this recipe: nothing "
                     "to prove")
    if not on.ok or not off.ok:
        return Check(knob.check, "FAIL", (on if not on.ok else off).failure())
    return Check(knob.check, *knob.judge(on.train_rows(), off.train_rows(), v.recipe, v.precision, v.device))


def knob_probe_plan(recipe, precision_name: str, wanted: set[str]) -> list[tuple[str, list[str], bool]]:
    """(name, what it sets, whether it measures packing) of the knob probes verify runs: each knob's pair where its
    check is wanted, and an fp8 recipe's bf16 twin where packing is (its packing is measured there: PACKING_LIMIT)."""
    plan = []
    for knob in KNOBS:
        for name, knob_sets in knob.probes(recipe, precision_name):
            packing_here = name == FP8_TWIN and "packing" in wanted
            if knob.check in wanted or packing_here:
                plan.append((name, knob_sets, packing_here))
    return plan


def check_packing(v: Verification) -> Check:
    """What the reference probe's `packing` probe measured inside the trainer (accel_fsdp/train/probes.py): packed
    sequences laid out by the run's own collate for its attention kernel, against each document run alone."""
    measured_in, at = ("reference", v.precision) if v.precision != precision.FP8 else (FP8_TWIN, FP8_BASELINE)
    ref = v.probes[measured_in]
    records = ref.trace("packing")
    if not records:
        return Check("packing", "FAIL", ref.failure() if not ref.ok else "no packing record was written")
    worst = max(r["relative_difference"] for r in records)
    first = records[0]
    limit = PACKING_LIMIT[at]
    return Check("packing", "PASS" if worst <= limit else "FAIL",
                 f"{first['documents']} documents in {first['sequences']} sequences ({first['layout']} batch, "
                 f"{first['attention']}): largest logit difference to each document alone {worst:.1e} of the logit "
                 f"scale{'' if at == v.precision else f' (in the {at} probe {FP8_TWIN})'}", f"{limit:g} ({at})",
                 {"documents": first["documents"], "relative_difference": worst, "layout": first["layout"],
                  "attention": first["attention"]})


def check_data(v: Verification) -> Check:
    """The mixture, as the run's own sampler draws it (the reference probe's `data` probe), and as the loop read it:
    the sequences of each step on 1 rank and on the probe's ranks (their row traces)."""
    ref = v.probes["reference"]
    records = ref.trace("data")
    if not records:
        return Check("data", "FAIL", ref.failure() if not ref.ok else "no data record was written")
    r = records[0]
    sources = v.recipe.data.resolved_sources()
    weights = [s.weight / sum(x.weight for x in sources) for s in sources]
    deviation = max(max(abs(low - w), abs(high - w)) for (low, high), w in zip(r["share_range"], weights))
    problems = []
    if r["repeats"] or r["missing"]:
        problems.append(f"{r['repeats']} units read twice within an epoch of their source, {r['missing']} left out of "
                        "a finished epoch")
    if deviation > SHARE_TOLERANCE:
        problems.append(f"a source's share is {deviation:.3f} away from its weight")
    what = "loss-carrying tokens" if r["by_cost"] else "sequences"
    measured = (f"{r['units']:,} units over {r['steps']:,} steps ({r['epochs_completed']} source epochs finished): "
                f"{r['repeats']} read twice in an epoch, {r['missing']} missed; shares of {what} over any "
                f"{r['window']} steps within {deviation:.4f} of the weights")
    data = dict(r, max_share_deviation=deviation, weights=weights)
    one = v.probes.get("fewer-ranks")
    if v.world > 1 and one is not None and one.ok and ref.ok:
        many, single = step_units(ref), step_units(one)
        steps = sorted(set(many) & set(single))
        differ = [s for s in steps if sorted(many[s]) != sorted(single[s])]
        measured += (f"; steps 1-{len(steps)}: 1 rank and {v.world} ranks read "
                     + ("the same sequences" if not differ else f"different sequences at step(s) {differ}"))
        if differ or not steps:
            problems.append("the sequences of a step depend on the number of ranks")
        data["ranks_compared"] = [1, v.world]
    elif v.world > 1:
        measured += "; 1 rank against several: not compared (--quick, or the global batch does not fit on 1 rank)"
    return Check("data", "FAIL" if problems else "PASS", measured + ("; " + "; ".join(problems) if problems else ""),
                 f"each unit once per epoch; shares within {SHARE_TOLERANCE} of the weights; the same sequences on "
                 "any number of ranks", data)


def step_units(probe: Probe) -> dict[int, list[int]]:
    """The training units each step read, over all ranks of a probe (its unit traces, ACCEL_FSDP_TRACE_UNITS)."""
    out: dict[int, list[int]] = {}
    for path in sorted(probe.layout.trace.glob("units-rank*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            out.setdefault(row["step"], []).extend(row["units"])
    return out


def check_memory(v: Verification) -> Check:
    ref = v.probes["reference"]
    info = ref.sharding()
    if info is None or not info.state_bytes:
        return Check("memory", "FAIL", ref.failure())
    counts = ref.counts()
    if counts is None:
        return Check("memory", "FAIL", ref.failure() if not ref.ok else "no checkpoint recorded the parameter counts")
    settings = ref.settings()
    lora = counts.trainable < counts.parameters
    predicted = estimate(MemoryInputs(
        params=counts.parameters, trainable=counts.trainable, largest_unit=0, world=v.world,
        shard_group=info.expected_shards, strategy=settings.sharding_strategy.value,
        precision=precision.MEMORY[v.precision], offload=settings.cpu_offload.value,
        frozen_bytes=precision.BYTES[v.precision] if lora else 4))
    want = predicted.model_state + predicted.host
    measured = info.model_state_bytes()
    ratios = [m / want for m in measured]
    ok = all(abs(r - 1) <= STATE_MARGIN for r in ratios)
    text = f"model state per rank {', '.join(f'{r:.2f}' for r in ratios)} x the estimate ({want / 2**20:,.1f} MiB)"
    data = {"state_ratio": ratios}
    t = v.recipe.training
    rows = ref.train_rows()
    if v.device == "cuda" and rows:
        peak = rows[-1].peak_memory_bytes_run or rows[-1].peak_memory_bytes
        full = estimate(predicted_inputs(v, counts, info, settings))
        peak_ratio = [p / full.total for p in peak]
        ok &= all(r <= PEAK_MARGIN for r in peak_ratio)
        text += f"; GPU peak {', '.join(f'{r:.2f}' for r in peak_ratio)} x the estimate"
        data["peak_ratio"] = peak_ratio
    text += f"; the recipe's micro batch ({t.micro_batch_size} x {v.recipe.data.seq_len} tokens) ran"
    return Check("memory", "PASS" if ok else "FAIL", text,
                 f"state within {STATE_MARGIN:.0%}" + (f", GPU peak at most {PEAK_MARGIN:.2f}x" if v.device == "cuda"
                                                         else "; CPU peak memory is the whole process: not compared"),
                 data)


def predicted_inputs(v: Verification, counts: RunParameters, info, settings: FsdpSettings) -> MemoryInputs:
    """The memory model's inputs for the whole of a step (activations included) of the reference probe."""
    facts = facts_for(v.recipe)
    return MemoryInputs(params=counts.parameters, trainable=counts.trainable,
                        largest_unit=facts.block_params() if facts else 0, world=v.world,
                        shard_group=info.expected_shards, strategy=settings.sharding_strategy.value,
                        precision=precision.MEMORY[v.precision],
                        offload=settings.cpu_offload.value,
                        activation_checkpointing=settings.activation_checkpointing.value,
                        micro_batch=v.recipe.training.micro_batch_size, seq_len=v.recipe.data.seq_len,
                        shape=facts.shape() if facts else None, **recipe_settings(v.recipe, v.precision))


def check_throughput(v: Verification) -> Check:
    rows = v.probes["reference"].train_rows()[1:]  # the first step includes warm-up
    if not rows:
        return Check("throughput", "INFO", "no steps measured")
    per_rank = statistics.median(r.tokens_per_s_per_rank for r in rows)
    mfu = [r.mfu for r in rows if r.mfu is not None]
    return Check("throughput", "INFO", f"{per_rank:,.0f} tokens/s per rank" +
                 (f", MFU {statistics.median(mfu):.1%}" if mfu else "") + f" ({v.device}, {v.precision})",
                 "for the record", {"tokens_per_s_per_rank": per_rank, "mfu": statistics.median(mfu) if mfu else None})


# -------------------------------------------------------------------------------------------------- driver


def verify(recipe, config, num_processes: int | None, overrides: list[str], *, out_dir: Path, quick: bool,
           layers: int | None, steps: int, only: list[str], cpu: bool = False) -> Verification:

    report = preflight(recipe, config, num_processes=num_processes, check_hub=True, cpu_option=True)
    s = report.settings
    v = Verification(recipe=recipe, config=config, world=s.num_processes.value, precision=s.mixed_precision.value,
                     device=s.device.value, steps=steps, out_dir=out_dir, overrides=list(overrides), layers=layers,
                     cpu=cpu)
    claim_folder(out_dir)
    wanted = set(only or CHECKS)
    sets = base_sets(v, steps)
    extra = ["--num-processes", str(num_processes)] if num_processes else []
    print(f"verify: {recipe.name} on {config.label}: {v.world} rank(s), {v.device}, {v.precision}; probes of "
          f"{steps} steps in {out_dir}", flush=True)
    needs_reference = wanted & {"sharding", "precision", "equivalence", "resume", "packing", "data", "memory",
                                "throughput"}
    traced = {}
    if needs_reference:
        from accel_fsdp.train.hooks import PROBE_ENV, TRACE_ENV  # torch: only once probes run

        traced = {TRACE_ENV: "1"}
        run_probe(v, "reference", sets + (EXPORTED if "resume" in wanted else []), extra_args=extra,
                  env={PROBE_ENV: "dtypes,packing,data", **traced})
        record_counts(v.probes["reference"])
    if "equivalence" in wanted:
        micro = split_micro_batch(recipe, v.world)
        if micro:
            run_probe(v, "split", sets + [f"training.micro_batch_size={micro}", "training.max_steps=2"],
                      extra_args=extra)
    t = recipe.training
    if not quick and v.world > 1 and t.splits_evenly(1) and wanted & {"equivalence", "data"}:
        run_probe(v, "fewer-ranks", sets + ["training.max_steps=2"], extra_args=["--num-processes", "1"], env=traced)
    if "resume" in wanted and steps >= 3:
        step_dir = v.probes["reference"].layout.checkpoints / checkpoint_name(2)  # resume needs the reference
        run_probe(v, "resume", sets + EXPORTED, extra_args=[*extra, "--resume-from", str(step_dir)])
    if "activation-checkpointing" in wanted:
        keys = DROPOUT_KEYS.get(model_type(recipe))
        if keys:
            dropout = [f"model.config_overrides.{k}=0.1" for k in keys] + ["training.max_steps=2"]
            for name, on in (("ac-on", "true"), ("ac-off", "false")):
                run_probe(v, name, sets + dropout + [f"model.activation_checkpointing={on}"], extra_args=extra)
    for name, knob_sets, packing_here in knob_probe_plan(recipe, v.precision, wanted):
        run_probe(v, name, sets + knob_sets, extra_args=extra,
                  env={PROBE_ENV: "packing", **traced} if packing_here else None)
    runners = {"sharding": check_sharding, "precision": check_precision, "equivalence": check_equivalence,
               "resume": check_resume, "packing": check_packing, "data": check_data, "activation-checkpointing":
               check_activation_checkpointing, "memory": check_memory, "throughput": check_throughput,
               **{knob.check: (lambda v, knob=knob: check_knob(v, knob)) for knob in KNOBS}}
    for name in CHECKS:
        if name in wanted:
            try:
                v.checks.append(runners[name](v))
            except UserError:
                raise
            except Exception as e:  # a check that cannot run says why instead of hiding the others
                v.checks.append(Check(name, "FAIL", f"could not be measured: {type(e).__name__}: {e}"))
    write_report(v)
    return v
