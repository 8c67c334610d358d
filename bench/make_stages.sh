#!/usr/bin/env bash
# Build the staged parts that bench/gpu_session.sh expects, on the development machine (see its header):
#   .stage1 = smolpart.aa + data.tar.xz (the prompt and evaluation files of .data/), .stage2 = smolpart.ab,
#   .stage3 = smolpart.ac, .whl = the gguf and eagle-llm wheels (the GPU image lacks them).
# Each part stays under what one call carries beside the repo (64 MiB in all; the repo is ~23 MB of it).
#   bash bench/make_stages.sh                              # GGUF parts, data.tar.xz, .whl
#   SERVE=1 bash bench/make_stages.sh                      # also the server's wheels in .whl (bench/serve.py)
# The GGUF comes from jeagle's cache (`python -m jeagle.generate` fetches it once); the .data files from
# `python -m jeagle.train.sources eval|build` (README, "Training a head").
set -euo pipefail
cd "$(dirname "$0")/.."
gguf="${JEAGLE_CACHE:-$HOME/.cache/jeagle}/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -f "$gguf" ] || { echo "no $gguf: run python -m jeagle.generate once (it fetches the model)"; exit 1; }
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $gguf" | sha256sum -c --quiet -
rm -rf .stage1 .stage2 .stage3 && mkdir -p .stage1 .stage2 .stage3 .whl
tmp=$(mktemp -d) && split -b 33000000 "$gguf" "$tmp/smolpart."
mv "$tmp/smolpart.aa" .stage1/ && mv "$tmp/smolpart.ab" .stage2/ && mv "$tmp/smolpart.ac" .stage3/ && rmdir "$tmp"
files=(); for f in mtbench.jsonl gsm8k.jsonl code_eval.jsonl exclude.jsonl mix.jsonl mix.json sharegpt.jsonl; do
  [ -f ".data/$f" ] && files+=(".data/$f"); done
[ ${#files[@]} -gt 0 ] && tar cJf .stage1/data.tar.xz "${files[@]}" || echo "no .data/*.jsonl: .stage1 without data.tar.xz"
# gguf (the GGUF reader) and eagle-llm (the official EAGLE code tests/test_gpu.py compares against).
for w in gguf==0.17.1 eagle-llm==1.2.1; do
  ls ".whl/$(echo "${w%%==*}" | tr - _)"-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 -d .whl "$w"
done
# SERVE=1: also the server's wheels (bench/serve.py, gpu_session.sh's `serve` step; the GPU image has none of
# them, llguidance included), at the versions the venv runs; llguidance and orjson are binary wheels.
if [ "${SERVE:-0}" = 1 ]; then
  for w in uvicorn==0.54.0 starlette==1.10.0 h11==0.16.0 click==8.5.1 anyio==4.16.0 httpx==0.28.1 httpcore==1.0.9 \
      sniffio==1.3.1 certifi==2026.10.19.post1 idna==3.20 typing_extensions==4.16.0 orjson==3.13.0 llguidance==1.9.1; do
    ls ".whl/$(echo "${w%%==*}" | tr - _)"-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps --only-binary=:all: \
      --python-version 3.12 --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --abi cp312 --abi abi3 --abi none -d .whl "$w"
  done
fi
du -sh .stage* .whl
