#!/usr/bin/env bash
# Where the engine's process spends its time while serving: bench/serve.py (the engine in its own process)
# runs in the background; once the engine steps, py-spy records the engine's process (every thread, idle
# stacks included, raw folded stacks, without pausing it) for SPY_S seconds.
# Needs py-spy (its wheel in .whl: `pip download --no-deps py-spy`) and the staged model, as gpu_session.sh's
# `serve` step has them. Usage (from the repository root, in gpu_session.sh's environment):
#   SPY_CONFIG=eagle SPY_CONC=48 [SPY_NATIVE=1] [SPY_WHO=server|both] [SPY_TAG=x] bash bench/probes/serve_spy.sh
#   → $OUT/spy${SPY_TAG}.txt (the engine's or the server's process), with SPY_WHO=both the server's in
#   $OUT/spy${SPY_TAG}_server.txt (both recorded at once), and $OUT/spy${SPY_TAG}_serve.log
set -u
spy="${PY_SPY:-$HOME/site/bin/py-spy}"
python3 bench/serve.py --model smollm2 --prompts .data/mtbench.jsonl --configs "${SPY_CONFIG:-eagle}" \
  --concurrency "${SPY_CONC:-48}" --requests-per-client "${SPY_PER_CLIENT:-16}" --max-tokens 256 \
  ${SPY_EXTRA:+--extra "$SPY_EXTRA"} > "$OUT/spy${SPY_TAG:-}_serve.log" 2>&1 &
bench=$!
pid=""
for _ in $(seq 1 300); do  # the engine's process: the one using the GPU
  pid=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | head -1 | tr -d ' ')
  [ -n "$pid" ] && "$spy" dump --pid "$pid" 2>/dev/null | grep -q "EngineLoop._step" && break
  sleep 1
done
echo "engine process: ${pid:-none}"
# SPY_WHO=server: record the server's own process instead (bench/serve.py: uvicorn, the HTTP/JSON work)
[ -n "$pid" ] && [ "${SPY_WHO:-engine}" = server ] && pid=$bench && echo "recording the server's process: $pid"
if [ -n "$pid" ]; then
  # SPY_NATIVE=1: native frames too (what XLA does inside an executable's call); py-spy then pauses the
  # process at each sample (no --nonblocking), so its throughput reads lower.
  mode=(--nonblocking); [ -n "${SPY_NATIVE:-}" ] && mode=(--native)
  rec=("$spy" record --duration "${SPY_S:-8}" --rate "${SPY_RATE:-250}" --threads --idle "${mode[@]}" --format raw)
  [ "${SPY_WHO:-engine}" = both ] && { "${rec[@]}" --pid "$bench" -o "$OUT/spy${SPY_TAG:-}_server.txt" & }
  "${rec[@]}" --pid "$pid" -o "$OUT/spy${SPY_TAG:-}.txt"
fi
wait "$bench"; wait
grep -v '^{"bench\|Delay kernel' "$OUT/spy${SPY_TAG:-}_serve.log" | tail -4
