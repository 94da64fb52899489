#!/usr/bin/env bash
# llama.cpp's shared libraries with working AMX kernels, for llama-cpp-python to load instead of
# its own (docs/backends.md#amx). GCC 12 drops the stores of ggml's AMX tile configuration, so
# llama-cpp-python's build crashes on AMX machines in any call of more than one row; one compiler
# barrier keeps them. Usage: scripts/amx-llama-cpp.sh DIR, then export what it prints.
set -euo pipefail
dest=${1:?usage: $0 DIR}
ver=$(python -c "import llama_cpp; print(llama_cpp.__version__)")
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)
python -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$ver" -d "$dest" >&2
tar xzf "$dest/llama_cpp_python-$ver.tar.gz" -C "$dest"
src=$dest/llama_cpp_python-$ver/vendor/llama.cpp
mmq=$src/ggml/src/ggml-cpu/amx/mmq.cpp
if ! grep -q 'asm volatile("" : : "r"(&tc) : "memory");' "$mmq"; then
  grep -q '^    _tile_loadconfig(&tc);$' "$mmq" || { echo "no tile configuration load found in $mmq" >&2; exit 1; }
  sed -i 's|^    _tile_loadconfig(&tc);$|    asm volatile("" : : "r"(\&tc) : "memory");\n    _tile_loadconfig(\&tc);|' "$mmq"
fi
cmake -S "$src" -B "$dest/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF >&2
cmake --build "$dest/build" -j"$(nproc)" --target llama >&2
echo "export LLAMA_CPP_LIB_PATH=$dest/build/bin LD_LIBRARY_PATH=$dest/build/bin"
