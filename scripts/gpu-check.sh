#!/usr/bin/env bash
# The CUDA checks of docs/gpu.md in one command. Two steps:
#   scripts/gpu-check.sh pack       where pip works (needs the [export] extra for gguf): .gpu/ gets
#                                   the pinned llama-cpp-python sdist, pruned (no models, docs or
#                                   tests), a GGUF holding only SmolLM2's tokenizer and diskcache's wheel
#   scripts/gpu-check.sh run [OUT]  on an NVIDIA machine with nvcc, cmake, ninja, python3 + numpy,
#                                   offline: builds llama.cpp with CUDA (the library and llama-bench),
#                                   makes random-weight models of real shapes, runs tests/test_device.py
#                                   on the GPU, times calls and plain decoding (scripts/gpu_costs.py);
#                                   results in OUT (default .gpu/out). Rerunning resumes: a finished
#                                   build is kept, one still running (setsid) is waited for.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
ver=$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' "$repo/pyproject.toml")
pack=$repo/.gpu
work=${GPU_CHECK_WORK:-/tmp/gpu-check}
arch=${GPU_CHECK_ARCH:-90-real}  # H100/H200; the PTX-less target keeps the build to one pass per file
big=${GPU_CHECK_TARGET:-llama-3.1-8b} small=${GPU_CHECK_AUX:-llama-3.2-1b}  # shapes (mtad_edge/bench/shapes.py)
reps=${GPU_CHECK_REPS:-9}

