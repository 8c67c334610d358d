#!/usr/bin/env bash
# Write this checkout's commit into .commit/HEAD (ignored by git) for a GPU call to carry: the device's copy
# of the tree has a stale .git (it reported the first call's commit in every later call on that machine,
# bench/HISTORY.md, 2026-11-28), so `bench/gpu_session.sh` takes JEAGLE_COMMIT from .commit/HEAD when the call carries it:
#   bash bench/stamp_commit.sh   # then carry [".commit", ...] in the call
# "+dirty" marks tracked files changed since the commit.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .commit
stamp="$(git rev-parse --short HEAD)"
[ -n "$(git status --porcelain --untracked-files=no)" ] && stamp="$stamp+dirty"
echo "$stamp" > .commit/HEAD
echo "$stamp"
