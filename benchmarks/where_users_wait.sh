#!/usr/bin/env bash
# The figures of docs/PERFORMANCE.md "Where users wait": CLI answer times (median of 5), quickstart end to end in
# the config's precision and in fp32 (wall, time to first step by phase, seconds per step), and generate.
# Run from anywhere with the project's environment active; writes only into a temporary folder.
set -euo pipefail
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
med() { python3 -c "import sys,statistics; print(f'{statistics.median(float(x) for x in sys.stdin.read().split()):.2f}')"; }
timed() { local s; s=$(date +%s.%N); "$@" >/dev/null 2>&1 || true; python3 -c "print($(date +%s.%N) - $s)"; }
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, native bf16: $(grep -qw -e avx512_bf16 -e amx_bf16 /proc/cpuinfo && echo yes || echo no)"
for c in "accel-fsdp --help" "accel-fsdp recipe list" "accel-fsdp recipe show gpt2-xl" "accel-fsdp recipe keys" \
         "accel-fsdp estimate gpt2-xl" "accel-fsdp recipe validate gpt2-xl" "accel-fsdp recipe validate quickstart"; do
  # shellcheck disable=SC2086
  echo "$c: median of 5 = $(for _ in 1 2 3 4 5; do timed $c; done | med) s"
done
for p in default fp32; do
  extra=()
  [ "$p" = fp32 ] && extra=(--set training.mixed_precision=fp32)
  s=$(date +%s.%N)
  accel-fsdp recipe run quickstart --output-dir "run-$p" "${extra[@]}" > "run-$p.log" 2>&1
  e=$(date +%s.%N)
  python3 - "$p" "$s" "$e" <<'PY'
import json, statistics, sys
p, s, e = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
rows = [json.loads(line) for line in open(f"run-{p}/metrics.jsonl")]
train = [r for r in rows if r["kind"] == "train"]
start = next(r for r in rows if r["kind"] == "startup")
prec = json.load(open(f"run-{p}/fsdp_settings.json"))["mixed_precision"]
print(f"quickstart {p}: {prec['value']} ({prec['source']}); wall {e - s:.1f} s; time to first step "
      f"{start['time_to_first_step_s']} s {start['phases_s']}; median s/step "
      f"{statistics.median(r['step_time_s'] for r in train):.3f}; loss {train[0]['loss']:.2f} -> {train[-1]['loss']:.2f}")
PY
done
echo "generate: median of 5 = $(for _ in 1 2 3 4 5; do timed accel-fsdp generate run-default --prompt 'alice has a' --max-new-tokens 16; done | med) s"
