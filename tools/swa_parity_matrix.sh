#!/usr/bin/env bash
# SGLang against the built-in allocator on hybrid SWA traces recorded from every bundled workload:
# pages 1/16/64, spec off, EAGLE and DFlash, both SWA presets, the radix cache on (record's default), a
# 60,000-token pool. One line per trace: its evicted tokens and steps, then the diff's verdict.
#   KVTRACE_SGLANG_PYTHON=.venv-sglang/bin/python bash tools/swa_parity_matrix.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
SG=${KVTRACE_SGLANG_PYTHON:?set KVTRACE_SGLANG_PYTHON to an interpreter with SGLang 0.5.23}
OUT=${1:-$(mktemp -d)}
mkdir -p "$OUT"
W=traces/workloads_data
declare -A WL=(
  [mooncake]="$W/mooncake-fast25/conversation_trace.jsonl --duration 12s"
  [azure]="$W/azure-llm-inference-2023/AzureLLMInferenceTrace_code.csv --duration 30s"
  [sharegpt]="$W/sharegpt-arxiv-lengths/sharegpt_8k_filtered_stats_llama2_tokenizer.csv --format lengths --rate 4 --duration 20s"
)
for wl in mooncake azure sharegpt; do for page in 1 16 64; do for spec in off eagle dflash; do
  for model in gpt-oss-20b gemma-3-27b; do
    t="$OUT/$wl-$page-$spec-$model.kvtrace"
    sp=(); [ "$spec" = eagle ] && sp=(--spec eagle:3,1,4); [ "$spec" = dflash ] && sp=(--spec dflash:1,1,8)
    # shellcheck disable=SC2086
    rec=$($PY -m kvtrace record ${WL[$wl]} --model "$model" --page-size "$page" --pool-tokens 60000 "${sp[@]}" \
          -o "$t" --force --json -q 2>&1 | tail -1)
    got=$(echo "$rec" | $PY -c 'import json,sys; d=json.loads(sys.stdin.read()); print(d["evicted_tokens"], d["steps"])' \
          2>/dev/null || echo "record failed: $rec")
    out=$($PY -m kvtrace diff "$t" --a "sglang:$SG" --b builtin --exact --json -q 2>&1)
    verdict=$(echo "$out" | $PY -c 'import json,sys; print("identical" if json.loads(sys.stdin.read())["identical"] else "DIVERGED")' \
              2>/dev/null || echo "diff failed: ${out: -300}")
    echo "$wl page=$page spec=$spec $model evicted,steps=$got -> $verdict"
  done
done; done; done
