"""A trace's metadata: the serving configuration, model shape and attention layout,
source and recording status it was made under (``TraceMeta``), stored as JSON under the
schema-metadata key ``kvtrace`` and checked field by field when read (bounds in
``traces.schema``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, Literal

from traces.hicache_layout import HostTier, host_tier_from_dict
from traces.mamba_layout import DEFAULT_MAMBA_FULL_MEMORY_RATIO, MAMBA_KINDS, MAX_STATE_BYTES, MambaLayout
from traces.namespaces import NamespaceTable
from traces.schema import MAX_BLOCK_SIZE, MAX_MODEL_DIM, MAX_SPEC_TOKENS, MAX_STEP, MAX_TOKENS

SpecAlgorithm = Literal["eagle", "eagle3", "standalone", "dflash"]


@dataclass(frozen=True, slots=True)
class SpecSettings:
    """Speculative-decoding settings of the recorded engine (EAGLE-style).

    ``num_steps`` draft steps of ``topk`` candidates; ``num_draft_tokens`` tokens
    verified per step. The allocator derives its per-request reserve from these.
    """

    algorithm: SpecAlgorithm = "eagle"
    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int = 4


@dataclass(frozen=True, slots=True)
class TraceConfig:
    """The serving configuration the trace was recorded under (replay may override some)."""

    page_size: int
    pool_tokens: int
    max_running: int
    max_context_len: int
    chunk_size: int | None = None
    schedule_policy: str = "fcfs"
    spec: SpecSettings | None = None
    pd_decode: bool = False
    hisparse: bool = False
    radix_cache: bool = True  # the engine kept a radix prefix cache
    eviction_policy: str = "lru"  # its eviction order (SGLang's --radix-eviction-policy)
    hicache: HostTier | None = None  # HiCache's host tier under the radix cache (None: none; version 5)
    sessions: bool = False  # streaming sessions: the trace may hold hold/close ops (version 6)


# Bytes per element of each KV-cache dtype a trace may name (``model.dtype``).
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "float8_e4m3fn": 1}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Model shape; ``bytes_per_token`` = 2 * layers * kv_heads * head_dim * dtype bytes (MHA).

    ``bytes_per_token`` counts every layer, which is the pool's cost per token of a
    full-attention model. A hybrid sliding-window model (``AttentionLayout``) keeps two
    pools; each pool's cost per token is the layout's (``full_bytes_per_token``,
    ``swa_bytes_per_token``), from ``layer_bytes_per_token``.
    """

    name: str = "unknown"
    num_layers: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.layer_bytes_per_token

    @property
    def layer_bytes_per_token(self) -> int:
        """K and V of one token in one layer: 2 * kv_heads * head_dim * dtype bytes."""
        return 2 * self.num_kv_heads * self.head_dim * DTYPE_BYTES.get(self.dtype, 2)


# SGLang's default SWA/full token ratio (``--swa-full-tokens-ratio``, server_args fallback).
DEFAULT_SWA_FULL_TOKENS_RATIO = 0.8


