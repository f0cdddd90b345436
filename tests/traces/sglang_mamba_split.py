"""Run under SGLang 0.5.23's interpreter ($KVTRACE_SGLANG_PYTHON), never imported by
kvtrace: SGLang's own split of a memory budget between Mamba slots and the KV pool for
Qwen3-Next or Nemotron-H (``mamba2_cache_params`` of ``Qwen3NextConfig`` / ``NemotronHConfig``,
``KVCacheConfigurator._handle_max_mamba_cache``, ``DefaultPoolConfigurator.calculate_pool_sizes``,
``resolve_max_num_reqs``), as one JSON line. Argument: a JSON object with ``ratio``,
``max_running`` (or null), ``radix_cache``, ``page_size``, ``context_len``, ``rest_bytes``
and optionally ``model`` (``qwen3-next``, the default, or ``nemotron-h``), ``draft_tokens`` (EAGLE with that many draft tokens per step)
and ``strategy`` (``--mamba-radix-cache-strategy``, then without the overlap scheduler).

The configurator is built bare (``object.__new__``) with the attributes those methods
read for one GPU, no fused draft state and no ReplaySSM; the modules that import
torchvision are stubbed (as ``kvtrace/sglang/world.py`` does): nothing here uses them.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import logging
import sys
import types
import warnings
STUBS = {"sglang.srt.multimodal.internvl_utils", "sglang.srt.configs.deepseek_ocr"}


class _Dummy(types.ModuleType):
    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        cls = type(name, (), {"model_type": f"stub_{name.lower()}"})
        setattr(self, name, cls)
        return cls


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        return importlib.machinery.ModuleSpec(fullname, self) if fullname in STUBS else None

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        return _Dummy(spec.name)

    def exec_module(self, module):  # type: ignore[no-untyped-def]
        return None


sys.meta_path.insert(0, _Finder())
warnings.filterwarnings("ignore")
logging.disable(logging.CRITICAL)
from types import SimpleNamespace
from sglang.srt.runtime_context import get_context, get_schedule
from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator
from sglang.srt.configs.nemotron_h import NemotronHConfig
from sglang.srt.configs.qwen3_next import Qwen3NextConfig

case = json.loads(sys.argv[1])
ov = get_context().override_server_args(
    mamba_full_memory_ratio=case["ratio"], max_running_requests=case["max_running"],
    disable_radix_cache=not case["radix_cache"], page_size=case["page_size"], device="cpu",
    **({} if case.get("strategy") is None else {
        "mamba_radix_cache_strategy": case["strategy"], "disable_overlap_schedule": True,
    }),
    **({} if case.get("draft_tokens") is None else {
        "speculative_algorithm": "EAGLE", "speculative_num_draft_tokens": case["draft_tokens"],
        "speculative_num_steps": case["draft_tokens"] - 1, "speculative_eagle_topk": 1,
    }),
)
ov.install()
if case.get("model", "qwen3-next") == "qwen3-next":
    hf = Qwen3NextConfig(full_attention_interval=4)  # Qwen3-Next-80B-A3B's interval
else:  # Nemotron-H 8B: the class defaults, and the n_groups its config.json sets
    hf = NemotronHConfig(n_groups=8)
params = hf.mamba2_cache_params


class _Kvc(KVCacheConfigurator):
    def fused_entry_bytes(self, sub_pool_name):
        return None  # no fused draft: no speculative decoding


kvc = object.__new__(_Kvc)
kvc.mambaish_config = hf
kvc.hybrid_gdn_config = hf if isinstance(hf, Qwen3NextConfig) else None
kvc.hybrid_kda_config = None
kvc.pp_size = 1
kvc.attn_dp_size = 1
kvc.extra_mamba_cache_bytes_per_req = 0
kvc.spec_algorithm = SimpleNamespace(is_none=lambda: case.get("draft_tokens") is None)
kvc.model_config = SimpleNamespace(context_len=case["context_len"])
rest = kvc._handle_max_mamba_cache(case["rest_bytes"] / (1 << 30))
pool = object.__new__(DefaultPoolConfigurator)
pool._cell_size = 2 * hf.num_key_value_heads * hf.head_dim * 2 * len(hf.full_attention_layer_ids)  # K+V, bf16
pool._fixed_overhead_bytes = 0
pool._zero_kv_max_tokens = 0
tokens = pool.calculate_pool_sizes(int(rest * (1 << 30)), case["page_size"]).max_total_num_tokens
rows = kvc.resolve_max_num_reqs(tokens)
print(json.dumps({"state_bytes": params.mamba_cache_per_req, "cell": pool._cell_size,
                  "full": hf.full_attention_layer_ids, "mamba": params.layers,
                  "slots": get_schedule().max_mamba_cache_size, "tokens": tokens, "rows": rows}))
