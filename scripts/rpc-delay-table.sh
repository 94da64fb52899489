#!/usr/bin/env bash
# The RPC delay table of docs/rpc.md: ar, sd, mtad and mmtad (project defaults: gamma auto, T = 1,
# seeds shared) with the target's layers on two ggml-rpc-servers on 127.0.0.1, reached directly
# and through relays adding 0, 0.25, 1 and 2.5 ms each way (bench --relay-delay), beside the pair
# on this machine alone; for the default pair and its x4 stand-in. Long: about 2 hours on an idle
# 2-core machine (the stand-in's runs are most of it). Run it on an idle machine only.
#   scripts/rpc-delay-table.sh [OUT]     each run in OUT/<pair>-<setting>/, the table in OUT/table.md
# Environment: MTAD_EDGE (the command, default .venv/bin/mtad-edge), RPC_DELAYS ("0 0.25 1 2.5"),
# RPC_X4 (the stand-in's folder, made where missing: standins/smollm2-x4), RPC_SERVER_THREADS (1),
# RPC_PORTS ("50052 50053"), RPC_METHODS ("ar,sd,mtad,mmtad"), RPC_SPECS ("PAIR|TAG|BENCH ARGS;..." for other pairs or a short try).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-rpc-delay}
exe=${MTAD_EDGE:-$repo/.venv/bin/mtad-edge}
py=$(dirname "$(command -v "$exe")")/python
delays=${RPC_DELAYS:-0 0.25 1 2.5}
x4=${RPC_X4:-standins/smollm2-x4}
read -r -a ports <<< "${RPC_PORTS:-50052 50053}"
specs=${RPC_SPECS:-"smollm2-135m|x1|--max-tokens 128 --repeats 2;$x4/manifest.json|x4|--max-tokens 64 --repeats 2"}
mkdir -p "$out"
"$exe" rpc build >&2
if [[ $specs == *"$x4/manifest.json"* && ! -f $x4/manifest.json ]]; then
  "$exe" export widen --target smollm2-135m --factor 4 --out "$x4" >&2
fi
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait' EXIT
servers=""
for port in "${ports[@]}"; do
  "$exe" rpc server --port "$port" --threads "${RPC_SERVER_THREADS:-1}" >"$out/server-$port.log" 2>&1 &
  pids+=($!)
  servers+="${servers:+,}127.0.0.1:$port"
done
for port in "${ports[@]}"; do  # ready once it answers the hello
  for _ in $(seq 100); do
    "$py" -c "from mtad_edge.runtime.backends.rpc import check_server; check_server('127.0.0.1:$port')" 2>/dev/null && break
    sleep 0.2
  done
done
run() {  # NAME PAIR BENCH-ARGS...
  local name=$1 pair=$2
  shift 2
  [[ -f $out/$name/results.json ]] && return  # done in an earlier, interrupted run
  echo "== $name" >&2
  "$exe" bench --pair "$pair" --methods "${RPC_METHODS:-ar,sd,mtad,mmtad}" "$@" --out "$out/$name" >"$out/$name.log" 2>&1
}
IFS=';' read -r -a spec_list <<< "$specs"
for spec in "${spec_list[@]}"; do
  IFS='|' read -r pair tag args <<< "$spec"
  read -r -a args <<< "$args"
  run "$tag-local" "$pair" "${args[@]}"
  run "$tag-rpc-direct" "$pair" "${args[@]}" --rpc "$servers"
  for d in $delays; do
    run "$tag-rpc-$d" "$pair" "${args[@]}" --rpc "$servers" --relay-delay "$d"
  done
done
"$py" "$repo/scripts/rpc_delay_table.py" "$out" | tee "$out/table.md"