@dataclass(frozen=True, slots=True)
class AttentionLayout:
    """Which layers attend to the whole sequence and which to a sliding window, and the
    two KV pools SGLang 0.5.23 serves such a hybrid model with.

    SGLang (``HybridSWAPoolConfigurator`` in ``model_executor/pool_configurator.py``)
    keeps a full pool for the full-attention layers and an SWA pool for the
    sliding-window layers. The full pool is ``config.pool_tokens`` (its
    ``max_total_num_tokens``); the SWA pool is the full pool times
    ``swa_full_tokens_ratio``, rounded down to a page (``swa_pool_tokens_for``). A
    trace without a layout is a full-attention model (one pool).

    Attributes:
        full_layer_ids: the full-attention layers (``full_attention_layer_ids``), ascending.
        swa_layer_ids: the sliding-window layers (``swa_attention_layer_ids``), ascending;
            at least one.
        sliding_window: the window in tokens (``sliding_window_size``).
        swa_full_tokens_ratio: SWA pool tokens / full pool tokens, in (0, 1].
        swa_pool_tokens: the SWA pool the recording engine had, in tokens.
        swa_num_kv_heads: KV heads of a sliding-window layer (None: the model's).
        swa_head_dim: head dimension of a sliding-window layer (None: the model's).
        draft_sliding_window: tokens back that a fused draft reads in the SWA pool
            (SGLang's ``draft_swa_window``), 0 when none; the SWA history kept is the
            larger of it and ``sliding_window`` (``swa_retain_window``).
        release_prefill_swa: the engine ran with ``SGLANG_OPT_RELEASE_PREFILL_SWA`` (a
            request's prefix's SWA lock is released once it has decoded a window's
            worth of steps); written only when on.
    """

    full_layer_ids: tuple[int, ...]
    swa_layer_ids: tuple[int, ...]
    sliding_window: int
    swa_pool_tokens: int
    swa_full_tokens_ratio: float = DEFAULT_SWA_FULL_TOKENS_RATIO
    swa_num_kv_heads: int | None = None
    swa_head_dim: int | None = None
    draft_sliding_window: int = 0
    release_prefill_swa: bool = False

    def full_bytes_per_token(self, model: ModelShape) -> int:
        """Bytes of one token in the full pool: K and V in every full-attention layer."""
        return len(self.full_layer_ids) * model.layer_bytes_per_token

    def swa_bytes_per_token(self, model: ModelShape) -> int:
        """Bytes of one token in the SWA pool: K and V in every sliding-window layer."""
        heads = model.num_kv_heads if self.swa_num_kv_heads is None else self.swa_num_kv_heads
        dim = model.head_dim if self.swa_head_dim is None else self.swa_head_dim
        return len(self.swa_layer_ids) * 2 * heads * dim * DTYPE_BYTES.get(model.dtype, 2)

    def for_pool(self, full_pool_tokens: int, page_size: int) -> AttentionLayout:
        """This layout served with another full pool or page size: the SWA pool follows
        the ratio, as SGLang derives it (``swa_pool_tokens_for``)."""
        return replace(self, swa_pool_tokens=swa_pool_tokens_for(full_pool_tokens, page_size, self.swa_full_tokens_ratio))

    def layer_kinds(self, num_layers: int) -> str:
        """One letter per layer, ``F`` full, ``S`` sliding window, ``-`` neither."""
        full, swa = set(self.full_layer_ids), set(self.swa_layer_ids)
        return "".join("F" if i in full else "S" if i in swa else "-" for i in range(num_layers))


def swa_pool_tokens_for(full_pool_tokens: int, page_size: int, ratio: float) -> int:
    """The SWA pool SGLang derives from the full pool: ``int(full * ratio)`` rounded
    down to a page (``HybridSWAPoolConfigurator._solve_pool_sizes``).

    Args:
        full_pool_tokens: the full pool, in tokens (rounded down to a page first).
        page_size: tokens per page.
        ratio: ``swa_full_tokens_ratio``.
    """
    full = full_pool_tokens // page_size * page_size
    return int(full * ratio) // page_size * page_size


