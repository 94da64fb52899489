#!/usr/bin/env bash
# The CUDA checks of docs/gpu.md in one command:
#   scripts/gpu-check.sh pack        where pip works (the [test] extras installed): .gpu/ gets the pinned
#                                    llama-cpp-python sdist pruned (no models, docs or tests), a GGUF
#                                    holding only SmolLM2's tokenizer, and diskcache's wheel (~10 MB)
#   scripts/gpu-check.sh build DIR   builds llama.cpp with CUDA from that sdist into DIR (the libraries,
#                                    llama-bench, llama-speculative-simple: GPU_CHECK_TARGETS): needs nvcc
#                                    and cuBLAS (the toolkit's or pip's nvidia-cublas); ~5 min on 16 cores,
#                                    ~40 on 2 (GPU_CHECK_SDIST: another sdist; GPU_CHECK_CUDA=0: no CUDA;
#                                    GPU_CHECK_AVX512=0: AVX2 only, for gpu-run.sh's GPU_RUN_PREBUILT)
#   scripts/gpu-check.sh run [OUT]   on an NVIDIA machine, offline: builds (or takes GPU_CHECK_BIN, a
#                                    DIR/bin built elsewhere), makes random-weight models of real
#                                    shapes, runs tests/test_device.py on the GPU and times calls and
#                                    plain decoding (scripts/gpu_costs.py); results in OUT (.gpu/out)
#   scripts/gpu-check.sh table [OUT] the same setup; times 8B, 32B and 70B Q4_K_M targets against
#                                    135M, 0.5B and 1B auxes, all on the GPU, and projects each pair
#                                    from a bench's steps (GPU_CHECK_BENCH, else .gpu/bench.json): table.md
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
ver=$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' "$repo/pyproject.toml")
pack=$repo/.gpu
work=${GPU_CHECK_WORK:-/tmp/gpu-check}
src=$work/src/llama_cpp_python-$ver
arch=${GPU_CHECK_ARCH:-90-real}  # H100/H200; no PTX: one compile pass per file
big=${GPU_CHECK_TARGET:-llama-3.1-8b} small=${GPU_CHECK_AUX:-llama-3.2-1b}  # mtad_edge/bench/shapes.py
reps=${GPU_CHECK_REPS:-9}
targets=(${GPU_CHECK_TARGETS_TABLE:-llama-3.1-8b qwen2.5-32b llama-3.1-70b})  # the table's shapes
auxes=(${GPU_CHECK_AUXES:-smollm2-135m qwen2.5-0.5b llama-3.2-1b})

unpack() {
  mkdir -p "$work/src"
  [[ -d $src ]] || tar xJf "${GPU_CHECK_SDIST:-$pack/llama_cpp_python-$ver.tar.xz}" -C "$work/src"
}

