#!/usr/bin/env bash
# SGLang against the built-in allocator on hybrid linear-attention (Mamba) traces: the bundled hybrid
# samples, then traces recorded from every bundled workload at pages 1/16/64, spec off and EAGLE, the
# radix cache on and off, both Mamba presets where SGLang serves them (nemotron-h-8b's Mamba2 layers have
# no extra_buffer strategy: radix on at page 1 only), a 60,000-token pool. One line per cell: its evicted
# tokens and steps, then the diff's verdict; a count at the end.
#   KVTRACE_SGLANG_PYTHON=.venv-sglang/bin/python bash tools/mamba_parity_matrix.sh [OUT_DIR]
# MAMBA_MATRIX_WORKLOADS (default "samples mooncake azure sharegpt arxiv") runs a part of the matrix.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
SG=${KVTRACE_SGLANG_PYTHON:?set KVTRACE_SGLANG_PYTHON to an interpreter with SGLang 0.5.23}
OUT=${1:-$(mktemp -d)}
mkdir -p "$OUT"
W=traces/workloads_data
L=$W/sharegpt-arxiv-lengths
declare -A WL=(
  [mooncake]="$W/mooncake-fast25/conversation_trace.jsonl --duration 1s"
  [azure]="$W/azure-llm-inference-2023/AzureLLMInferenceTrace_code.csv --duration 3s"
  [sharegpt]="$L/sharegpt_8k_filtered_stats_llama2_tokenizer.csv --format lengths --rate 2 --duration 3s"
  [arxiv]="$L/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv --format lengths --rate 1 --duration 3s"
)
total=0 same=0
verdict() {  # diff TRACE; prints identical / DIVERGED / diff failed: ...
  local out
  out=$($PY -m kvtrace diff "$1" --a "sglang:$SG" --b builtin --exact --json -q 2>&1)
  echo "$out" | $PY -c 'import json,sys; print("identical" if json.loads(sys.stdin.read())["identical"] else "DIVERGED")' \
    2>/dev/null || echo "diff failed: ${out: -300}"
}
cell() {  # LABEL TRACE [EVICTED,STEPS]
  local v; v=$(verdict "$2")
  total=$((total + 1)); [ "$v" = identical ] && same=$((same + 1))
  echo "$1 ${3:+evicted,steps=$3 }-> $v"
}
for wl in ${MAMBA_MATRIX_WORKLOADS:-samples mooncake azure sharegpt arxiv}; do
  if [ "$wl" = samples ]; then
    for s in mooncake-qwen3-next mooncake-qwen3-next-radix; do cell "sample:$s" "sample:$s"; done
    continue
  fi
  for page in 1 16 64; do for spec in off eagle; do for radix in on off; do
    for model in qwen3-next-80b-a3b nemotron-h-8b; do
      # SGLang serves Mamba2 with the radix cache at page 1 only (record refuses the rest)
      [ "$model" = nemotron-h-8b ] && [ "$radix" = on ] && [ "$page" != 1 ] && continue
      t="$OUT/$wl-$page-$spec-radix_$radix-$model.kvtrace"
      sp=(); [ "$spec" = eagle ] && sp=(--spec eagle:3,1,4)
      # shellcheck disable=SC2086
      rec=$($PY -m kvtrace record ${WL[$wl]} --model "$model" --page-size "$page" --pool-tokens 60000 "${sp[@]}" \
            "--$([ "$radix" = on ] || echo no-)radix-cache" -o "$t" --force --json -q 2>&1 | tail -1)
      got=$(echo "$rec" | $PY -c 'import json,sys; d=json.loads(sys.stdin.read()); print(d["evicted_tokens"], d["steps"], sep=",")' \
            2>/dev/null) || { total=$((total + 1)); echo "$wl page=$page spec=$spec radix=$radix $model -> record failed: $rec"; continue; }
      cell "$wl page=$page spec=$spec radix=$radix $model" "$t" "$got"
    done
  done; done; done
done
echo "$same of $total cells identical"
