#!/usr/bin/env bash
# One GPU session's work, run on the device machine from the repo root (see bench/RESULTS.md).
# bench/make_stages.sh builds the staged parts below on the development machine.
# The SmolLM2 GGUF (98.4 MB) travels in three parts (a call carries 64 MiB, the repo ~21 MB of it):
#   .stage1 = smolpart.aa + data.tar.xz (the prompt files: `tar cJf data.tar.xz .data` after
#   `python -m jeagle.train.sources eval ... --out-dir .data` and `... build ... --out .data/mix.jsonl`, README's
#   "Training a head"; an older dataset as data0.npz.xz, optional), .stage2 = smolpart.ab,
#   .stage3 = smolpart.ac (+ eagle1_head.tar from an earlier eaglepeer, optional), .stage4 (optional) = data.npz and
#   data.json of an earlier trainhead (a partial dataset's regeneration continues). Calls, back to back while warm:
#   carry .stage1: `bash bench/gpu_session.sh stage`; carry .stage2: `bash bench/gpu_session.sh stage`;
#   carry .stage3 + .whl: `bash bench/gpu_session.sh run STEPS...` (later calls: carry .whl only). Before a call
#   that records runs: `bash bench/stamp_commit.sh` and carry .commit too (the commit the JSONs name).
# startup (issue 27: first and second start of the README command) needs the staged GGUF like bench;
# so does ttft (issue 25: a prefix-cache hit's time to first token by host phase, with a trace).
# masks needs the staged GGUF (its tokenizer); so do roundevents, allocab, vmmcheck, shrink, linearab (decode A/B of JEAGLE_LINEAR=0|1), adaptrounds, adaptpaired, continuous and serveab. Random-weight steps (trainstep, tp, profile, phases, kerneltests, kernelbench, kernelround, specbench, overhead, warmup, cmdbuf, tierswitch, adaptoverhead, hostcall, graphlaunch, hostopts, adaptive, autotune, dispatchthread, splitweights, prefillcall) need no staging: `bash bench/gpu_session.sh run kerneltests kernelbench kernelround`.
set -uo pipefail
mode="${1:-run}"
stage_in() {  # whatever staged parts this call carries -> $HOME/stage; unpack the data archives once
  mkdir -p "$HOME/stage"
  for d in .stage*; do [ -d "$d" ] && cp "$d"/* "$HOME/stage/"; done
  [ -f "$HOME/stage/data0.npz.xz" ] && [ ! -f "$HOME/data0.npz" ] && xz -dc "$HOME/stage/data0.npz.xz" > "$HOME/data0.npz"
  [ -f "$HOME/stage/data.tar.xz" ] && [ ! -d "$HOME/.data" ] && tar xJf "$HOME/stage/data.tar.xz" -C "$HOME"
  [ -d .data ] || { [ -d "$HOME/.data" ] && ln -s "$HOME/.data" .data; }
  # A dataset from an earlier machine (its data.npz + data.json in a staged part of their own): trainhead takes
  # .data/data.npz as its run's dataset, and continues its regeneration where that stopped.
  [ -f "$HOME/stage/data.npz" ] && [ -f "$HOME/stage/data.json" ] && [ -d .data ] && [ ! -f .data/data.npz ] \
    && cp "$HOME/stage/data.npz" "$HOME/stage/data.json" .data/
  # An EAGLE-1 head from an earlier `eaglepeer` (its eagle1_head.tar in a staged part): no retraining.
  [ -f "$HOME/stage/eagle1_head.tar" ] && [ ! -d "$HOME/run_eagle1/head" ] && mkdir -p "$HOME/run_eagle1" \
    && tar xf "$HOME/stage/eagle1_head.tar" -C "$HOME/run_eagle1"
  return 0
}
stage_in
# The commit runs record (jeagle.git_commit): the tree's, stamped on the development machine by
# bench/stamp_commit.sh and carried as .commit/ (the device copy's .git is stale), unless JEAGLE_COMMIT is set.
if [ -z "${JEAGLE_COMMIT:-}" ] && [ -f .commit/HEAD ]; then export JEAGLE_COMMIT="$(cat .commit/HEAD)"; fi
if [ "$mode" = stage ]; then
  ls -la "$HOME/stage" "$HOME"/*.npz 2>/dev/null
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  exit 0
fi
export JEAGLE_CACHE="$HOME/jcache"
mkdir -p "$JEAGLE_CACHE/gguf" "$OUT"
gguf="$JEAGLE_CACHE/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -f "$HOME/stage/smolpart.ac" ] && [ ! -f "$gguf" ]; then  # the real model; random-weight steps need none of it
  cat "$HOME/stage"/smolpart.a? > "$gguf"
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $gguf" | sha256sum -c - || { rm -f "$gguf"; exit 3; }
fi
if [ -d .whl ]; then
  [ -d "$HOME/site/gguf" ] && [ -d "$HOME/site/eagle" -o -z "$(ls .whl/eagle_llm-*.whl 2>/dev/null)" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target "$HOME/site" .whl/*.whl || exit 4
fi
export PYTHONPATH="$HOME/site:$PWD" PYTHONUNBUFFERED=1 JEAGLE_TEST_GPU=1 TOKENIZERS_PARALLELISM=false
python3 -c "import jax, flax, transformers; print(jax.__version__, flax.__version__, transformers.__version__, jax.devices())"
shift || true
steps=" ${*:-tests bench} "
if [[ "$steps" == *" gputests "* ]]; then  # the GPU runner's suite: README "Tests"
  start=$(date +%s)
  python3 -m pytest -q -m gpu --durations=25 ${GPUTESTS_ARGS:-} 2>&1 | grep -v "Converting\|Loading" | tee "$OUT/pytest_gpu.log"
  echo "pytest -m gpu wall: $(( $(date +%s) - start )) s" | tee -a "$OUT/pytest_gpu.log"
fi
if [[ "$steps" == *" partings "* ]]; then  # where bf16 EAGLE parts from target-only; deterministic mode's equality and cost
  for spec in ${PARTINGS_RUNS:-default:1,16 deterministic:1,16,48}; do
    python3 bench/probes/partings.py --prompts .data/mtbench.jsonl --num-prompts 48 --batch1-prompts "${PARTINGS_B1:-4}" \
      --max-new-tokens "${PARTINGS_TOKENS:-128}" --modes "${spec%%:*}" --batch-sizes "${spec#*:}" \
      --json-out "$OUT/partings_${spec%%:*}.json" 2>&1 | grep -v "Converting\|Loading\|^{" | tee -a "$OUT/partings.log"
  done
fi
if [[ "$steps" == *" detcost "* ]]; then  # deterministic mode's cost at batch 16: as built, with autotuning on, and by phase
  python3 bench/probes/deterministic_cost.py --shape smollm2 --batch-sizes ${DETCOST_BATCHES:-16} --tau 3.2 \
    --json-out "$OUT/detcost.json" 2>&1 | grep -v '^{"probe"' | tee "$OUT/detcost.log"
  JEAGLE_XLA_OPTIONS='{"xla_gpu_autotune_level": 4}' python3 bench/probes/deterministic_cost.py --shape smollm2 \
    --batch-sizes ${DETCOST_BATCHES:-16} --tau 3.2 --json-out "$OUT/detcost_autotune.json" 2>&1 | grep -v '^{"probe"' \
    | sed 's/^/autotune4: /' | tee -a "$OUT/detcost.log"
  for det in "" --deterministic; do
    timeout 240 python3 bench/profile_decode.py --shape smollm2 --batch-sizes 16 --spec 5,4,8 --simulate-accept 3.2 \
      --steps 16 --top 15 $det 2>&1 | grep -v "Converting\|Loading" | tee -a "$OUT/detcost_profile.log"
  done
fi
if [[ "$steps" == *" tests "* ]]; then
  python3 -m pytest -q -m gpu -s tests/test_gpu.py 2>&1 | grep -v "Converting\|Loading" | tee "$OUT/pytest_gpu.log"
  python3 -m pytest -q -x tests/test_parity_hf.py tests/test_cache.py tests/test_engine.py 2>&1 | tail -5 | tee "$OUT/pytest_cpu_suite_on_gpu.log"
fi
if [[ "$steps" == *" spectests "* ]]; then
  python3 -m pytest -q -x tests/test_spec.py -k "hand or oracle or eos or committed or split" 2>&1 | tail -5 | tee "$OUT/pytest_spec_on_gpu.log"
fi
if [[ "$steps" == *" prefix "* ]]; then  # issue 25: prefix cache TTFT, slots on demand + retraction capacity
  python3 bench/prefix.py --prompts .data/mtbench.jsonl --scenarios "${PREFIX_SCENARIOS:-ttft,capacity}" \
    --json-out "$OUT/prefix.json" ${PREFIX_ARGS:-} 2>&1 | grep -v "Converting\|Loading" | tee "$OUT/prefix.log"
fi
if [[ "$steps" == *" ttft "* ]]; then  # issue 25: where a prefix-cache hit's time to first token goes (host phases + trace)
  python3 bench/probes/ttft_phases.py --prompts .data/mtbench.jsonl --requests "${TTFT_REQUESTS:-12}" \
    --trace "$OUT/ttft_trace" --json-out "$OUT/ttft_phases.json" ${TTFT_ARGS:-} 2>&1 | grep -v "^{\"bench" | tee "$OUT/ttft_phases.log"
  python3 - "$OUT/ttft_trace" <<'PY' 2>&1 | tee -a "$OUT/ttft_phases.log"
import glob, os, sys
sys.path.insert(0, "bench")
from collections import defaultdict
from common import device_events_by_device, idle_gaps
for d in sorted(glob.glob(sys.argv[1] + "/*")):
    ev = [e for evs in device_events_by_device(d, with_module=True).values() for e in evs]
    if not ev:
        continue
    idle, gaps = idle_gaps(ev, top=6)
    t0 = min(e[2] for e in ev)
    span = max(e[2] + e[1] for e in ev) - t0
    per = defaultdict(lambda: [0.0, 1e18, 0.0])  # module: busy us, first start, last end (from t0)
    for name, dur, start, mod in ev:
        p = per[mod or name[:40]]
        p[0] += dur; p[1] = min(p[1], start - t0); p[2] = max(p[2], start + dur - t0)
    print(f"{os.path.basename(d)}: kernels span {span / 1e3:.3f} ms, idle {idle / 1e3:.3f} ms; largest gaps (ms) "
          f"{[round(g / 1e3, 3) for g in gaps]}")
    for mod, (busy, a, b) in sorted(per.items(), key=lambda kv: kv[1][1])[:12]:
        print(f"    {mod[:60]:60s} busy {busy / 1e3:7.3f} ms  from {a / 1e3:8.3f} to {b / 1e3:8.3f} ms")
    kern = defaultdict(lambda: [0.0, 0])  # the prefill's kernels by name: total us, count
    for name, dur, start, mod in ev:
        if "prefill" in mod:
            kern[name][0] += dur; kern[name][1] += 1
    print(f"    prefill: {sum(c for _, c in kern.values())} kernels; the largest by total time:")
    for name, (us, n) in sorted(kern.items(), key=lambda kv: -kv[1][0])[:10]:
        print(f"      {us / 1e3:7.3f} ms  x{n:<4d} {name[:90]}")
PY
fi
if [[ "$steps" == *" specbench "* ]]; then
  python3 bench/probes/spec_round.py --shape smollm2 --batch-sizes 1,16 --tiers 5,4,8:3,1,4 2>&1 | tee "$OUT/spec_round.log"
fi
if [[ "$steps" == *" kerneltests "* ]]; then
  python3 -m pytest -q -m gpu ${KTESTS:-tests/kernels/} 2>&1 | tail -15 | tee "$OUT/pytest_kernels_gpu.log"
fi
if [[ "$steps" == *" kernelbench "* ]]; then
  python3 bench/probes/kernels.py --kernels "${KBENCH:-}" 2>&1 | tee "$OUT/kernels.log"
fi
if [[ "$steps" == *" kernelround "* ]]; then
  for temp in ${KROUND_TEMPS:-0 0.8}; do
    for kern in ${KROUND_KERNELS:-reference pallas}; do
      JEAGLE_KERNELS=$kern python3 bench/probes/spec_round.py --shape smollm2 --batch-sizes 1,16,64 --tiers 5,4,8 \
        --rounds-as fused --temperature $temp 2>&1 | tee "$OUT/spec_round_${kern}_t${temp}.log"
    done
  done
fi
if [[ "$steps" == *" cmdbuf "* ]]; then  # XLA command buffers: default, off, and with WHILE/CONDITIONAL
  for flags in "" "--xla_gpu_enable_command_buffer=" "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"; do
    echo "XLA_FLAGS=$flags" | tee -a "$OUT/cmdbuf.log"
    XLA_FLAGS="$flags" python3 bench/probes/spec_round.py --shape smollm2 --batch-sizes 1,16,48 --tiers 5,4,8 \
      --rounds-as fused 2>&1 | tee -a "$OUT/cmdbuf.log"
  done
fi
if [[ "$steps" == *" adaptoverhead "* ]]; then  # issue 22: what an adaptive engine adds to the static tier's rounds
  timeout "${AO_TIMEOUT:-540}" python3 bench/probes/adaptive_overhead.py --batch-sizes "${AO_BATCHES:-16,48}" \
    --repeats "${AO_REPEATS:-3}" ${AO_ARGS:-} 2>&1 | tee "$OUT/adaptive_overhead.log" | grep -v '^{"bench"'
fi
if [[ "$steps" == *" tierswitch "* ]]; then  # two tiers' rounds in forced schedules, command buffers on and off
  for flags in "" "--xla_gpu_enable_command_buffer="; do
    echo "XLA_FLAGS=$flags" | tee -a "$OUT/tier_switch.log"
    XLA_FLAGS="$flags" timeout "${TS_TIMEOUT:-280}" python3 bench/probes/tier_switch.py --batch-sizes "${TS_BATCHES:-16,48}" \
      --tiers "${TS_TIERS:-5,4,8:7,4,11}" --schedules "${TS_SCHEDULES:-A,B,AB,A8B8}" 2>&1 | tee -a "$OUT/tier_switch.log"
  done
fi
if [[ "$steps" == *" lpcost "* ]]; then  # issue 24: what logprobs add to a round call (random weights, no staging)
  # exec_call.py without and with logprobs, the top-K kernel on (default) and off (JEAGLE_TOPK=0: XLA's top-ks,
  # which it lowered to sorts of whole rows for the logprobs' k = 20); the lp - plain gap within each is the logprobs' cost.
  for t in 1 0; do
    echo "== JEAGLE_TOPK=$t" | tee -a "$OUT/exec_call_lpcost.log"
    JEAGLE_TOPK=$t python3 bench/probes/exec_call.py --batch-sizes "${LP_BATCHES:-32,1}" --logprobs 0,1 --modes device \
      --calls "${LP_CALLS:-400}" 2>&1 | grep -v "Delay kernel" | tee -a "$OUT/exec_call_lpcost.log" | grep -v '^{"bench'
  done
fi
if [[ "$steps" == *" hostcall "* ]]; then  # issue 22: the host's time inside a round executable's call
  # 1. host ms of the call and wall ms per call, layer loop 3 per iteration (auto) vs unrolled (exec_call.py);
  # 2. XLA's command-buffer log for 20 calls at batch 16: how many command buffers a call launches, how many it re-records;
  # 3. py-spy --native over 3,000 calls at batch 16 (collapsed stacks). generate()'s ms per round: step hostopts.
  python3 bench/probes/exec_call.py --batch-sizes "${HC_BATCHES:-1,16,48}" --unroll "${HC_UNROLL:-auto,all}" \
    --modes device --calls "${HC_CALLS:-300}" --hlo-out "$OUT/hlo" 2>&1 | tee "$OUT/exec_call_unroll.log"
  for u in ${HC_VLOG_UNROLL:-auto}; do
    for b in ${HC_VLOG_BATCHES:-16}; do
      log="$OUT/cmdbuf_vlog_${u}_b$b.log"
      TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,while_thunk=3 timeout 200 python3 bench/probes/exec_call.py \
        --batch-sizes "$b" --unroll "$u" --calls 20 --modes "${HC_VLOG_MODES:-device}" > "$log" 2>&1
      echo "== unroll $u batch $b" | tee -a "$OUT/cmdbuf_vlog_summary.log"
      for pat in "Execute command buffer" "Update command buffer" "Updated command buffer in" "Initialize command buffer" "while"; do
        echo "$pat: $(grep -c "$pat" "$log")" | tee -a "$OUT/cmdbuf_vlog_summary.log"
      done
      grep -o "num_commands=[0-9]*; updated_allocs=[0-9]*" "$log" | sort | uniq -c | sort -rn | head | tee -a "$OUT/cmdbuf_vlog_summary.log"
      xz -9 "$log"
    done
  done
  spy="$HOME/site/bin/py-spy"
  [ -x "$spy" ] && [ -n "${HC_SPY:-1}" ] && timeout 300 "$spy" record --native -r 200 --format raw -o "$OUT/pyspy_exec_call.txt" -- \
    python3 bench/probes/exec_call.py --batch-sizes "${HC_SPY_BATCH:-16}" --unroll "${HC_SPY_UNROLL:-auto}" --calls 3000 --modes device 2>&1 | tail -3
  [ -f "$OUT/pyspy_exec_call.txt" ] && xz -9 "$OUT/pyspy_exec_call.txt"
  command -v nsys && echo "nsys present" | tee -a "$OUT/cmdbuf_vlog_summary.log"
fi
if [[ "$steps" == *" splitweights "* ]]; then  # issue 22: the layers' matmuls on per-layer weight arrays vs slices of stacks
  python3 bench/probes/split_weights.py --rows "${SW_ROWS:-128,384}" --calls "${SW_CALLS:-300}" \
    --json-out "$OUT/split_weights.json" 2>&1 | grep -v '^{"bench' | tee "$OUT/split_weights.log"
fi
if [[ "$steps" == *" prefillcall "* ]]; then  # issue 22: a prefill call's host time, idle vs behind a round in flight
  for cfg in ${PC_CONFIGS:-'{}' '{"unroll_layers":true}'}; do
    echo "== engine config $cfg" | tee -a "$OUT/prefill_call.log"
    timeout "${PC_TIMEOUT:-200}" python3 bench/probes/prefill_call.py --calls "${PC_CALLS:-30}" --engine-config "$cfg" \
      2>&1 | grep -v "Delay kernel" | tee -a "$OUT/prefill_call.log"
  done
fi
if [[ "$steps" == *" graphlaunch "* ]]; then  # issue 22: a call's host time by the kernels in its command buffer
  for flags in "" "--xla_gpu_enable_command_buffer="; do
    echo "XLA_FLAGS=$flags" | tee -a "$OUT/graph_launch.log"
    XLA_FLAGS="$flags" timeout 200 python3 bench/probes/graph_launch.py --kernels "${GL_KERNELS:-10,100,300,600,1000}" 2>&1 \
      | tee -a "$OUT/graph_launch.log"
  done
fi
if [[ "$steps" == *" hostopts "* ]]; then  # issue 22: a round call's host time and generate()'s ms per round under XLA option sets
  # HO_SETS: JSON objects for JEAGLE_XLA_OPTIONS ("{}" = none), one word each; HO_UNROLL: exec_call's --unroll; HO_GEN: engine configs.
  i=0
  for o in ${HO_SETS:-'{}' '{"xla_gpu_enable_dynamic_slice_fusion":false}'}; do
    i=$((i + 1))
    echo "== JEAGLE_XLA_OPTIONS=$o" | tee -a "$OUT/hostopts.log"
    JEAGLE_XLA_OPTIONS="$o" timeout 250 python3 bench/probes/exec_call.py --batch-sizes "${HO_BATCHES:-1,16,48}" \
      --unroll "${HO_UNROLL:-auto,all}" --modes device --calls "${HO_CALLS:-200}" --hlo-out "$OUT/hlo_$i" 2>&1 \
      | grep -v '"bench"' | tee -a "$OUT/hostopts.log"
    for cfg in ${HO_GEN:-'{}' '{"unroll_layers":true}'}; do
      for b in ${HO_GEN_BATCHES:-16 48}; do
        echo "== $o $cfg batch $b" | tee -a "$OUT/hostopts.log"
        JEAGLE_XLA_OPTIONS="$o" timeout 120 python3 bench/probes/host_profile.py --batch "$b" --top 0 --engine-config "$cfg" 2>&1 \
          | grep "ms per round" | tee -a "$OUT/hostopts.log"
      done
    done
  done
  for d in "$OUT"/hlo_*; do xz -9 "$d"/*.hlo; done
fi
if [[ "$steps" == *" overhead "* ]]; then
  python3 bench/probes/overhead.py --batch-sizes "${OVERHEAD_BATCHES:-1,16,48}" 2>&1 | tee "$OUT/overhead.log"
fi
if [[ "$steps" == *" warmup "* ]]; then
  python3 bench/probes/warmup.py 2>&1 | grep -v "^warm-up" | tee "$OUT/warmup.log"
fi
if [[ "$steps" == *" adaptive "* ]]; then  # adaptive vs static tiers on the phased workload (chain and tree tiers)
  python3 bench/adaptive.py --batch "${ADAPTIVE_BATCHES:-1,16}" --tree-tiers "${TREE_TIERS:-1,4,3:3,4,8:6,4,16}" \
    --mid-noise "${MID_NOISE:-0.02}" --phase-tokens "${PHASE_TOKENS:-384}" --repeats "${ADAPTIVE_REPEATS:-3}" \
    --policies "${ADAPTIVE_POLICIES:-throughput,ema}" 2>&1 | tee "$OUT/adaptive.log"
fi
if [[ "$steps" == *" autotune "* ]]; then  # XLA GEMM autotuning off: cold warm-up time and round speed, A/B
  for opts in '{}' '{"xla_gpu_autotune_level": 0}'; do
    echo "JEAGLE_XLA_OPTIONS=$opts" | tee -a "$OUT/autotune.log"
    JEAGLE_XLA_OPTIONS="$opts" python3 bench/probes/warmup.py ${WARMUP_ARGS:-} 2>&1 | grep -v "^warm-up" | tee -a "$OUT/autotune.log"
    JEAGLE_XLA_OPTIONS="$opts" python3 bench/probes/spec_round.py --shape smollm2 --batch-sizes 1,16,48 --tiers 5,4,8 \
      --rounds-as fused 2>&1 | tee -a "$OUT/autotune.log"
  done
fi
if [[ "$steps" == *" trainhead "* ]]; then  # issues 8, 23: regenerate data, train the SmolLM2 EAGLE-3 head (resumable)
  # Issue 23's mix: PROMPTS=.data/mix.jsonl NUM_PROMPTS=60000 (python -m jeagle.train.sources build, staged in
  # data.tar.xz with exclude.jsonl from `sources eval`), MAX_PROMPT=1024 SEQ_LEN=1024 (multi-turn: later turns' prompts
  # hold the earlier answers), EVAL_SETS="mtbench=.data/mtbench.jsonl:40 gsm8k=.data/gsm8k.jsonl:40
  # code=bench/data/code_eval.jsonl:40" EVAL_EVERY=1000 EVAL_TEMPS=0,0.7.
  # What comes back ($OUT/run.tar.part*, ≤ 15 MB each, with train.log ≤ 6 files, ~57 MiB): the portable checkpoint
  # (fp32 weights + step: --resume on the next machine continues from it), the exported head, the logs; with
  # COPY_DATA=1 the dataset and its record (and the head) instead of the portable checkpoint. Regeneration saves
  # after each block of 4,096 conversations and stops starting blocks after REGEN_LIMIT s: the next call on the same
  # machine (TRAIN_ARGS=--regenerate-only again) continues it; training starts once it is complete.
  # To resume on a fresh machine: stage the run's parts (cat run.tar.part* | tar x; repack portable/ data.npz data.json
  # d2t.npy train_log.jsonl as run.tar, `split -b 40000000 -d run.tar run.tar.part`, each part in a .stage dir of its
  # own: a part and a GGUF part together are over one call's 64 MiB);
  # they are unpacked here and --resume (RESUME=1) continues from the portable checkpoint.
  if [ -z "${RUN_FROM:-}" ] && compgen -G "$HOME/stage/run.tar.part*" >/dev/null; then
    rm -rf "$HOME/run_from" && mkdir -p "$HOME/run_from" && cat "$HOME"/stage/run.tar.part* | tar xf - -C "$HOME/run_from" \
      || { echo "trainhead: the staged run.tar parts do not unpack (a part missing?)"; exit 7; }
    RUN_FROM="$HOME/run_from"
  fi
  [ -n "${RUN_FROM:-}" ] && RESUME=1  # a run carried over continues; a fresh run there would be refused
  RUN="${RUN:-$HOME/run}"; mkdir -p "$RUN"
  [ -f .data/data.npz ] && [ ! -f "$RUN/data.npz" ] && cp .data/data.npz .data/data.json "$RUN/"  # carried back after a cold start
  if [ -n "${RUN_FROM:-}" ] && [ ! -d "$RUN/portable" ]; then  # a run carried over from an earlier machine
    for f in data.npz data.json d2t.npy train_log.jsonl; do [ -f "$RUN_FROM/$f" ] && cp "$RUN_FROM/$f" "$RUN/"; done
    [ -d "$RUN_FROM/portable" ] && cp -r "$RUN_FROM/portable" "$RUN/"
  fi
  eval_args=(); for s in ${EVAL_SETS:-}; do eval_args+=(--eval-set "$s"); done
  excl=(--exclude bench/data/code_eval.jsonl)
  for f in .data/exclude.jsonl .data/mtbench.jsonl .data/gsm8k.jsonl; do [ -f "$f" ] && excl+=(--exclude "$f"); done
  # TRAIN_WALL: the call's wall limit less a margin; past it the run is stopped, and what it saved comes back.
  timeout "${TRAIN_WALL:-540}" python3 -m jeagle.train_draft --out "$RUN" --prompts "${PROMPTS:-.data/sharegpt.jsonl}" "${excl[@]}" \
    --num-prompts "${NUM_PROMPTS:-12000}" --max-prompt-tokens "${MAX_PROMPT:-512}" \
    --max-new-tokens "${MAX_NEW:-384}" --gen-batch "${GEN_BATCH:-256}" --steps "${TRAIN_STEPS:-3000}" \
    --batch-size "${TRAIN_BATCH:-32}" --seq-len "${SEQ_LEN:-640}" --lr "${LR:-5e-4}" --time-limit "${TIME_LIMIT:-300}" \
    --eval-prompts "${EVAL_PROMPTS:-32}" "${eval_args[@]}" --eval-every "${EVAL_EVERY:-0}" \
    --eval-temperatures "${EVAL_TEMPS:-0}" --save-every 250 --log-every 25 --name smollm2-135m-instruct-eagle3 \
    --no-progress ${TRAIN_ARGS:-} ${RESUME:+--resume} --regenerate-time-limit "${REGEN_LIMIT:-240}" 2>&1 \
    | grep -v "^ *$" | tee -a "$OUT/train.log"
  keep="train_log.jsonl data.json d2t.npy portable head"
  # COPY_DATA=1: the dataset comes back (and the head where training ran), not the portable checkpoint (too much
  # together: --init-from the head continues on a fresh machine, with a new schedule).
  [ -n "${COPY_DATA:-}" ] && keep="train_log.jsonl data.json data.npz d2t.npy head"
  parts=(); for f in $keep; do [ -e "$RUN/$f" ] && parts+=("$f"); done
  # At most 60 MB back (the tool returns 64 MiB): a larger head (2 layers, a wider vocabulary) comes back as its
  # portable checkpoint alone (a loadable fp32 draft dir; export it as bf16 where it arrives).
  size() { (cd "$RUN" && du -cb "$@" | tail -1 | cut -f1); }
  if [ -n "${COPY_DATA:-}" ] && [ ${#parts[@]} -gt 0 ] && [ "$(size "${parts[@]}")" -gt 60000000 ]; then
    echo "trainhead: the dataset and the head are over 60 MB together: the dataset stays behind"
    kept=(); for f in "${parts[@]}"; do [ "$f" = data.npz ] || kept+=("$f"); done; parts=("${kept[@]}")
  elif [ ${#parts[@]} -gt 0 ] && [ "$(size "${parts[@]}")" -gt 60000000 ]; then
    parts=("${parts[@]/#head/head/README.md}"); parts+=(head/config.json head/training.json)
  fi
  [ ${#parts[@]} -gt 0 ] && (cd "$RUN" && tar cf - "${parts[@]}") | split -b 15000000 -d - "$OUT/run.tar.part"
  [ "$(du -cb "$OUT"/run.tar.part* 2>/dev/null | tail -1 | cut -f1)" -gt 62000000 ] && echo "trainhead: over 62 MB to return"
fi
if [[ "$steps" == *" trainstep "* ]]; then  # issue 23: where a training step's time goes (random weights, no staging)
  # TRAINSTEP_TRACE=1: a profiler trace of the last configuration, back as one archive (the trace's own folders
  # nest deeper than the device tool returns). A staged dataset (.stage4) is timed too (its real batches).
  trace=(); [ -n "${TRAINSTEP_TRACE:-}" ] && trace=(--trace "$HOME/trainstep_trace")
  data=(); [ -f .data/data.npz ] && data=(--data .data/data.npz)
  python3 bench/probes/train_step.py --shape smollm2 --batch "${TRAIN_BATCH:-32}" --seq-len "${SEQ_LEN:-640}" \
    --ttt-steps "${TTT_STEPS:-1,4,7}" "${trace[@]}" "${data[@]}" ${TRAINSTEP_ARGS:-} --json-out "$OUT/train_step.json" \
    2>&1 | tee "$OUT/train_step.log"
  [ -d "$HOME/trainstep_trace" ] && tar czf "$OUT/trainstep_trace.tar.gz" -C "$HOME" trainstep_trace
fi
if [[ "$steps" == *" acceptlen "* ]]; then  # issue 8: accept length of the head on MT-bench and GSM8K, lossless check
  python3 bench/accept_length.py --head "${HEAD:-$HOME/run/head}" --dataset mtbench=.data/mtbench.jsonl:80 \
    --dataset gsm8k=.data/gsm8k.jsonl:200 --tiers "${ACC_TIERS:-3,1,4:5,4,8:6,10,60}" --json-out "$OUT/accept_length.json" ${ACC_ARGS:-} \
    2>&1 | tee "$OUT/accept_length.log"
fi
if [[ "$steps" == *" tp "* ]]; then  # issue 11 (2 GPUs): tp=2 equals tp=1 with the kernels; 8B-shaped tp=1 vs tp=2
  [ "${TP_TESTS:-1}" = 1 ] && python3 -m pytest -q -m gpu tests/test_gpu_tp.py 2>&1 | tail -5 | tee "$OUT/pytest_gpu_tp.log"
  # SCALE_VARIANTS: tp>1 placements VOCAB:DRAFT (e.g. replicate:replicate,shard:shard; a second call, each ~3 min)
  python3 bench/scale.py --shape llama8b --tp "${SCALE_TP:-1,2}" --batch-sizes "${SCALE_BATCHES:-1,16}" \
    --tau "${SCALE_TAU:-4.68}" --repeats "${SCALE_REPEATS:-3}" --tp-variants "${SCALE_VARIANTS:-shard:replicate}" \
    ${SCALE_ARGS:---profile} --json-out "$OUT/scale${SCALE_TAG:-}.json" 2>&1 | tee "$OUT/scale${SCALE_TAG:-}.log"
fi
if [[ "$steps" == *" bench "* ]]; then  # issue 9: jeagle target-only / EAGLE-3 (shipped head) / HF compiled, MT-bench
  python3 bench/decode.py --prompts .data/mtbench.jsonl --batch-sizes "${DECODE_BATCHES:-1,4,16,48}" \
    --hf-batch-sizes "${HF_BATCHES:-1,16}" --json-out "$OUT/decode.json" --plot "$OUT/decode.png" 2>&1 \
    | grep -v '^{"bench"' | tee "$OUT/decode.log"
fi
old_tree() {  # the staged older tree (old.tar.gz, see commitab) in $HOME/old, once, with this tree's head and GGUF
  [ -d "$HOME/old" ] || { tar xzf "$HOME/stage/old.tar.gz" -C "$HOME" && ln -sfn "$PWD/.data" "$HOME/old/.data" \
    && cp -r jeagle/heads "$HOME/old/jeagle/"; }  # the shipped head (left out of the archive): the same files
  mkdir -p "$HOME/jcache_old/gguf" && ln -sf "$gguf" "$HOME/jcache_old/gguf/"
}
decode_variant() {  # STEM LABEL ARGS...: one bench/decode.py run (jeagle systems only); JSON to STEM.jsonl, rows to STEM.log
  local stem="$1" label="$2"; shift 2
  echo "$label" | tee -a "$OUT/$stem.log"
  ${DECODE_TIMEOUT:+timeout "$DECODE_TIMEOUT"} python3 bench/decode.py --prompts .data/mtbench.jsonl --hf-batch-sizes "" \
    --systems jeagle,jeagle-eagle "$@" 2>&1 | tee -a "$OUT/$stem.raw" \
    | grep '^{"bench"' | tee -a "$OUT/$stem.jsonl" \
    | python3 -c "import json,sys; [print(r) for r in json.load(sys.stdin)['rows']]" | tee -a "$OUT/$stem.log"
}
if [[ "$steps" == *" ab "* ]]; then  # issue 9: batch-1 engine settings, A/B in one call (each a fresh process)
  for cfg in ${AB_CONFIGS:-'{}' '{"compile_workers":1}' '{"verify_done_wait":"dataflow"}' '{"unroll_layers":true}' \
      '{"unroll_layers":true,"verify_done_wait":"dataflow"}'}; do
    decode_variant decode_ab "engine config $cfg" --batch-sizes "${AB_BATCHES:-1}" --engine-config "$cfg"
  done
fi
if [[ "$steps" == *" continuous "* ]]; then  # issue 22: static waves vs continuous batching (decode.py --continuous)
  # CT_RUNS: BATCH:WAVES pairs; each pair runs static waves, then the same prompts continuously once per
  # admission delay in CT_DELAYS (EngineConfig.admission_delay, runtime/admission.py), each a fresh process.
  for bw in ${CT_RUNS:-16:5 48:3}; do
    [[ -n "${CT_SKIP_STATIC:-}" ]] || decode_variant decode_continuous "batch ${bw%%:*} waves ${bw##*:} static" \
      --batch-sizes "${bw%%:*}" --waves "${bw##*:}" ${CT_ARGS:-}
    for delay in ${CT_DELAYS:-0 1}; do
      decode_variant decode_continuous "batch ${bw%%:*} waves ${bw##*:} continuous admission_delay $delay" \
        --batch-sizes "${bw%%:*}" --waves "${bw##*:}" --continuous --engine-config "{\"admission_delay\": $delay}" ${CT_ARGS:-}
    done
  done
fi
round_events_run() {  # LOG SPEC ARGS...: one bench/probes/round_events.py process for SPEC = BATCH:WAVES:MODES[:adaptive]
  local log="$1" b w modes ad extra=(); IFS=: read -r b w modes ad <<< "$2"; shift 2
  [ -n "$ad" ] && extra=(--adaptive '{"policy": "throughput"}')
  echo "== batch $b waves $w modes $modes ${ad:-static tier} $*" | tee -a "$log"
  timeout "${RE_TIMEOUT:-240}" python3 bench/probes/round_events.py --prompts .data/mtbench.jsonl --batch "$b" \
    --waves "$w" --modes "$modes" "${extra[@]}" "$@" 2>&1 < /dev/null | grep -v "Converting\|Loading" | tee -a "$log"
}
if [[ "$steps" == *" roundevents "* ]]; then  # issue 22: each round call's host ms by what happened before it
  # RE_RUNS: BATCH:WAVES:MODES[:adaptive] (adaptive: the throughput policy); RE_ARGS: more probe arguments
  # (default: the executable store that adaptivecmp uses, so later processes load what earlier ones compiled).
  RE_ARGS="${RE_ARGS-"--engine-config {\"executable_cache_dir\":\"$JEAGLE_CACHE/exec\"}"}"
  for spec in ${RE_RUNS:-16:5:static,continuous 48:3:static,continuous 48:1:static:adaptive}; do
    round_events_run "$OUT/round_events.log" "$spec" ${RE_ARGS:-} | grep '^{"probe"' >> "$OUT/round_events.jsonl"
  done
fi
if [[ "$steps" == *" allocab "* ]]; then  # issue 22: round_events under other device allocators / XLA command-buffer modes
  # ALLOC_VARIANTS: NAME|ALLOCATOR|XLA_OPTIONS_JSON entries ("default" = the plugin's BFC; "vmm" = the VMM allocator,
  # which XLA's address-stable command buffers need; the JSON goes to JEAGLE_XLA_OPTIONS: every engine executable;
  # jax 0.11.2 rejects '{"xla_gpu_enable_command_buffer_va_remapping": true}', HISTORY s40). Each variant its own
  # executable store (the options change the executables), a fresh process per ALLOC_RUNS entry (as RE_RUNS).
  so=$(find / -name "xla_cuda_plugin.so" -path "*jax*" 2>/dev/null | head -1)
  echo "plugin: $so" | tee -a "$OUT/allocab.log"
  while IFS='|' read -r name alloc opts; do
    [ -z "$name" ] && continue
    echo "== variant $name: allocator $alloc, JEAGLE_XLA_OPTIONS=$opts" | tee -a "$OUT/allocab.log"
    ( [ "$alloc" != default ] && export XLA_PYTHON_CLIENT_ALLOCATOR="$alloc"; [ -n "$opts" ] && export JEAGLE_XLA_OPTIONS="$opts"
      mkdir -p "$OUT/$name"
      for spec in ${ALLOC_RUNS:-48:3:continuous}; do
        round_events_run "$OUT/$name/round_events.log" "$spec" \
          --engine-config "{\"executable_cache_dir\":\"$JEAGLE_CACHE/exec_$name\"}" | grep -v '^{"probe"' | tail -30 >> "$OUT/allocab.log"
      done )
  done <<< "${ALLOC_VARIANTS:-"default|default|
vmm|vmm|"}"
fi
if [[ "$steps" == *" vmmcheck "* ]]; then  # issue 22: is the VMM allocator's batch-1 decode.py result right? (HISTORY s40)
  # decode.py (VMM_BATCHES, default batch 1: where s40's result was suspect) under the default allocator and under
  # vmm: with an executable store (VMM_STORES "store store": the first process compiles into it, the second loads
  # from it, as s40's suspect run did) and without one; one process each. Rows print their tokens' digest
  # (tokens_sha1): equal digests across allocators = the same tokens. Then the GPU tests under vmm.
  for a in ${VMM_ALLOCATORS:-default vmm}; do
    for st in ${VMM_STORES:-store store nostore}; do
      cfg='{}'; [ "$st" = store ] && cfg="{\"executable_cache_dir\":\"$JEAGLE_CACHE/exec_vmmcheck_$a\"}"
      echo "== allocator $a, $st" | tee -a "$OUT/vmmcheck.log"
      ( [ "$a" != default ] && export XLA_PYTHON_CLIENT_ALLOCATOR="$a"
        timeout "${DECODE_TIMEOUT:-200}" python3 bench/decode.py --prompts .data/mtbench.jsonl --hf-batch-sizes "" \
          --systems jeagle,jeagle-eagle --batch-sizes "${VMM_BATCHES:-1}" --engine-config "$cfg" 2>&1 < /dev/null \
          | grep '^{"bench"' | tee -a "$OUT/vmmcheck_${a}_$st.jsonl" | python3 -c "import json,sys
for r in json.load(sys.stdin)['rows']:
    print(r['system'], r['batch'], r['tokens_per_s'], r.get('accept_length'), r['tokens_sha1'], r.get('shortest_common_prefix'))" \
          | tee -a "$OUT/vmmcheck.log" )
    done
  done
  XLA_PYTHON_CLIENT_ALLOCATOR=vmm python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -4 | tee -a "$OUT/vmmcheck.log"
fi
if [[ "$steps" == *" linearab "* ]]; then  # issue 22: the layers' matmuls through the linear kernel vs XLA's dot
  for round in ${LINEAR_ROUNDS:-1 2}; do
    for on in ${LINEAR_CHOICES:-0 1}; do
      JEAGLE_LINEAR=$on decode_variant decode_linear "JEAGLE_LINEAR=$on (round $round)" \
        --batch-sizes "${LINEAR_BATCHES:-1,16,48}" ${LINEAR_ARGS:-}
    done
  done
fi
if [[ "$steps" == *" splitab "* ]]; then  # paged attention with split prefixes: compiled check, then decode A/B
  python3 -m pytest -q -m gpu tests/kernels/test_paged_attention.py 2>&1 | tail -3 | tee "$OUT/pytest_paged_split_gpu.log"
  for splits in ${SPLIT_CHOICES:-1 auto}; do
    JEAGLE_PAGED_ATTENTION_SPLITS=$splits decode_variant decode_split "JEAGLE_PAGED_ATTENTION_SPLITS=$splits" \
      --batch-sizes "${SPLIT_BATCHES:-1,4,16}"
  done
fi
if [[ "$steps" == *" eaglepeer "* ]]; then  # issue 9: eagle-llm (official EAGLE-1 code) vs jeagle on one EAGLE-1 head
  RUN1="${RUN1:-$HOME/run_eagle1}"
  [ -d "$RUN1/head" ] || python3 -m jeagle.train_draft --out "$RUN1" --data "$HOME/data0.npz" --kind eagle1 \
    --steps "${E1_STEPS:-3000}" --batch-size 32 --seq-len 640 --time-limit "${E1_LIMIT:-200}" --eval-prompts 16 \
    --save-every 500 --log-every 100 --name smollm2-135m-instruct-eagle1 --no-progress 2>&1 | grep -v "^ *$" \
    | tee "$OUT/train_eagle1.log"
  cp "$RUN1"/train_log.jsonl "$OUT/train_eagle1_log.jsonl" 2>/dev/null
  tar cf "$OUT/eagle1_head.tar" -C "$RUN1" head 2>/dev/null
  python3 bench/eagle_llm_peer.py --head "$RUN1/head" --prompts .data/mtbench.jsonl --num-prompts "${PEER_PROMPTS:-10}" \
    --json-out "$OUT/eagle_llm.json" 2>&1 | grep -v '^{"bench' | tee "$OUT/eagle_llm.log"
fi
if [[ "$steps" == *" profile "* ]]; then  # issue 9: rounds (and target-only steps) at a full batch of 1 and 48, per op
  # The 8B shape at batch 48: one decode executable compiled for 3.4 min in session 8's warm-up; batch 1 unless asked.
  for shape in ${PROFILE_SHAPES:-smollm2 llama8b}; do
    tau=4.68; batches="${PROFILE_8B_BATCHES:-1}"
    [ "$shape" = smollm2 ] && tau=3.15 && batches="${PROFILE_BATCHES:-1,48}"  # tau: the shipped head on MT-bench
    python3 bench/profile_decode.py --shape $shape --batch-sizes "$batches" --steps 64 \
      2>&1 | grep -v "Delay kernel" | tee "$OUT/profile_${shape}_target.log"
    python3 bench/profile_decode.py --shape $shape --batch-sizes "$batches" --spec 5,4,8 \
      --simulate-accept $tau --steps 64 2>&1 | grep -v "Delay kernel" | tee "$OUT/profile_${shape}_round.log"
  done
fi
if [[ "$steps" == *" phases "* ]]; then  # issue 22: each phase's share of a round (named scopes), per split choice
  # Inside a command buffer (CUDA graph) a kernel's trace event names only the command buffer, so most of a
  # round's kernels are unattributed; with XLA_FLAGS=--xla_gpu_enable_command_buffer= every kernel names its
  # instruction (kernel times are the same; the wall is not the default's then).
  # One log (phases.log) and one JSON line per run (phases.jsonl): the target step and the round at each
  # JEAGLE_PAGED_ATTENTION_SPLITS choice; SmolLM2 at tau 3.15 (the shipped head on MT-bench), the 8B shape at 4.68.
  for shape in ${PHASES_SHAPES:-smollm2 llama8b}; do
    tau=4.68; batches="${PHASES_8B_BATCHES:-1,16}"
    [ "$shape" = smollm2 ] && tau=3.15 && batches="${PHASES_BATCHES:-1,48}"
    for splits in ${PHASES_TARGET_SPLITS-${SPLIT_CHOICES:-1 auto}}; do  # PHASES_TARGET_SPLITS="": no target runs
      echo "== $shape target step JEAGLE_PAGED_ATTENTION_SPLITS=$splits" | tee -a "$OUT/phases.log"
      JEAGLE_PAGED_ATTENTION_SPLITS=$splits python3 bench/profile_decode.py --shape $shape --batch-sizes "$batches" \
        --steps "${PHASES_STEPS:-48}" 2>&1 | grep -v "Delay kernel" | tee -a "$OUT/phases.log" | grep '^{"bench"' \
        | sed "s/^{/{\"splits\": \"$splits\", /" >> "$OUT/phases.jsonl"
    done
    for splits in ${SPLIT_CHOICES:-1 auto}; do
      echo "== $shape round 5,4,8 tau $tau JEAGLE_PAGED_ATTENTION_SPLITS=$splits" | tee -a "$OUT/phases.log"
      JEAGLE_PAGED_ATTENTION_SPLITS=$splits python3 bench/profile_decode.py --shape $shape --batch-sizes "$batches" \
        --spec 5,4,8 --simulate-accept $tau --steps "${PHASES_STEPS:-48}" 2>&1 | grep -v "Delay kernel" \
        | tee -a "$OUT/phases.log" | grep '^{"bench"' | sed "s/^{/{\"splits\": \"$splits\", /" >> "$OUT/phases.jsonl"
    done
  done
fi
if [[ "$steps" == *" tiers "* ]]; then  # issue 23 item 3: tokens/s of each (S,K,N) with the shipped head, per batch
  # Target-only once (the first run), then each tier alone; each run a fresh process bounded by TIER_TIMEOUT s.
  first=1
  for t in ${TIERS:-5,4,8 3,1,4 4,2,6 6,4,16 6,10,60 8,4,16}; do
    sys=jeagle-eagle; [ -n "$first" ] && sys=jeagle,jeagle-eagle; first=
    DECODE_TIMEOUT="${TIER_TIMEOUT:-150}" decode_variant tiers "tier $t" --batch-sizes "${TIER_BATCHES:-1,16,48}" \
      --tier "$t" --systems "$sys" --repeats "${TIER_REPEATS:-2}" ${TIER_ARGS:-}
  done
fi
if [[ "$steps" == *" adaptivecmp "* ]]; then  # issue 22: the adaptive policies against static tiers, MT-bench
  # Processes per batch group: target-only + static (5,4,8) + the throughput policy; then each of ACMP_SYSTEMS:
  # "ema" (SGLang's policy), "pinned" (the throughput policy held on (5,4,8): what its nested
  # accept lengths cost), "tp8" (the throughput policy with an 8-request-round accept window), "tpm10" (with a 10 % switch
  # margin), or a static tier S,K,N.
  echo '{"policy": "throughput"}' > "$OUT/throughput.json"
  echo '{"policy": "throughput", "warmup_batches": 1000000000}' > "$OUT/pinned.json"
  echo '{"policy": "throughput", "accept_window": 8}' > "$OUT/tp8.json"
  echo '{"policy": "throughput", "switch_margin": 0.1}' > "$OUT/tpm10.json"
  # The engines compile through an executable store (8 worker processes; later processes load what earlier
  # ones compiled): without it the first process (three systems, 4 adaptive tiers) ran past 290 s compiling
  # at batch 16,48 (session 28).
  ACMP_ARGS="${ACMP_ARGS-"--engine-config {\"executable_cache_dir\":\"$JEAGLE_CACHE/exec\"}"}"
  for b in ${ACMP_BATCHES:-1 16,48}; do
    waves=1; [ "$b" = 1 ] && waves=${ACMP_WAVES1:-5}
    decode_variant adaptivecmp "batch $b, waves $waves: target-only, (5,4,8), throughput policy" --batch-sizes "$b" \
      --waves "$waves" --systems jeagle,jeagle-eagle,jeagle-adaptive --adaptive-config "$OUT/throughput.json" ${ACMP_ARGS:-}
    for sys in ${ACMP_SYSTEMS:-ema 3,4,5}; do
      case "$sys" in
        ema) args=(--systems jeagle-adaptive) ;;
        pinned) args=(--systems jeagle-adaptive --adaptive-config "$OUT/pinned.json") ;;
        tp8|tpm10) args=(--systems jeagle-adaptive --adaptive-config "$OUT/$sys.json") ;;
        *) args=(--systems jeagle-eagle --tier "$sys") ;;
      esac
      decode_variant adaptivecmp "batch $b, waves $waves: $sys" --batch-sizes "$b" --waves "$waves" "${args[@]}" ${ACMP_ARGS:-}
    done
  done
fi
if [[ "$steps" == *" shrink "* ]]; then  # issue 22: EngineConfig.bucket_shrink_ratio, the ratios interleaved on one engine
  # SH_BATCHES: batch groups of single waves (target-only, (5,4,8), the throughput policy: SH_SYSTEMS); SH_CONT:
  # BATCH:WAVES of continuous batching (target-only, (5,4,8)); SH_RATIOS: the ratios; SH_POLICY: jeagle-adaptive's
  # policy (throughput, or ema: SGLang's, the default); one process per group.
  echo "{\"policy\": \"${SH_POLICY:-throughput}\"}" > "$OUT/adaptive.json"
  SH_ARGS="${SH_ARGS-"--engine-config {\"executable_cache_dir\":\"$JEAGLE_CACHE/exec\"}"}"
  for b in ${SH_BATCHES-16,48}; do
    decode_variant shrink "batch $b single wave, ratios ${SH_RATIOS:-1,1.5,2,3}" --batch-sizes "$b" \
      --systems "${SH_SYSTEMS:-jeagle,jeagle-eagle,jeagle-adaptive}" --adaptive-config "$OUT/adaptive.json" \
      --bucket-shrink-ratios "${SH_RATIOS:-1,1.5,2,3}" ${SH_ARGS:-}
  done
  for bw in ${SH_CONT-}; do
    decode_variant shrink "batch ${bw%%:*} waves ${bw##*:} continuous, ratios ${SH_RATIOS:-1,1.5,2,3}" \
      --batch-sizes "${bw%%:*}" --waves "${bw##*:}" --continuous --bucket-shrink-ratios "${SH_RATIOS:-1,1.5,2,3}" ${SH_ARGS:-}
  done
fi
if [[ "$steps" == *" adaptpaired "* ]]; then  # issue 22: adaptive engines ÷ static, paired run by run in one process
  # bench/probes/adaptive_paired.py: every system an engine over the same weights, warmed, then APR_RUNS (8)
  # cycles of one run each (order rotated), at APR_BATCHES (1,16,48); APR_SYSTEMS: the first is the static reference;
  # APR_ARGS: more arguments (`--buckets default`: decode.py's buckets, observed round walls per tier and bucket).
  eval "apr_systems=(${APR_SYSTEMS:-static 'ema={}' 'throughput={\"policy\": \"throughput\"}'})"
  timeout "${APR_TIMEOUT:-560}" python3 bench/probes/adaptive_paired.py --prompts .data/mtbench.jsonl \
    --batch-sizes "${APR_BATCHES:-1,16,48}" --runs "${APR_RUNS:-8}" --systems "${apr_systems[@]}" \
    --engine-config "{\"executable_cache_dir\": \"$JEAGLE_CACHE/exec\"}" --json-out "$OUT/adaptive_paired.json" ${APR_ARGS:-} 2>&1 \
    | grep -v "Delay kernel\|Converting\|Loading\|^{" | tee "$OUT/adaptive_paired.log"
fi
if [[ "$steps" == *" adaptrounds "* ]]; then  # issue 22: static vs adaptive policies, per-run host diagnostics
  # bench/probes/adaptive_rounds.py, MT-bench, one batch (ARD_BATCH, 16), ARD_RUNS runs (8) per process, each
  # system its own process in turn, ARD_ROUNDS times (1): "static" ((5,4,8)), "tp" (the throughput policy),
  # "tpw8" (with window_verifies 8), "ema", or "json" (the AdaptiveConfig in ARD_JSON); static (5,4,8) with
  # rounds per dispatch: "r2" / "r4" (the device loop), "r2u" / "r4u" (the rounds unrolled).
  # An executable store: the first adaptive process compiles 4 tiers x the buckets (~150 s), later ones load.
  for i in $(seq 1 "${ARD_ROUNDS:-1}"); do
    for sys in ${ARD_SYSTEMS:-static tp tpw8}; do
      more=""
      case "$sys" in
        r[0-9]) cfg=""; more=", \"rounds_per_dispatch\": ${sys#r}, \"unroll_rounds\": false" ;;
        r[0-9]u) cfg=""; r=${sys#r}; more=", \"rounds_per_dispatch\": ${r%u}, \"unroll_rounds\": true" ;;
      esac
      store="{\"executable_cache_dir\": \"$JEAGLE_CACHE/exec\"$more}"
      case "$sys" in
        static|r[0-9]|r[0-9]u) cfg="" ;;
        tp) cfg='{"policy": "throughput"}' ;;
        tpw8) cfg='{"policy": "throughput", "window_verifies": 8}' ;;
        ema) cfg='{"policy": "ema"}' ;;
        json) cfg="$ARD_JSON" ;;
      esac
      echo "== $sys (round $i)" | tee -a "$OUT/adaptrounds.log"
      timeout "${ARD_TIMEOUT:-280}" python3 bench/probes/adaptive_rounds.py --prompts .data/mtbench.jsonl \
        --batch "${ARD_BATCH:-16}" --runs "${ARD_RUNS:-8}" --engine-config "$store" ${cfg:+--adaptive "$cfg"} 2>&1 \
        | grep -v "Delay kernel\|Converting\|Loading" >> "$OUT/adaptrounds.log"
    done
  done
  python3 - "$OUT/adaptrounds.log" <<'PY' | tee "$OUT/adaptrounds_summary.log"
import re, statistics, sys
sys_name, runs = None, {}
for line in open(sys.argv[1]):
    if line.startswith("== "):
        sys_name = line.split()[1]
    m = re.match(r"run \d+: .* = ([\d.]+) tok/s", line)
    if m and sys_name:
        runs.setdefault(sys_name, []).append(float(m.group(1)))
base = statistics.median(runs["static"]) if runs.get("static") else None
for name, r in runs.items():
    med = statistics.median(r)
    print(f"{name}: {len(r)} runs, median {med:.1f} tok/s" + (f" ({med / base:.3f} of static)" if base else "")
          + f"; runs {[round(x) for x in r]}")
PY
fi
if [[ "$steps" == *" commitab "* ]]; then  # one commit against another in one call: bench/decode.py, jeagle systems
  # An older tree travels as old.tar.gz (`git archive --prefix=old/ COMMIT -- . ':!jeagle/heads' ':!bench/results'
  # | gzip` in a staged part); it runs with this tree's shipped head and GGUF, its own conversion cache. Runs
  # alternate old, new, old, new (each a fresh process): the spread of the two runs of one tree is the noise.
  [ -f "$HOME/stage/old.tar.gz" ] || { echo "no old.tar.gz staged"; exit 5; }
  rm -rf "$HOME/old" && old_tree
  head="$PWD/jeagle/heads/smollm2-135m-instruct-eagle3"
  for i in ${AB_ROUNDS:-1 2}; do
    for tree in old new; do
      dir="$PWD"; cache="$JEAGLE_CACHE"
      [ "$tree" = old ] && dir="$HOME/old" && cache="$HOME/jcache_old"
      echo "== $tree run $i ($dir)" | tee -a "$OUT/commitab.log"
      (cd "$dir" && JEAGLE_CACHE="$cache" PYTHONPATH="$HOME/site:$dir" python3 bench/decode.py --prompts .data/mtbench.jsonl \
        --draft "$head" --hf-batch-sizes "" --systems jeagle,jeagle-eagle --batch-sizes "${AB_BATCHES:-1,16}" ${AB_ARGS:-} 2>&1 \
        | grep '^{"bench"' | tee -a "$OUT/commitab_$tree.jsonl" \
        | python3 -c "import json,sys; [print(r) for r in json.load(sys.stdin)['rows']]" | tee -a "$OUT/commitab.log")
    done
  done
fi
if [[ "$steps" == *" hostprof "* ]]; then  # the host's time per round, real model and head (bench/probes/host_profile.py)
  # This tree, and with old.tar.gz staged (see commitab) the older tree too, alternating; HP_BATCHES, HP_TOKENS.
  head="$PWD/jeagle/heads/smollm2-135m-instruct-eagle3"
  trees="new"
  [ -f "$HOME/stage/old.tar.gz" ] && trees="old new" && old_tree
  for b in ${HP_BATCHES:-48}; do
    for tree in $trees; do
      dir="$PWD"; cache="$JEAGLE_CACHE"
      [ "$tree" = old ] && dir="$HOME/old" && cache="$HOME/jcache_old"
      echo "== $tree batch $b" | tee -a "$OUT/hostprof.log"
      (cd "$dir" && JEAGLE_CACHE="$cache" PYTHONPATH="$HOME/site:$dir" timeout "${HP_TIMEOUT:-240}" python3 \
        bench/probes/host_profile.py --real .data/mtbench.jsonl --batch "$b" --tokens "${HP_TOKENS:-256}" --top 30 ${HP_ARGS:-} 2>&1 \
        | grep -v "Converting\|Loading" | tee -a "$OUT/hostprof.log" | grep '^{"bench"' >> "$OUT/hostprof_$tree.jsonl")
    done
  done
fi
if [[ "$steps" == *" features "* ]]; then  # issue 24: logprobs, penalties, grammars: their tests on the GPU and their cost
  # FEATURE_TESTS=0 skips the tests; FEATURE_SET picks the decode rows (FEATURE_ARGS: more decode.py arguments,
  # e.g. --tier 3,1,4); FEATURE_SERVE=0 skips bench/serve.py (SERVE_SET picks its rows).
  if [ "${FEATURE_TESTS:-1}" = 1 ]; then
    python3 -c "import openai, starlette, uvicorn, httpx, llguidance, jsonschema" 2>&1 | tee "$OUT/features_imports.log"
    python3 -m pytest -q -x tests/test_logprobs.py tests/test_penalties.py tests/test_grammar.py \
      tests/test_serve_features.py 2>&1 | tail -3 | tee "$OUT/pytest_features_on_gpu.log"
  fi
  declare -A samplings=(
    [plain]='{}'
    [logprobs]='{"logprobs": 5}'
    [penalties]='{"frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.1}'
    [grammar]='{"grammar": ["json_schema", {"type": "object", "properties": {"title": {"type": "string", "maxLength": 60}, "points": {"type": "array", "items": {"type": "string", "maxLength": 80}, "minItems": 3, "maxItems": 5}}, "required": ["title", "points"]}]}'
  )
  for name in ${FEATURE_SET:-plain logprobs penalties grammar}; do
    decode_variant decode_features "sampling $name ${samplings[$name]}" --batch-sizes "${FEATURE_BATCHES:-1,16,48}" \
      --sampling "${samplings[$name]}" --max-new-tokens "${FEATURE_TOKENS:-256}" --repeats "${FEATURE_REPEATS:-3}" \
      ${FEATURE_ARGS:-}
  done
  # bench/serve.py needs the server's wheels in .whl (the image has none, llguidance included):
  # `SERVE=1 bash bench/make_stages.sh` downloads them.
  if [ "${FEATURE_SERVE:-1}" = 1 ]; then  # the real model over HTTP: plain, logprobs, a JSON schema (chat)
    declare -A extras=(
      [plain]='{}'
      [logprobs]='{"logprobs": true, "top_logprobs": 5}'
      [grammar]='{"response_format": {"type": "json_schema", "json_schema": {"name": "outline", "schema": {"type": "object", "properties": {"title": {"type": "string", "maxLength": 60}, "points": {"type": "array", "items": {"type": "string", "maxLength": 80}, "minItems": 3, "maxItems": 5}}, "required": ["title", "points"]}}}}'
    )
    # One process for every row of SERVE_SET (one warm-up per engine); SERVE_CLIENTS=own,in adds rows with the
    # clients in the server's process, SERVE_SWITCH=0.005,0.0005 rows per GIL switch interval.
    serve_args=()
    for name in ${SERVE_SET:-plain logprobs grammar}; do serve_args+=(--extra "${extras[$name]}"); done
    # SERVE_ENGINES="process thread": the engine in its own process (the server's default) and in a thread.
    for engine in ${SERVE_ENGINES:-process}; do
      echo "serve ${SERVE_SET:-plain logprobs grammar} engine $engine clients ${SERVE_CLIENTS:-own}" \
        "switch ${SERVE_SWITCH:-default}" | tee -a "$OUT/serve_features.log"
      python3 bench/serve.py --model smollm2 --prompts .data/mtbench.jsonl --concurrency "${FEATURE_CONC:-1,16}" \
        --max-tokens "${SERVE_TOKENS:-256}" --requests-per-client "${SERVE_PER_CLIENT:-4}" --repeats "${SERVE_REPEATS:-1}" "${serve_args[@]}" \
        --engine "$engine" --clients "${SERVE_CLIENTS:-own}" ${SERVE_SWITCH:+--switch-intervals "$SERVE_SWITCH"} 2>&1 \
        | grep -v "Converting\|Loading\|Delay kernel" | tee -a "$OUT/serve_features.log"
    done
  fi
fi
if [[ "$steps" == *" serveab "* ]]; then  # issue 24 at 32 clients: the served engine's host time, variant by variant
  # Each variant one bench/serve.py process (EAGLE, then target-only with SAB_TARGET=1) at SAB_CONC (32)
  # clients, plain and logprobs rows (SAB_EXTRAS) interleaved SAB_REPEATS (3) times. Variants: every engine config of
  # SAB_CONFIGS (JSON without spaces: the lists split on them, e.g. '{} {"rounds_per_dispatch":2}') x every
  # JEAGLE_XLA_OPTIONS of SAB_XLA (the same; bench/serve.py builds the server's engines, XLA's dynamic-slice
  # fusions off since session 31, so '{} {"xla_gpu_enable_dynamic_slice_fusion":true}' A/Bs them);
  # SAB_CLIENT_PROCS (4) load-generator processes. SAB_CYCLES (1): the whole list of variants run that many
  # times (A B A B ...): the same configuration read 23.9k-28.2k tok/s in three processes of one machine
  # (session 31), so a difference between two processes means something only where it outlasts that.
  # SAB_EXTRAS: the rows, of plain / logprobs / grammar (the features step's json_schema request).
  declare -A sab_named=([plain]='{}' [logprobs]='{"logprobs": true, "top_logprobs": 5}'
    [grammar]='{"response_format": {"type": "json_schema", "json_schema": {"name": "outline", "schema": {"type": "object", "properties": {"title": {"type": "string", "maxLength": 60}, "points": {"type": "array", "items": {"type": "string", "maxLength": 80}, "minItems": 3, "maxItems": 5}}, "required": ["title", "points"]}}}}')
  sab_extras=()
  for name in ${SAB_EXTRAS:-plain logprobs}; do sab_extras+=(--extra "${sab_named[$name]}"); done
  for cycle in $(seq 1 "${SAB_CYCLES:-1}"); do
  for xla in ${SAB_XLA:-'{}'}; do
    for cfg in ${SAB_CONFIGS:-'{}'}; do
      echo "== cycle $cycle: engine config $cfg, JEAGLE_XLA_OPTIONS $xla" | tee -a "$OUT/serveab.log"
      JEAGLE_XLA_OPTIONS="$xla" timeout "${SAB_TIMEOUT:-300}" python3 bench/serve.py --model smollm2 \
        --prompts .data/mtbench.jsonl --configs "$([ "${SAB_TARGET:-0}" = 1 ] && echo target-only,eagle || echo eagle)" \
        --concurrency "${SAB_CONC:-32}" --requests-per-client "${SAB_PER_CLIENT:-8}" --max-tokens 256 \
        --repeats "${SAB_REPEATS:-3}" --client-processes "${SAB_CLIENT_PROCS:-4}" --engine-config "$cfg" \
        "${sab_extras[@]}" > "$OUT/serveab.tmp" 2>&1
      grep '^{"bench' "$OUT/serveab.tmp" >> "$OUT/serveab.jsonl"
      grep -v '^{"bench\|Delay kernel\|Converting\|Loading' "$OUT/serveab.tmp" | tee -a "$OUT/serveab.log" | tail -4
    done
  done
  done
  rm -f "$OUT/serveab.tmp"
fi
if [[ "$steps" == *" dispatchthread "* ]]; then  # the engine's Python beside a round call on a dispatch thread (random weights)
  for si in ${DT_SWITCH:-0.005 0.0005}; do  # Python's GIL switch interval: its default, and a tenth of it
    python3 bench/probes/dispatch_thread.py --batch-sizes "${DT_BATCH:-32,1}" --python-ms "${DT_PYTHON_MS:-0,0.6,1.2}" \
      --switch-interval "$si" 2>&1 | grep -v "Delay kernel" | tee -a "$OUT/dispatch_thread.log" | grep -v '^{"b'
  done
fi
if [[ "$steps" == *" servespy "* ]]; then  # py-spy on the engine's process while bench/serve.py serves (py-spy in .whl)
  bash bench/probes/serve_spy.sh
fi
if [[ "$steps" == *" masks "* ]]; then  # issue 24: grammar masks on the host, one by one vs batched on llguidance's threads
  for a in "" "--copies" "--threads 4"; do python3 bench/probes/grammar_masks.py --batch-sizes 1,16,48 $a 2>&1 | tee -a "$OUT/grammar_masks.log"; done
fi
if [[ "$steps" == *" startup "* ]]; then  # issue 27: the README command, first and second start in a fresh cache
  # Run 1 converts the staged GGUF and compiles (no fetch: the GGUF is linked in), run 2 is the second start
  # (the README form, text output), run 3 the same with --json (its stats), runs 4-5 the same two with
  # jeagle byte-compiled, then an import-time log and bench/probes/startup.py's phases of two more starts.
  # One JSON line per run in startup.jsonl (wall_s: the whole process).
  [ -f "$gguf" ] || { echo "startup: needs the staged GGUF (.stage1-3)"; exit 6; }
  sc="$HOME/jcache_startup"; rm -rf "$sc"; mkdir -p "$sc/gguf" && ln -s "$gguf" "$sc/gguf/"
  find jeagle checkpoints_conv -name __pycache__ -prune -exec rm -rf {} +  # runs 1-3: no bytecode (as the image)
  q="What is the capital of France?"
  for i in 1 2 3 4 5; do
    json=(); [ $i = 3 ] || [ $i = 5 ] && json=(--json)
    # Runs 4-5: jeagle's modules byte-compiled first, as `pip install` leaves them (the image sets
    # PYTHONDONTWRITEBYTECODE=1, so runs 1-3 compile jeagle's source at every start).
    [ $i = 4 ] && python3 -m compileall -q -j 0 jeagle checkpoints_conv > /dev/null
    t0=$(date +%s.%N)
    JEAGLE_CACHE="$sc" python3 -m jeagle.generate "${json[@]}" "$q" > "$sc/run$i.out" 2> "$sc/run$i.err"
    rc=$?; t1=$(date +%s.%N)
    python3 - "$i" "$rc" "$t0" "$t1" "$sc" <<'PY' | tee -a "$OUT/startup.jsonl"
import json, re, sys
i, rc, t0, t1, sc = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
out, err = open(f"{sc}/run{i}.out").read(), open(f"{sc}/run{i}.err").read()
row = {"step": "startup", "run": int(i), "rc": rc, "wall_s": round(t1 - t0, 3)}
row["bytecode"] = int(i) >= 4
if i in ("3", "5") and rc == 0:
    s = json.loads(out)["stats"]
    row |= {k: s.get(k) for k in ("time_to_first_token_s", "load_s", "compile_s", "compilations",
                                   "executables_from_store", "new_tokens", "dtype")} | {"decode_wall_s": s.get("wall_s")}
else:
    m = re.search(r"loaded in ([\d.]+) s", err)
    t = re.search(r"TTFT ([\d.]+) s, compile ([\d.]+) s", err)
    row |= {"load_s": float(m[1]) if m else None, "time_to_first_token_s": float(t[1]) if t else None,
            "compile_s": float(t[2]) if t else None, "text": out.strip()[:80], "stderr_tail": err[-300:] if rc else ""}
print(json.dumps(row))
PY
  done
  for pre in true false true false; do  # the README form, JAX's preallocation on / off set explicitly (bytecode as runs 4-5)
    t0=$(date +%s.%N)
    XLA_PYTHON_CLIENT_PREALLOCATE=$pre JEAGLE_CACHE="$sc" python3 -m jeagle.generate "$q" > /dev/null 2>&1
    python3 -c "import json,sys; print(json.dumps({'step': 'startup', 'run': 'preallocate=' + sys.argv[3], 'wall_s': round(float(sys.argv[2]) - float(sys.argv[1]), 3)}))" "$t0" "$(date +%s.%N)" "$pre" | tee -a "$OUT/startup.jsonl"
  done
  python3 bench/probes/device_init.py --repeats 2 2>&1 | tee "$OUT/device_init.jsonl"
  JEAGLE_CACHE="$sc" python3 -X importtime -m jeagle.generate "$q" > /dev/null 2> "$OUT/startup_importtime.log"
  JEAGLE_CACHE="$sc" python3 bench/probes/startup.py --json "$q" 2> "$OUT/startup_probe.log" \
    | python3 -c "import json,sys; print(json.dumps({'step': 'startup', 'run': 'probe'} | json.loads(sys.stdin.read())))" \
    | tee -a "$OUT/startup.jsonl"
  cat "$OUT/startup_probe.log"
fi
