"""kvtrace: record and replay the KV-cache allocator of LLM serving engines."""

__version__ = "0.1.0"