if [[ ${1:-} == pack ]]; then
  py=${PYTHON:-$repo/.venv/bin/python}
  mkdir -p "$pack/wheels" "$work"
  sdist=${SDIST:-}
  if [[ -z $sdist ]]; then
    "$py" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$ver" -d "$work"
    sdist=$work/llama_cpp_python-$ver.tar.gz
  fi
  rm -rf "$work/pack" && mkdir -p "$work/pack" && tar xzf "$sdist" -C "$work/pack"
  src=llama_cpp_python-$ver
  tar cJf "$pack/$src.tar.xz" -C "$work/pack" \
    --exclude="$src/vendor/llama.cpp/models" --exclude="$src/vendor/llama.cpp/docs" \
    --exclude="$src/vendor/llama.cpp/tests" --exclude="$src/vendor/llama.cpp/benches" \
    --exclude="$src/vendor/llama.cpp/media" --exclude="$src/vendor/llama.cpp/.github" \
    --exclude="$src/.git" --exclude="$src/docs" --exclude="$src/tests" --exclude="$src/examples" "$src"
  target=$("$py" -c 'from mtad_edge.pairs import load_manifest, prepare; print(prepare(load_manifest("smollm2-135m")).target)')
  "$py" -m mtad_edge.bench.shapes vocab "$target" "$pack/vocab.gguf"
  "$py" -m pip download -q --no-deps --only-binary :all: diskcache -d "$pack/wheels"
  du -sh "$pack"/*
  exit 0
fi
[[ ${1:-} == run ]] || { echo "usage: $0 pack | run [OUT]" >&2; exit 2; }
out=$(mkdir -p "${2:-$pack/out}" && cd "${2:-$pack/out}" && pwd)
src=$work/src/llama_cpp_python-$ver
build=$work/build
mkdir -p "$work/src" "$work/models"
[[ -d $src ]] || tar xJf "$pack/llama_cpp_python-$ver.tar.xz" -C "$work/src"

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; nvcc --version | tail -2
  nproc; python3 -c 'import numpy, sys; print(sys.version.split()[0], "numpy", numpy.__version__)'; } > "$out/device.txt" 2>&1 || true
cat "$out/device.txt"

# Python: llama-cpp-python's own modules over the library built here, mtad_edge as it installs
site=$work/site
mkdir -p "$site/mtad_edge"
for f in "$repo"/mtad_edge/*; do ln -sfn "$f" "$site/mtad_edge/"; done
for d in runtime export models; do ln -sfn "$repo/$d" "$site/mtad_edge/$d"; done
ln -sfn "$src/llama_cpp" "$site/llama_cpp"
python3 -c 'import diskcache' 2>/dev/null || (cd "$site" && python3 -m zipfile -e "$pack"/wheels/diskcache-*.whl .)
export PYTHONPATH=$site:$src/vendor/llama.cpp/gguf-py LLAMA_CPP_LIB_PATH=$build/bin MTAD_EDGE_VOCAB_GGUF=$pack/vocab.gguf

# Models, made while the build runs: the test pair is made by the test itself
vocab=$pack/vocab.gguf m=$work/models
if [[ ! -f $m/done ]]; then
  (for spec in "$big q4_k_m" "$small q4_k_m" "$big q4_0" "$small q4_0"; do
     set -- $spec; python3 -P -m mtad_edge.bench.shapes model "$1" "$2" "$m/$1-$2.gguf" --vocab "$vocab" --weights bytes
   done && touch "$m/done") > "$out/models.log" 2>&1 &
fi

# cuBLAS where the toolkit lacks it (pip's nvidia wheels), and no VMM pool where no libcuda is found
cuda_args=""
toolkit=$(cd "$(dirname "$(readlink -f "$(command -v nvcc)")")/.." && pwd)
have_cublas() { for d in "$toolkit" "${CUDA_HOME:-/usr/local/cuda}"; do compgen -G "$d/include/cublas_v2.h" || compgen -G "$d/targets/*/include/cublas_v2.h"; done; }
if [[ -z $(have_cublas) ]]; then
  hdr=$(python3 -c 'import glob, sys
print(next(iter(h for r in sys.path for h in sorted(glob.glob(r + "/nvidia/*/include/cublas_v2.h"))), ""))')
  [[ -n $hdr ]] || { echo "no cuBLAS headers in $toolkit or in python3's nvidia packages"; exit 1; }
  inc=$(dirname "$hdr") lib=$(dirname "$(dirname "$hdr")")/lib
  cuda_args="-DCMAKE_CUDA_FLAGS=-I$inc -DCUDA_cublas_LIBRARY=$(ls "$lib"/libcublas.so* | head -1)"
  cuda_args+=" -DCUDA_cublasLt_LIBRARY=$(ls "$lib"/libcublasLt.so* | head -1)"
  export LD_LIBRARY_PATH=$lib:${LD_LIBRARY_PATH:-}
fi
compgen -G "$toolkit/lib64/stubs/libcuda.so" >/dev/null || ldconfig -p | grep -q 'libcuda.so ' || cuda_args+=" -DGGML_CUDA_NO_VMM=ON"
echo "toolkit $toolkit; extra cmake args: ${cuda_args:-none}" | tee -a "$out/device.txt"
generator=$(command -v ninja >/dev/null && echo "-G Ninja" || echo "")

# The build: under setsid, so that a run cut off by its time limit leaves it going for the next
if [[ ! -f $build/done ]]; then
  if ! { [[ -f $work/build.pid ]] && kill -0 "$(cat "$work/build.pid")" 2>/dev/null; }; then
    setsid bash -c "cmake -S '$src/vendor/llama.cpp' -B '$build' $generator -DCMAKE_BUILD_TYPE=Release $cuda_args \
      -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES='$arch' -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF && cmake --build '$build' -j\$(nproc) --target llama llama-bench llama-speculative-simple \
      && touch '$build/done'" > "$work/build.log" 2>&1 < /dev/null &
    echo $! > "$work/build.pid"
  fi
  t0=$SECONDS
  while kill -0 "$(cat "$work/build.pid")" 2>/dev/null; do sleep 5; done
  echo "build waited $((SECONDS - t0)) s"
fi
cp "$work/build.log" "$out/build.log" 2>/dev/null || true
[[ -f $build/done ]] || { tail -30 "$work/build.log"; echo "build failed"; exit 1; }
wait || true
[[ -f $m/done ]] || { cat "$out/models.log"; echo "models failed"; exit 1; }

set +e
(cd "$repo" && timeout 150 python3 -P -m pytest tests/test_device.py -q -s -p no:cacheprovider 2>&1) | grep -v "^llama\|^load\|^print_info" > "$out/tests.log"
tail -5 "$out/tests.log"
costs() { timeout 150 python3 "$repo/scripts/gpu_costs.py" measure "$@" --reps "$reps" --llama-bench "$build/bin" 2>&1 \
  | grep -v "^llama\|^load\|^print_info\|^ggml\|^\.\|^$" | tail -12; }
costs "$m/$big-q4_k_m.gguf" --aux "$m/$small-q4_k_m.gguf" --aux-ngl -1 0 --threads "$(nproc)" --out "$out/costs-q4_k_m.json"
budget=${GPU_CHECK_SECONDS:-480}  # the Q4_0 pair only where the run's time allows
if ((SECONDS < budget - 100)); then
  costs "$m/$big-q4_0.gguf" --aux "$m/$small-q4_0.gguf" --aux-ngl -1 --threads "$(nproc)" --out "$out/costs-q4_0.json"
fi
echo "== $((SECONDS)) s"
cat "$out/device.txt"; tail -3 "$out/tests.log"
python3 "$repo/scripts/gpu_costs.py" summary "$out"/costs-*.json
