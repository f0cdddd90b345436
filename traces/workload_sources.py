"""Where a workload file comes from: the repository, licence and citation of the known
public traces (by file name), recorded in a trace's ``TraceSource``.
"""

from __future__ import annotations

from pathlib import Path

from traces.metadata import TraceSource

_MOONCAKE_CITATION = (
    'Qin et al., "Mooncake: Trading More Storage for Less Computation - A KVCache-centric '
    'Architecture for Serving LLM Chatbot", USENIX FAST 2025'
)
_AZURE_CITATION = (
    'Patel, Choukse, Zhang, Shah, Goiri, Maleki, Bianchini, "Splitwise: Efficient generative '
    'LLM inference using phase splitting", ISCA 2024'
)
_ETALON_CITATION = (
    "project-etalon/etalon (Georgia Tech Systems for AI Lab), processed ShareGPT / arXiv "
    "summarization length statistics (Llama-2 tokenizer)"
)

# Files whose origin is known: repository, path in it, licence, citation.
_KNOWN: dict[str, tuple[str, str, str, str]] = {
    "conversation_trace.jsonl": (
        "kvcache-ai/Mooncake", "FAST25-release/traces/conversation_trace.jsonl", "Apache-2.0", _MOONCAKE_CITATION
    ),
    "toolagent_trace.jsonl": (
        "kvcache-ai/Mooncake", "FAST25-release/traces/toolagent_trace.jsonl", "Apache-2.0", _MOONCAKE_CITATION
    ),
    "synthetic_trace.jsonl": (
        "kvcache-ai/Mooncake", "FAST25-release/traces/synthetic_trace.jsonl", "Apache-2.0", _MOONCAKE_CITATION
    ),
    "AzureLLMInferenceTrace_code.csv": (
        "Azure/AzurePublicDataset", "data/AzureLLMInferenceTrace_code.csv", "CC-BY-4.0", _AZURE_CITATION
    ),
    "AzureLLMInferenceTrace_conv.csv": (
        "Azure/AzurePublicDataset", "data/AzureLLMInferenceTrace_conv.csv", "CC-BY-4.0", _AZURE_CITATION
    ),
    "sharegpt_8k_filtered_stats_llama2_tokenizer.csv": (
        "project-etalon/etalon",
        "data/processed_traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
        "Apache-2.0",
        _ETALON_CITATION,
    ),
    "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv": (
        "project-etalon/etalon",
        "data/processed_traces/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
        "Apache-2.0",
        _ETALON_CITATION,
    ),
}


def known_source(path: str | Path, fmt: str, *, engine: str = "kvtrace-scheduler") -> TraceSource:
    """The ``TraceSource`` of a workload file: attribution when the file is a known
    public trace (by file name), else just the workload name."""
    name = Path(path).name
    known = _KNOWN.get(name)
    workload = f"{fmt}:{name}"
    if known is None:
        return TraceSource(engine=engine, workload=workload)
    repository, repo_path, license_, citation = known
    return TraceSource(
        engine=engine,
        workload=workload,
        repository=repository,
        path=repo_path,
        license=license_,
        citation=citation,
    )
