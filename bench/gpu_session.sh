#!/usr/bin/env bash
# The GPU runner's work, run on the device machine from the repo root (see bench/RESULTS.md).
# bench/make_stages.sh builds the staged parts below on the development machine.
# The SmolLM2 GGUF (98.4 MB) travels in three parts (a call carries 64 MiB, the repo ~21 MB of it):
#   .stage1 = smolpart.aa + data.tar.xz (the prompt files: `tar cJf data.tar.xz .data` after
#   `python -m jeagle.train.sources eval ... --out-dir .data`, README's "Training a head"; an older
#   dataset as data0.npz.xz, optional: eaglepeer trains its EAGLE-1 head on it), .stage2 = smolpart.ab,
#   .stage3 = smolpart.ac (+ eagle1_head.tar from an earlier eaglepeer, optional). Calls, back to back while warm:
#   carry .stage1: `bash bench/gpu_session.sh stage`; carry .stage2: `bash bench/gpu_session.sh stage`;
#   carry .stage3 + .whl: `bash bench/gpu_session.sh run STEPS...` (later calls: carry .whl only). Before a call
#   that records runs: `bash bench/stamp_commit.sh` and carry .commit too (the commit the JSONs name).
# Steps: gputests (pytest -m gpu), partings, forms, rows, detcost, and one per headline benchmark: decode, scale, serve,
# accept, prefix, profile, eaglepeer, adaptive. Random-weight steps (forms, rows, detcost, scale, profile, adaptive) need no
# staging: `bash bench/gpu_session.sh run scale profile`; the others need the staged GGUF (serve also the
# server's wheels in .whl: `SERVE=1 bash bench/make_stages.sh`). Each step's knobs are environment variables
# (below, with their defaults). Steps of earlier commits that RESULTS.md and HISTORY.md name (one-off A/Bs,
# head training): `git show b436043:bench/gpu_session.sh`.
set -uo pipefail
mode="${1:-run}"
stage_in() {  # whatever staged parts this call carries -> $HOME/stage; unpack the data archives once
  mkdir -p "$HOME/stage"
  for d in .stage*; do [ -d "$d" ] && cp "$d"/* "$HOME/stage/"; done
  [ -f "$HOME/stage/data0.npz.xz" ] && [ ! -f "$HOME/data0.npz" ] && xz -dc "$HOME/stage/data0.npz.xz" > "$HOME/data0.npz"
  [ -f "$HOME/stage/data.tar.xz" ] && [ ! -d "$HOME/.data" ] && tar xJf "$HOME/stage/data.tar.xz" -C "$HOME"
  [ -d .data ] || { [ -d "$HOME/.data" ] && ln -s "$HOME/.data" .data; }
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
steps=" ${*:-gputests decode} "
for old in bench:decode tp:scale acceptlen:accept; do steps="${steps// ${old%%:*} / ${old#*:} }"; done  # earlier names
step() { [[ "$steps" == *" $1 "* ]]; }
quiet() { grep -v "Converting\|Loading\|Delay kernel"; }  # the conversion's and XLA's chatter
if step gputests; then  # the GPU runner's suite: README "Tests"
  # Straight into the log (no pipe buffering what a timeout would lose), each test named as it ends; past
  # GPUTESTS_LIMIT seconds pytest gets SIGINT and still prints what passed and the durations so far.
  start=$(date +%s)
  timeout -s INT "${GPUTESTS_LIMIT:-540}" python3 -m pytest -v -m gpu --durations=0 --durations-min=1 \
    ${GPUTESTS_ARGS:-} > "$OUT/pytest_gpu.log" 2>&1
  echo "pytest -m gpu wall: $(( $(date +%s) - start )) s" | tee -a "$OUT/pytest_gpu.log"
  grep -v "Converting\|Loading\|Delay kernel" "$OUT/pytest_gpu.log" | tail -60
fi
if step partings; then  # where bf16 EAGLE parts from target-only; deterministic mode's equality and cost
  for spec in ${PARTINGS_RUNS:-default:1,16 deterministic:1,16,48}; do
    python3 bench/probes/partings.py --prompts .data/mtbench.jsonl --num-prompts 48 --batch1-prompts "${PARTINGS_B1:-4}" \
      --max-new-tokens "${PARTINGS_TOKENS:-128}" --modes "${spec%%:*}" --batch-sizes "${spec#*:}" \
      --json-out "$OUT/partings_${spec%%:*}.json" 2>&1 | grep --line-buffered -v "Converting\|Loading\|^{" | tee -a "$OUT/partings.log"
  done
fi
if step forms; then  # deterministic mode's logits in each layer-loop form, with and without XLA's excess precision
  python3 bench/probes/loop_forms.py --shape smollm2 --json-out "$OUT/loop_forms.json" 2>&1 \
    | grep -v '^{"probe"\|Delay kernel' | tee "$OUT/loop_forms.log"
fi
if step rows; then  # deterministic mode's logits for one row alone and among 16 / 48 rows, RMSNorm's sum each way
  python3 bench/probes/batch_rows.py --shape smollm2 --layers "${ROWS_LAYERS:-4}" --rows "${ROWS_ROWS:-1,16,48}" \
    --json-out "$OUT/batch_rows.json" 2>&1 | grep -v '^{"probe"\|Delay kernel' | tee "$OUT/batch_rows.log"
fi
if step detcost; then  # deterministic mode's cost: as built; DETCOST_EXTRA=1 adds autotuning forced on and per-op profiles
  python3 bench/probes/deterministic_cost.py --shape smollm2 --batch-sizes ${DETCOST_BATCHES:-1,16} --tau 3.2 \
    --json-out "$OUT/detcost.json" 2>&1 | grep -v '^{"probe"' | tee "$OUT/detcost.log"
  if [ "${DETCOST_EXTRA:-0}" = 1 ]; then
    JEAGLE_XLA_OPTIONS='{"xla_gpu_autotune_level": 4}' python3 bench/probes/deterministic_cost.py --shape smollm2 \
      --batch-sizes ${DETCOST_BATCHES:-1,16} --tau 3.2 --systems eagle --json-out "$OUT/detcost_autotune.json" 2>&1 \
      | grep -v '^{"probe"' | sed 's/^/autotune4: /' | tee -a "$OUT/detcost.log"
    for det in "" --deterministic; do
      timeout 240 python3 bench/profile_decode.py --shape smollm2 --batch-sizes 16 --spec 5,4,8 --simulate-accept 3.2 \
        --steps 16 --top 15 $det 2>&1 | grep -v "Converting\|Loading" | tee -a "$OUT/detcost_profile.log"
    done
  fi
fi
if step decode; then  # target-only / EAGLE-3 (shipped head) / transformers compiled, MT-bench first turns
  # DECODE_ARGS: more bench/decode.py arguments (e.g. --systems jeagle,jeagle-eagle,jeagle-adaptive --waves 20).
  ${DECODE_TIMEOUT:+timeout "$DECODE_TIMEOUT"} python3 bench/decode.py --prompts .data/mtbench.jsonl \
    --batch-sizes "${DECODE_BATCHES:-1,4,16,48}" --hf-batch-sizes "${HF_BATCHES:-1,16}" ${DECODE_ARGS:-} \
    --json-out "$OUT/decode.json" --plot "$OUT/decode.png" 2>&1 | grep -v '^{"bench"' | tee "$OUT/decode.log"
fi
if step scale; then  # the Llama-3.1-8B shape (random weights), target-only vs EAGLE-3 at a simulated accept length
  # SCALE_TP=1,2 on two GPUs: tensor parallelism (SCALE_VARIANTS: tp > 1 placements VOCAB:DRAFT); SCALE_ARGS
  # replaces --profile (the collectives' share per phase).
  python3 bench/scale.py --shape "${SCALE_SHAPE:-llama8b}" --tp "${SCALE_TP:-1}" --batch-sizes "${SCALE_BATCHES:-1,16}" \
    --tau "${SCALE_TAU:-4.68}" --repeats "${SCALE_REPEATS:-3}" --tp-variants "${SCALE_VARIANTS:-shard:replicate}" \
    ${SCALE_ARGS:---profile} --json-out "$OUT/scale.json" 2>&1 | tee "$OUT/scale.log"
fi
if step serve; then  # the server over HTTP (engine in its own process), MT-bench chat turns, streamed
  # SERVE_SET: the request kinds, each a row per system (target-only, EAGLE) and concurrency, passes interleaved.
  schema='{"type": "object", "properties": {"title": {"type": "string", "maxLength": 60}, "points": {"type": "array", "items": {"type": "string", "maxLength": 80}, "minItems": 3, "maxItems": 5}}, "required": ["title", "points"]}'
  declare -A extras=([plain]='{}' [logprobs]='{"logprobs": true, "top_logprobs": 5}'
    [grammar]="{\"response_format\": {\"type\": \"json_schema\", \"json_schema\": {\"name\": \"outline\", \"schema\": $schema}}}")
  serve_args=(); for name in ${SERVE_SET:-plain logprobs grammar}; do serve_args+=(--extra "${extras[$name]}"); done
  ${SERVE_TIMEOUT:+timeout "$SERVE_TIMEOUT"} python3 bench/serve.py --model smollm2 --prompts .data/mtbench.jsonl \
    --concurrency "${SERVE_CONC:-1,32}" --max-tokens "${SERVE_TOKENS:-256}" --requests-per-client "${SERVE_PER_CLIENT:-4}" \
    --repeats "${SERVE_REPEATS:-3}" "${serve_args[@]}" ${SERVE_ARGS:-} 2>&1 | quiet | tee "$OUT/serve.log"
fi
if step accept; then  # accept length of a head (default: the shipped one) on MT-bench, GSM8K and code, per tier
  python3 bench/accept_length.py --head "${HEAD:-jeagle/heads/smollm2-135m-instruct-eagle3}" \
    --dataset mtbench=.data/mtbench.jsonl:80 --dataset gsm8k=.data/gsm8k.jsonl:200 --dataset code=bench/data/code_eval.jsonl:60 \
    --tiers "${ACC_TIERS:-5,4,8:6,10,60}" --temperatures "${ACC_TEMPS:-0}" --json-out "$OUT/accept_length.json" \
    ${ACC_ARGS:-} 2>&1 | tee "$OUT/accept_length.log"
fi
if step prefix; then  # prefix cache: a cache hit's time to first token; slots on demand + retraction under load
  python3 bench/prefix.py --prompts .data/mtbench.jsonl --scenarios "${PREFIX_SCENARIOS:-ttft,capacity}" \
    --json-out "$OUT/prefix.json" ${PREFIX_ARGS:-} 2>&1 | grep -v "Converting\|Loading" | tee "$OUT/prefix.log"
fi
if step profile; then  # target steps and (5,4,8) rounds at a full batch, per op (random weights)
  # The 8B shape at batch 48: one decode executable compiled for 3.4 min once; batch 1 unless asked.
  for shape in ${PROFILE_SHAPES:-smollm2 llama8b}; do
    tau=4.68; batches="${PROFILE_8B_BATCHES:-1}"
    [ "$shape" = smollm2 ] && tau=3.15 && batches="${PROFILE_BATCHES:-1,48}"  # tau: the shipped head on MT-bench
    python3 bench/profile_decode.py --shape $shape --batch-sizes "$batches" --steps 64 ${PROFILE_ARGS:-} \
      2>&1 | grep -v "Delay kernel" | tee "$OUT/profile_${shape}_target.log"
    python3 bench/profile_decode.py --shape $shape --batch-sizes "$batches" --spec 5,4,8 \
      --simulate-accept $tau --steps 64 ${PROFILE_ARGS:-} 2>&1 | grep -v "Delay kernel" | tee "$OUT/profile_${shape}_round.log"
  done
fi
if step eaglepeer; then  # eagle-llm (official EAGLE-1 code) vs jeagle on one EAGLE-1 head (trained here unless staged)
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
if step adaptive; then  # adaptive vs static tiers on the phased workload (chain and tree tiers; random weights)
  python3 bench/adaptive.py --batch "${ADAPTIVE_BATCHES:-1,16}" --tree-tiers "${TREE_TIERS:-1,4,3:3,4,8:6,4,16}" \
    --mid-noise "${MID_NOISE:-0.02}" --phase-tokens "${PHASE_TOKENS:-384}" --repeats "${ADAPTIVE_REPEATS:-3}" \
    --policies "${ADAPTIVE_POLICIES:-throughput,ema}" 2>&1 | tee "$OUT/adaptive.log"
fi
