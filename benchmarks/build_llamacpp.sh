#!/usr/bin/env bash
# Build llama.cpp's shared libraries at one ISA level, for benchmarks/llamacpp.py --isa and
# benchmarks/serve_llamacpp.py --isa (which point llama-cpp-python at them with
# LLAMA_CPP_LIB_PATH). The source is the sdist of the llama-cpp-python release installed in the
# venv (its vendor/llama.cpp), taken from the package registry by pip: the same llama.cpp the
# installed bindings were written for.
#
#   bash benchmarks/build_llamacpp.sh avx2     # -> ~/.cache/attnlab/llamacpp/<version>-avx2/
#   bash benchmarks/build_llamacpp.sh native   # -> ~/.cache/attnlab/llamacpp/<version>-native/
#
# avx2: GGML_NATIVE=OFF with AVX, AVX2, FMA and F16C on and every AVX-512 / AMX / VNNI kind off:
# what llama.cpp runs on an AVX2-only CPU (a laptop, a first-generation Zen). native: -march=native.
# Libraries only (no tools, tests or examples): about 10 minutes on one core.
set -euo pipefail
ISA=${1:?usage: build_llamacpp.sh avx2|native}
PY=${PYTHON:-.venv/bin/python}
JOBS=${JOBS:-2}
VERSION=$("$PY" -c "import importlib.metadata as m; print(m.version('llama_cpp_python'))" 2>/dev/null || true)
if [ -z "$VERSION" ]; then
    echo "build_llamacpp.sh: llama-cpp-python is not installed in $PY's environment (pip install -e '.[bench]')" >&2
    exit 1
fi
OUT=${OUT:-$HOME/.cache/attnlab/llamacpp/$VERSION-$ISA}
case "$ISA" in
    avx2) FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                 -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
                 -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF
                 -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF) ;;
    native) FLAGS=(-DGGML_NATIVE=ON) ;;
    *) echo "build_llamacpp.sh: ISA must be avx2 or native, not '$ISA'" >&2; exit 1 ;;
esac
if [ -f "$OUT/libllama.so" ]; then
    echo "$OUT"
    exit 0
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK" >&2
tar xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DGGML_OPENMP=ON \
    -DCMAKE_INSTALL_RPATH='$ORIGIN' -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON "${FLAGS[@]}" >&2
cmake --build "$WORK/build" -j "$JOBS" --target llama >&2
mkdir -p "$OUT"
find "$WORK/build" -name 'lib*.so*' -exec cp -P {} "$OUT"/ \;
echo "$OUT"
