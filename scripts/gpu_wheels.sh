#!/usr/bin/env bash
# The wheels a lent GPU machine lacks (it reaches no package index), fetched here into .whl/ before the session's
# one GPU call (docs/gpu.md):
#
#   bash scripts/gpu_wheels.sh [DIR]     DIR defaults to .whl (.gitignore'd: the device call names it in carry)
#
# The GPU image holds torch, transformers, numpy, pyarrow, pandas, fsspec, xxhash and the rest of datasets' needs,
# but not Hydra, OmegaConf, ANTLR's runtime (Hydra's parser), datasets, dill and multiprocess. Each is pinned to the
# version this machine's hybrid runs with, for the GPU image's Python (3.12, x86-64 Linux); ANTLR's 4.9.3 exists
# only as a source archive: its wheel is built here (pure Python, so it runs there). scripts/gpu_session.sh
# installs them with `pip --no-index --no-deps` into a private folder.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PYTHON:-python3}
TARGET_PY=${TARGET_PY:-3.12}
BINARY=(hydra-core omegaconf datasets dill multiprocess)
SOURCE_ONLY=(antlr4-python3-runtime)

pinned() {  # pinned NAME...: NAME==the version installed here
    "$PY" -c 'import sys; from importlib.metadata import version
print("\n".join(f"{n}=={version(n)}" for n in sys.argv[1:]))' "$@"
}

mkdir -p "$DIR"
rm -f "$DIR"/*.whl
mapfile -t wanted < <(pinned "${BINARY[@]}")
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET_PY" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DIR" "${wanted[@]}"
mapfile -t built < <(pinned "${SOURCE_ONLY[@]}")
"$PY" -m pip wheel -q --no-deps -w "$DIR" "${built[@]}"
count=$(find "$DIR" -maxdepth 1 -type f -name '*.whl' | wc -l)
if (( count != ${#BINARY[@]} + ${#SOURCE_ONLY[@]} )); then
    echo "gpu_wheels: $count wheels in $DIR, expected $(( ${#BINARY[@]} + ${#SOURCE_ONLY[@]} ))" >&2
    exit 1
fi
echo "gpu_wheels: $count wheels in $DIR ($(du -sh "$DIR" | cut -f1)); carry \"$DIR\" in the GPU call"
