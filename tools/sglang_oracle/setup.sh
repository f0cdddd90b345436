#!/usr/bin/env bash
# Create (or complete) a Python 3.11 virtual environment holding SGLang 0.5.23 on a
# CPU-only torch: the environment of the kvtrace versions `sglang:PYTHON`
# (kvtrace/sglang/driver.py) and of the SGLang parity tests (tests/differential/).
#
# Usage: tools/sglang_oracle/setup.sh [TARGET_DIR [WHEEL]]
#   TARGET_DIR          venv to create; default: .venv-sglang at the repository root.
#   WHEEL               the sglang 0.5.23 wheel (else $SGLANG_WHEEL, see below).
# Environment:
#   SGLANG_WHEEL        path to sglang-0.5.23-*.whl; without it the script looks for
#                       one next to the repository and in its wheel cache, else runs
#                       `pip download --no-deps sglang==0.5.23` into that cache.
#   KVTRACE_CACHE_DIR   where pip's cache and the downloaded wheel are kept (default:
#                       .cache/ at the repository root, an ignored path; CI keeps it).
#   TORCH_INDEX_URL     extra index for torch (e.g. the CPU wheel index), optional.
#   PYTHON              interpreter for the venv (default: python3.11, else python3).
#
# Idempotent: every step checks whether it is already done. torchvision is never
# installed (its dependency pulls a CUDA torch); the SGLang modules that import it
# are stubbed at run time by kvtrace/sglang/world.py. pyarrow is installed so that
# the live recorder (kvtrace.sglang.hooks) can write traces from inside SGLang.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TARGET="${1:-$ROOT/.venv-sglang}"
SGLANG_VERSION="0.5.23"
TORCH_VERSION="2.13.0"
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
CACHE="${KVTRACE_CACHE_DIR:-$ROOT/.cache}"
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$CACHE/pip}"

"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
  || { echo "setup.sh: SGLang's cp311 wheel needs Python 3.11; set PYTHON=/path/to/python3.11" >&2; exit 2; }

if [ ! -x "$TARGET/bin/python" ]; then
  echo "setup.sh: creating venv $TARGET"
  "$PY" -m venv "$TARGET"
fi
TARGET="$(cd "$TARGET" && pwd)"
VPY="$TARGET/bin/python"
PIP=("$VPY" -m pip install --disable-pip-version-check -q)

have() { "$VPY" - "$@" <<'PYEOF'
import importlib.metadata as m, sys
name, want = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None
try:
    got = m.version(name)
except m.PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if want is None or got.split("+")[0] == want else 1)
PYEOF
}

if ! have torch "$TORCH_VERSION"; then
  echo "setup.sh: installing torch==$TORCH_VERSION (CPU)"
  # A CPU build is expected where pip finds one (a local wheel directory, or
  # TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu where that index is reachable).
  "${PIP[@]}" "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"}
fi

if ! have sglang "$SGLANG_VERSION"; then
  WHEEL="${2:-${SGLANG_WHEEL:-}}"
  if [ -z "$WHEEL" ]; then
    for cand in "$ROOT"/../sglang-"$SGLANG_VERSION"-*.whl "$ROOT"/sglang-"$SGLANG_VERSION"-*.whl "$CACHE"/wheels/sglang-"$SGLANG_VERSION"-*.whl; do
      if [ -f "$cand" ]; then WHEEL="$cand"; break; fi
    done
  fi
  if [ -z "$WHEEL" ]; then
    mkdir -p "$CACHE/wheels"
    echo "setup.sh: downloading sglang==$SGLANG_VERSION into $CACHE/wheels"
    "$VPY" -m pip download -q --no-deps "sglang==$SGLANG_VERSION" -d "$CACHE/wheels"
    WHEEL="$(ls "$CACHE"/wheels/sglang-"$SGLANG_VERSION"-*.whl | head -1)"
  fi
  echo "setup.sh: installing $WHEEL (no dependencies: they pin a CUDA torch)"
  "${PIP[@]}" --no-deps "$WHEEL"
fi

# SGLang's import-time dependencies on the allocator / radix cache / Req path.
# Versions pinned where a newer release broke the import chain; torch stays CPU.
# einops: disaggregation/decode.py (alloc_for_decode_prealloc) imports it.
# pyarrow: the live recorder writes kvtrace traces (kvtrace itself is put on sys.path).
DEPS=(numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec pydantic
      pyzmq tqdm IPython aiohttp dill gguf partial_json_parser "transformers==5.19.0"
      "openai==2.8.0" "compressed-tensors==0.18.0" "sentencepiece==0.2.1" "apache-tvm-ffi==0.1.11"
      einops "pyarrow>=15")
# The marker records the dependency list it was made with, so a changed list reinstalls.
MARKER="$TARGET/.kvtrace-sglang-deps"
if [ "$(cat "$MARKER" 2>/dev/null)" != "${DEPS[*]}" ]; then
  echo "setup.sh: installing SGLang's import dependencies"
  "${PIP[@]}" "${DEPS[@]}" "torch==$TORCH_VERSION"
  printf '%s' "${DEPS[*]}" > "$MARKER"
fi

if "$VPY" -c 'import torchvision' 2>/dev/null; then
  echo "setup.sh: torchvision is installed in $TARGET; remove it (pip uninstall torchvision): it replaces the CPU torch" >&2
  exit 1
fi
"$VPY" -c "import torch, sglang, importlib.metadata as m; print('setup.sh: ok:', 'torch', torch.__version__, 'sglang', m.version('sglang'))"
echo "setup.sh: use it with KVTRACE_SGLANG_PYTHON=$TARGET/bin/python"