cuda_root() {  # the toolkit nvcc belongs to (CUDA_HOME, else nvcc's folder, else /usr/local/cuda:
  local d      # a /usr/local/bin/nvcc that is a wrapper script has no toolkit around it)
  for d in ${CUDA_HOME:-} "$(dirname "$(readlink -f "$(command -v nvcc)")")/.." /usr/local/cuda; do
    [[ -n $d && -f $d/bin/nvcc && ( -f $d/include/cuda_runtime.h || -n $(ls "$d"/targets/*/include/cuda_runtime.h 2>/dev/null) ) ]] \
      && { (cd "$d" && pwd); return 0; }
  done
  echo "no CUDA toolkit found (set CUDA_HOME)" >&2; return 1
}

toolkit_has_cublas() {  # in any of the toolkit's include folders
  local h
  for h in "$1"/include/cublas_v2.h "$1"/targets/*/include/cublas_v2.h "${CUDA_HOME:-/usr/local/cuda}"/include/cublas_v2.h; do
    [[ -f $h ]] && return 0
  done
  return 1
}

site() {  # site DIR WHEELS: mtad_edge as it installs (symlinks into this checkout), diskcache and llguidance from their wheels
  mkdir -p "$1/mtad_edge"
  for f in "$repo"/mtad_edge/*; do ln -sfn "$f" "$1/mtad_edge/"; done
  for d in runtime export models; do ln -sfn "$repo/$d" "$1/mtad_edge/$d"; done
  local wheels
  wheels=$(cd "$2" && pwd)
  python3 -c 'import diskcache' 2>/dev/null || (cd "$1" && python3 -m zipfile -e "$wheels"/diskcache-*.whl .)
  # structured output's grammar engine (an abi3 wheel: any CPython >= 3.9 on x86-64 Linux)
  python3 -c 'import llguidance' 2>/dev/null || (cd "$1" && python3 -m zipfile -e "$wheels"/llguidance-*.whl .)
}

build() {  # build DIR: configure and build; cuBLAS from pip where the toolkit lacks it
  local dir=$1 extra="" toolkit hdr inc lib avx512=ON
  [[ ${GPU_CHECK_AVX512:-1} == 1 ]] || avx512=OFF  # a library to carry to a machine whose CPU is not known
  if [[ ${GPU_CHECK_CUDA:-1} == 0 ]]; then  # the CPU rehearsal (scripts/gpu-run.sh dry-run): same targets, no CUDA
    cmake -S "$src/vendor/llama.cpp" -B "$dir" $(command -v ninja >/dev/null && echo "-G Ninja") \
      -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
    cmake --build "$dir" -j"$(nproc)" --target ${GPU_CHECK_TARGETS:-llama llama-bench llama-speculative-simple}
    return
  fi
  toolkit=$(cuda_root)
  if ! toolkit_has_cublas "$toolkit"; then
    hdr=$(python3 -c 'import glob, sys
print(next(iter(h for r in sys.path for h in sorted(glob.glob(r + "/nvidia/*/include/cublas_v2.h"))), ""))')
    [[ -n $hdr ]] || { echo "no cuBLAS headers in $toolkit or in python3's nvidia packages" >&2; return 1; }
    inc=$(dirname "$hdr") lib=$(dirname "$(dirname "$hdr")")/lib
    extra="-DCMAKE_CUDA_FLAGS=-I$inc -DCUDA_cublas_LIBRARY=$(ls "$lib"/libcublas.so* | head -1)"
    extra+=" -DCUDA_cublasLt_LIBRARY=$(ls "$lib"/libcublasLt.so* | head -1)"
    export LD_LIBRARY_PATH=$lib:${LD_LIBRARY_PATH:-}
  fi
  # The flags the measured library was built with (docs/gpu.md): AVX-512 rather than the build
  # machine's -march=native, and no VMM pool (a device build with both crashed while loading a
  # model in our process, on 2026-11-27; this one did not).
  cmake -S "$src/vendor/llama.cpp" -B "$dir" $(command -v ninja >/dev/null && echo "-G Ninja") \
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" -DGGML_CUDA_NO_VMM=ON -DGGML_NATIVE=OFF \
    -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=$avx512 -DGGML_AVX512_VNNI=$avx512 $extra
  cmake --build "$dir" -j"$(nproc)" --target ${GPU_CHECK_TARGETS:-llama llama-bench llama-speculative-simple}
}

case ${1:-} in
pack)
  py=${PYTHON:-$repo/.venv/bin/python}
  mkdir -p "$pack/wheels" "$work"
  sdist=${SDIST:-}
  if [[ -z $sdist ]]; then
    "$py" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$ver" -d "$work"
    sdist=$work/llama_cpp_python-$ver.tar.gz
  fi
  rm -rf "$work/pack" && mkdir -p "$work/pack" && tar xzf "$sdist" -C "$work/pack"
  s=llama_cpp_python-$ver v=$s/vendor/llama.cpp
  tar cJf "$pack/$s.tar.xz" -C "$work/pack" --exclude="$v/models" --exclude="$v/docs" --exclude="$v/tests" \
    --exclude="$v/benches" --exclude="$v/media" --exclude="$v/.github" --exclude="$s/.git" --exclude="$s/docs" \
    --exclude="$s/tests" --exclude="$s/examples" "$s"
  target=$("$py" -c 'from mtad_edge.pairs import load_manifest, prepare; print(prepare(load_manifest("smollm2-135m")).target)')
  "$py" -m mtad_edge.bench.shapes vocab "$target" "$pack/vocab.gguf"
  lg=$(sed -n 's/.*"llguidance==\([0-9.]*\)".*/\1/p' "$repo/pyproject.toml")
  "$py" -m pip download -q --no-deps --only-binary :all: diskcache "llguidance==$lg" -d "$pack/wheels"
  [[ -z ${GPU_CHECK_BENCH:-} ]] || cp "$GPU_CHECK_BENCH" "$pack/bench.json"  # the steps `table` prices
  du -sh "$pack"/*
  exit 0 ;;
site)  # for scripts/gpu-run.sh
  [[ -n ${3:-} ]] || { echo "usage: $0 site DIR WHEELS" >&2; exit 2; }
  site "$2" "$3"
  exit 0 ;;
build)
  [[ -n ${2:-} ]] || { echo "usage: $0 build DIR" >&2; exit 2; }
  unpack  # a simple command each: under set -e a failure in an && list would not stop the script
  build "$2"
  exit 0 ;;
run | table) ;;
*) echo "usage: $0 pack | build DIR | run [OUT] | table [OUT]" >&2; exit 2 ;;
esac
mode=$1

out=$(mkdir -p "${2:-$pack/out}" && cd "${2:-$pack/out}" && pwd)
unpack
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; lscpu | grep -m1 "Model name"
  nvcc --version | tail -1; python3 -c 'import numpy, sys; print(sys.version.split()[0], "numpy", numpy.__version__)'
} > "$out/device.txt" 2>&1 || true
cat "$out/device.txt"

# Python: llama-cpp-python's own modules over the library built here, mtad_edge as it installs
site=$work/site m=$work/models
mkdir -p "$m"
site "$site" "$pack/wheels"
ln -sfn "$src/llama_cpp" "$site/llama_cpp"
export PYTHONPATH=$site:$src/vendor/llama.cpp/gguf-py MTAD_EDGE_VOCAB_GGUF=$pack/vocab.gguf
# -P: the checkout's mtad_edge/ is not the installed layout (runtime/ sits beside it)
specs=("$big q4_k_m" "$small q4_k_m" "$big q4_0" "$small q4_0")
[[ $mode == table ]] && specs=("${auxes[@]/%/ q4_k_m}")  # the targets are made one at a time (disk)
for spec in "${specs[@]}"; do
  set -- $spec
  [[ -f $m/$1-$2.gguf ]] || python3 -P -m mtad_edge.bench.shapes model "$1" "$2" "$m/$1-$2.gguf" \
    --vocab "$pack/vocab.gguf" --weights bytes
done > "$out/models.log" 2>&1 &
models=$!

bin=${GPU_CHECK_BIN:-$work/build/bin}
if [[ -z ${GPU_CHECK_BIN:-} && ! -f $work/build/done ]]; then
  t0=$SECONDS
  build "$work/build" > "$out/build.log" 2>&1 && touch "$work/build/done" || { tail -30 "$out/build.log"; exit 1; }
  echo "built in $((SECONDS - t0)) s"
fi
cuda=$(cuda_root)
export LLAMA_CPP_LIB_PATH=$bin LD_LIBRARY_PATH=$bin:$cuda/lib64:${LD_LIBRARY_PATH:-}
wait "$models" || { cat "$out/models.log"; exit 1; }

# llama.cpp's library first, then numpy: the order llama-cpp-python itself loads them in
first="import llama_cpp, runpy, sys"
set +e
[[ $mode == run ]] && (cd "$repo" && timeout 150 python3 -P -c "$first; import pytest
sys.exit(pytest.main(['tests/test_device.py', '-q', '-s', '-p', 'no:cacheprovider']))" 2>&1) \
  | grep -v "^llama\|^load\|^print_info" > "$out/tests.log"
costs() {
  timeout 300 python3 -P -c "$first; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')" \
    "$repo/scripts/gpu_costs.py" measure "$@" --reps "$reps" --threads "$(nproc)" --llama-bench "$bin" 2>&1 \
    | grep -v "^llama\|^load\|^print_info\|^ggml\|^\.\|^$" | tail -12
}
if [[ $mode == table ]]; then  # every target shape against every aux shape, Q4_K_M, all on the GPU
  # first the smallest aux as a model of its own, with CUDA graphs and without (what a call costs
  # when its shape repeats, and in drafting's order): graphs-on.json, graphs-off.json
  a=$m/${auxes[0]}-q4_k_m.gguf
  costs "$a" --aux "$a" --out "$out/graphs-on.json" | grep "aux\|as drafted\|ar T=0\|llama-bench"
  GGML_CUDA_DISABLE_GRAPHS=1 costs "$a" --aux "$a" --out "$out/graphs-off.json" | grep "aux\|as drafted\|ar T=0"
  # the exit of a process that used CUDA, its models closed (139 after every bench on 2026-11-28):
  # plain Python, then the console script (which ends without native finalization)
  python3 -P -c "$first; from mtad_edge.runtime.backends.llama_cpp_backend import LlamaCppBackend as B
from mtad_edge.runtime.backend import Batch
m = B(sys.argv[1]); m.decode(Batch.run([1, 2, 3], 0)); m.close()" "$a" > "$out/exit-python.log" 2>&1
  echo "exit status: plain python $?"
  head -2 "$repo/mtad_edge/data/prompts.jsonl" > "$work/two.jsonl"
  python3 -P -c "$first; from mtad_edge.console import main; sys.argv = ['mtad-edge', *sys.argv[1:]]; main()" bench \
    --target "$a" --aux "$a" --methods ar,sd --max-tokens 4 --prompts "$work/two.jsonl" --out "$work/exit-bench" > "$out/exit-bench.log" 2>&1
  echo "exit status: mtad-edge bench $?"
  for t in "${targets[@]}"; do
    python3 -P -m mtad_edge.bench.shapes model "$t" q4_k_m "$m/$t-q4_k_m.gguf" --vocab "$pack/vocab.gguf" \
      --weights bytes >> "$out/models.log" 2>&1 || { tail -3 "$out/models.log"; exit 1; }
    afiles=() && for a in "${auxes[@]}"; do afiles+=("$m/$a-q4_k_m.gguf"); done
    costs "$m/$t-q4_k_m.gguf" --aux "${afiles[@]}" --out "$out/costs-$t.json" | head -3
    rm -f "$m/$t-q4_k_m.gguf"
  done
  bench=${GPU_CHECK_BENCH:-$pack/bench.json}
  python3 "$repo/scripts/gpu_costs.py" table "$out"/costs-*.json --bench "$bench" | tee "$out/table.md"
  exit 0
fi
costs "$m/$big-q4_k_m.gguf" --aux "$m/$small-q4_k_m.gguf" --aux-ngl -1 0 --out "$out/costs-q4_k_m.json" >/dev/null
costs "$m/$big-q4_0.gguf" --aux "$m/$small-q4_0.gguf" --aux-ngl -1 0 --out "$out/costs-q4_0.json" >/dev/null
echo "== $SECONDS s"
tail -3 "$out/tests.log"
python3 "$repo/scripts/gpu_costs.py" summary "$out"/costs-*.json