def split_kv_bytes(
    kv_bytes: int, model: ModelShape, full_layer_ids: tuple[int, ...], swa_layer_ids: tuple[int, ...],
    page_size: int, ratio: float = DEFAULT_SWA_FULL_TOKENS_RATIO,
) -> tuple[int, int]:
    """Full and SWA pool sizes in tokens SGLang makes of ``kv_bytes`` of KV memory.

    Each full-pool token costs the full layers' bytes and brings ``ratio`` SWA tokens
    that cost the SWA layers' bytes (``_recompute_cell_size``), so the full pool is
    ``kv_bytes // (full + ratio * swa)`` tokens, rounded down to a page, and the SWA
    pool follows from it (``swa_pool_tokens_for``). Sliding-window layers are taken to
    have the model's KV heads and head dim; draft-model layers are not counted.

    Returns:
        ``(full_pool_tokens, swa_pool_tokens)``.
    """
    full_bytes = len(full_layer_ids) * model.layer_bytes_per_token
    swa_bytes = len(swa_layer_ids) * model.layer_bytes_per_token
    if not full_layer_ids:  # all-SWA: one pool, the ratio does not apply
        swa = int(kv_bytes // swa_bytes) // page_size * page_size
        return 0, swa
    full = int(kv_bytes // (full_bytes + ratio * swa_bytes)) // page_size * page_size
    return full, swa_pool_tokens_for(full, page_size, ratio)


@dataclass(frozen=True, slots=True)
class TraceSource:
    """Where the trace comes from: engine, workload, and the data's licence and citation."""

    engine: str = "unknown"
    workload: str = "unknown"
    repository: str | None = None
    path: str | None = None
    license: str | None = None
    citation: str | None = None


RecordingStatus = Literal["recording", "complete", "interrupted"]
RECORDING_STATUSES: tuple[str, ...] = ("recording", "complete", "interrupted")


def timestamp() -> str:
    """Now in UTC, ISO 8601 to the second (``2025-06-01T12:00:00Z``).

    ``SOURCE_DATE_EPOCH`` (the reproducible-builds convention), when set, is used
    instead of the clock, so a regenerated file can match byte for byte.
    """
    fixed = os.environ.get("SOURCE_DATE_EPOCH")
    when = datetime.fromtimestamp(int(fixed), timezone.utc) if fixed else datetime.now(timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True, slots=True)
class Recording:
    """How a trace was made and whether its recording completed.

    The writer stores ``status="recording"`` when the recording starts and the final
    status when it closes: ``"complete"``, or ``"interrupted"`` with ``detail`` saying
    why (Ctrl-C, a signal, an error). A trace whose writer never closed (a killed
    process) still says ``"recording"`` and reads as interrupted
    (``TraceReader.recording`` after a full iteration).

    Attributes:
        status: ``recording``, ``complete`` or ``interrupted``.
        detail: why an interrupted recording stopped (None otherwise).
        kvtrace_version: the kvtrace that wrote the trace.
        command: the command line that made it, shell-quoted (None from a library call).
        finished_at: when the writer closed (UTC, ISO 8601).
        steps: steps written when the writer closed.
    """

    status: RecordingStatus = "recording"
    detail: str | None = None
    kvtrace_version: str | None = None
    command: str | None = None
    finished_at: str | None = None
    steps: int | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Any) -> Recording:
        """Build from parsed JSON. Raises ``ValueError`` naming the bad key."""
        if not isinstance(data, dict):
            raise ValueError("'recording' is not a JSON object")
        status = data.get("status")
        if status not in RECORDING_STATUSES:
            raise ValueError(f"'recording.status' must be one of {', '.join(RECORDING_STATUSES)}, found {status!r}")
        for key in ("detail", "kvtrace_version", "command", "finished_at"):
            value = data.get(key)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"'recording.{key}' must be a string, found {_found(value)}")
        steps = data.get("steps")
        if steps is not None and not (_is_int(steps) and 0 <= steps < MAX_STEP):
            raise ValueError(f"'recording.steps' must be an integer in [0, 2**53), found {_found(steps)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"'recording' has an unexpected key: {exc}") from None

    @property
    def interrupted(self) -> bool:
        """The recording did not complete (or, read before its end, has not yet)."""
        return self.status != "complete"


@dataclass(frozen=True, slots=True)
class TraceMeta:
    """Everything in the schema metadata. ``to_json``/``from_json`` are the wire format."""

    config: TraceConfig
    source: TraceSource = field(default_factory=TraceSource)
    model: ModelShape = field(default_factory=ModelShape)
    block_size: int | None = None
    format_version: int = None  # type: ignore[assignment]  # None: the lowest that holds it (written_version)
    created_at: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    recording: Recording | None = None  # None: not recorded (a library write, or an older trace)
    attention: AttentionLayout | None = None  # None: every layer full attention (every v1 trace)
    mamba: MambaLayout | None = None  # None: no linear-attention layer (every v1 and v2 trace)
    namespaces: NamespaceTable | None = None  # None: no request has a cache namespace (v1 to v3)

    def __post_init__(self) -> None:
        # Never below the version that holds this metadata (a layout added by ``replace``).
        if self.format_version is None or self.format_version < self.written_version:
            object.__setattr__(self, "format_version", self.written_version)

    def with_config(self, **changes: Any) -> TraceMeta:
        return replace(self, config=replace(self.config, **changes))

    @property
    def written_version(self) -> int:
        """The lowest format version that holds this metadata, which a new trace is written
        as: a full-attention trace stays readable by readers of version 1, an SWA one by
        readers of version 2, a Mamba one by readers of version 3."""
        if self.config.sessions:
            return 6
        if self.config.hicache is not None or self.config.eviction_policy != "lru":
            return 5
        if self.namespaces is not None:
            return 4
        if self.mamba is not None:
            return 3
        return 1 if self.attention is None else 2

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["model"]["bytes_per_token"] = self.model.bytes_per_token
        if self.config.eviction_policy == "lru":
            del out["config"]["eviction_policy"]  # the default: metadata as before policies existed
        if self.config.hicache is None:
            del out["config"]["hicache"]  # no host tier: as versions 1 to 4 wrote it
        if not self.config.sessions:
            del out["config"]["sessions"]  # the default: metadata as before sessions existed
        if self.recording is None:
            del out["recording"]  # what traces written without it have always held
        if self.attention is None:
            del out["attention"]  # a full-attention model: as version 1 wrote it
        else:
            out["attention"]["full_layer_ids"] = list(self.attention.full_layer_ids)
            out["attention"]["swa_layer_ids"] = list(self.attention.swa_layer_ids)
            if not self.attention.draft_sliding_window:
                del out["attention"]["draft_sliding_window"]  # no draft window: as before the field
            if not self.attention.release_prefill_swa:
                del out["attention"]["release_prefill_swa"]  # off (SGLang's default): as before the field
        if self.mamba is None:
            del out["mamba"]  # no linear-attention layer: as versions 1 and 2 wrote it
        else:
            out["mamba"]["full_layer_ids"] = list(self.mamba.full_layer_ids)
            out["mamba"]["mamba_layer_ids"] = list(self.mamba.mamba_layer_ids)
        if self.namespaces is None:
            del out["namespaces"]  # no namespaced request: as versions 1 to 3 wrote it
        else:
            out["namespaces"] = self.namespaces.to_dict()
        return out

    def to_json(self) -> str:
        """Strict JSON (a NaN or infinite number in ``extra`` is a ValueError): what readers accept."""
        return json.dumps(self.to_dict(), sort_keys=True, allow_nan=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TraceMeta:
        """Build from parsed JSON, checking every field's type and bounds.

        Raises:
            ValueError: naming the missing or bad key, what it must be and what was found.
        """
        if not isinstance(data, dict):
            raise ValueError("metadata is not a JSON object")
        version = data.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError("metadata has no integer 'format_version'")
        cfg = data.get("config")
        if not isinstance(cfg, dict):
            raise ValueError("metadata has no 'config' object")
        for key in ("page_size", "pool_tokens", "max_running", "max_context_len"):
            if not _is_int(cfg.get(key)):
                raise ValueError(f"metadata 'config.{key}' is missing or not an integer")
            if cfg[key] <= 0:
                raise ValueError(f"metadata 'config.{key}' must be positive, found {cfg[key]}")
            _int_in(cfg, key, "config.", 1, MAX_TOKENS)
        spec = _optional_object(cfg, "spec", "config.")
        config = TraceConfig(
            page_size=cfg["page_size"],
            pool_tokens=cfg["pool_tokens"],
            max_running=cfg["max_running"],
            max_context_len=cfg["max_context_len"],
            chunk_size=_int_in(cfg, "chunk_size", "config.", 1, MAX_TOKENS, None),
            schedule_policy=_str_of(cfg, "schedule_policy", "config.", "fcfs"),
            spec=None if spec is None else _spec_settings(spec),
            pd_decode=_bool_of(cfg, "pd_decode", "config.", False),
            hisparse=_bool_of(cfg, "hisparse", "config.", False),
            radix_cache=_bool_of(cfg, "radix_cache", "config.", True),
            eviction_policy=_str_of(cfg, "eviction_policy", "config.", "lru"),
            hicache=_host_tier(cfg, version),
            sessions=_bool_of(cfg, "sessions", "config.", False),
        )
        if config.sessions and version < 6:
            raise ValueError(f"metadata has 'config.sessions', which format version {version} does not have (6 and later)")
        model = dict(_optional_object(data, "model", "") or {})
        model.pop("bytes_per_token", None)
        source = _optional_object(data, "source", "") or {}
        _known_keys(model, ModelShape, "model.")
        _known_keys(source, TraceSource, "source.")
        for key in ("num_layers", "num_kv_heads", "head_dim"):
            _int_in(model, key, "model.", 1, MAX_MODEL_DIM, None)
        for key in ("name", "dtype"):
            _str_of(model, key, "model.", None)
        if model.get("dtype") is not None and model["dtype"] not in DTYPE_BYTES:
            raise ValueError(
                f"metadata 'model.dtype' {model['dtype']!r} is not a known KV-cache dtype "
                f"(valid: {', '.join(DTYPE_BYTES)})"
            )
        model = {key: value for key, value in model.items() if value is not None}  # null: the default shape's
        for key in source:
            _str_of(source, key, "source.", None)
        recording = data.get("recording")
        attention = _optional_object(data, "attention", "")
        if attention is not None and version < 2:
            raise ValueError(f"metadata has 'attention', which format version {version} does not have (2 and later)")
        mamba = _optional_object(data, "mamba", "")
        if mamba is not None and version < 3:
            raise ValueError(f"metadata has 'mamba', which format version {version} does not have (3 and later)")
        namespaces = data.get("namespaces")
        if namespaces is not None and version < 4:
            raise ValueError(f"metadata has 'namespaces', which format version {version} does not have (4 and later)")
        shape = ModelShape(**model)
        return cls(
            config=config,
            source=TraceSource(**source),
            model=shape,
            block_size=_int_in(data, "block_size", "", 1, MAX_BLOCK_SIZE, None),
            format_version=version,
            created_at=_str_of(data, "created_at", "", None),
            extra=dict(_optional_object(data, "extra", "") or {}),
            recording=None if recording is None else Recording.from_dict(recording),
            attention=None if attention is None else _attention_layout(attention, shape, config.page_size),
            mamba=None if mamba is None else _mamba_layout(mamba, shape),
            namespaces=None if namespaces is None else NamespaceTable.from_dict(namespaces),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> TraceMeta:
        return cls.from_dict(parse_meta_json(text))


def parse_meta_json(text: str | bytes) -> Any:
    """JSON text as Python objects; bad UTF-8, bad JSON, absurd nesting or numbers are a ValueError."""
    try:
        return json.loads(text, parse_constant=_not_json)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, digit limits
        detail = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ValueError(f"metadata is not valid JSON ({detail})") from None


def _not_json(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _found(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _int_in(obj: dict[str, Any], key: str, where: str, lo: int, hi: int, default: Any = ...) -> Any:
    """``obj[key]`` as an integer in ``[lo, hi]``; ``default`` when absent or null (``...``: required)."""
    value = obj.get(key)
    if value is None and default is not ...:
        return default
    if not _is_int(value) or not lo <= value <= hi:
        raise ValueError(f"metadata '{where}{key}' must be an integer in [{lo}, {hi}], found {_found(value)}")
    return value


def _bool_of(obj: dict[str, Any], key: str, where: str, default: bool) -> bool:
    value = obj.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"metadata '{where}{key}' must be true or false, found {_found(value)}")
    return value


def _str_of(obj: dict[str, Any], key: str, where: str, default: str | None) -> Any:
    value = obj.get(key, default)
    if value is None and default is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"metadata '{where}{key}' must be a string, found {_found(value)}")
    return value


def _optional_object(obj: dict[str, Any], key: str, where: str) -> dict[str, Any] | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"metadata '{where}{key}' must be an object or null, found {_found(value)}")
    return value


def _known_keys(obj: dict[str, Any], record: type, where: str) -> None:
    unknown = sorted(set(obj) - set(record.__dataclass_fields__))  # type: ignore[attr-defined]
    if unknown:
        raise ValueError(f"metadata has an unexpected key {_found(where + unknown[0])}")  # repr: one line


def _spec_settings(spec: dict[str, Any]) -> SpecSettings:
    _known_keys(spec, SpecSettings, "config.spec.")
    algorithm = spec.get("algorithm", "eagle")
    valid = SpecAlgorithm.__args__  # type: ignore[attr-defined]
    if algorithm not in valid:
        raise ValueError(
            f"metadata 'config.spec.algorithm' must be one of {', '.join(valid)}, found {_found(algorithm)}"
        )
    defaults = SpecSettings()
    return SpecSettings(
        algorithm=algorithm,
        num_steps=_int_in(spec, "num_steps", "config.spec.", 1, MAX_SPEC_TOKENS, defaults.num_steps),
        topk=_int_in(spec, "topk", "config.spec.", 1, MAX_SPEC_TOKENS, defaults.topk),
        num_draft_tokens=_int_in(
            spec, "num_draft_tokens", "config.spec.", 1, MAX_SPEC_TOKENS, defaults.num_draft_tokens
        ),
    )


def _layer_ids(obj: dict[str, Any], key: str, num_layers: int, where: str = "attention") -> tuple[int, ...]:
    value = obj.get(key)
    if not isinstance(value, list) or not all(_is_int(i) and 0 <= i < num_layers for i in value):
        raise ValueError(
            f"metadata '{where}.{key}' must be a list of layer ids in [0, {num_layers}) "
            f"(model.num_layers {num_layers}), found {_found(value)}"
        )
    if len(set(value)) != len(value) or value != sorted(value):
        raise ValueError(f"metadata '{where}.{key}' must be ascending without repeats, found {_found(value)}")
    return tuple(value)


def _attention_layout(obj: dict[str, Any], model: ModelShape, page_size: int) -> AttentionLayout:
    """The ``attention`` object, checked against the model's layers."""
    _known_keys(obj, AttentionLayout, "attention.")
    full = _layer_ids(obj, "full_layer_ids", model.num_layers)
    swa = _layer_ids(obj, "swa_layer_ids", model.num_layers)
    if not swa:
        raise ValueError("metadata 'attention.swa_layer_ids' is empty; a full-attention model has no 'attention'")
    both = sorted(set(full) & set(swa))
    if both:
        raise ValueError(f"metadata 'attention': layer {both[0]} is in both full_layer_ids and swa_layer_ids")
    ratio = obj.get("swa_full_tokens_ratio", DEFAULT_SWA_FULL_TOKENS_RATIO)
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 < ratio <= 1:
        raise ValueError(f"metadata 'attention.swa_full_tokens_ratio' must be a number in (0, 1], found {_found(ratio)}")
    return AttentionLayout(
        full_layer_ids=full,
        swa_layer_ids=swa,
        sliding_window=_int_in(obj, "sliding_window", "attention.", 1, MAX_TOKENS),
        swa_pool_tokens=_int_in(obj, "swa_pool_tokens", "attention.", page_size, MAX_TOKENS),
        swa_full_tokens_ratio=float(ratio),
        swa_num_kv_heads=_int_in(obj, "swa_num_kv_heads", "attention.", 1, MAX_MODEL_DIM, None),
        swa_head_dim=_int_in(obj, "swa_head_dim", "attention.", 1, MAX_MODEL_DIM, None),
        draft_sliding_window=_int_in(obj, "draft_sliding_window", "attention.", 0, MAX_TOKENS, 0),
        release_prefill_swa=_bool_of(obj, "release_prefill_swa", "attention.", False),
    )


def _host_tier(cfg: dict[str, Any], version: int) -> HostTier | None:
    """``config.hicache``, which only version 5 and later hold."""
    obj = cfg.get("hicache")
    if obj is None:
        return None
    if version < 5:
        raise ValueError(f"metadata has 'config.hicache', which format version {version} does not have (5 and later)")
    return host_tier_from_dict(obj, cfg["page_size"])


def _mamba_layout(obj: dict[str, Any], model: ModelShape) -> MambaLayout:
    """The ``mamba`` object, checked against the model's layers."""
    _known_keys(obj, MambaLayout, "mamba.")
    full = _layer_ids(obj, "full_layer_ids", model.num_layers, "mamba")
    linear = _layer_ids(obj, "mamba_layer_ids", model.num_layers, "mamba")
    if not linear:
        raise ValueError("metadata 'mamba.mamba_layer_ids' is empty; a model without linear layers has no 'mamba'")
    both = sorted(set(full) & set(linear))
    if both:
        raise ValueError(f"metadata 'mamba': layer {both[0]} is in both full_layer_ids and mamba_layer_ids")
    ratio = obj.get("mamba_full_memory_ratio", DEFAULT_MAMBA_FULL_MEMORY_RATIO)
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 < ratio < 1e6:
        raise ValueError(f"metadata 'mamba.mamba_full_memory_ratio' must be a positive number below 1e6, found {_found(ratio)}")
    kind = obj.get("kind", "gdn")
    if kind not in MAMBA_KINDS:
        raise ValueError(f"metadata 'mamba.kind' must be one of {', '.join(MAMBA_KINDS)}, found {_found(kind)}")
    return MambaLayout(
        full_layer_ids=full,
        mamba_layer_ids=linear,
        conv_state_bytes=_int_in(obj, "conv_state_bytes", "mamba.", 0, MAX_STATE_BYTES),
        temporal_state_bytes=_int_in(obj, "temporal_state_bytes", "mamba.", 1, MAX_STATE_BYTES),
        mamba_cache_size=_int_in(obj, "mamba_cache_size", "mamba.", 1, MAX_TOKENS),
        mamba_full_memory_ratio=float(ratio),
        kind=kind,
    )
