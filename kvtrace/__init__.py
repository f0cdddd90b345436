"""kvtrace: record and replay the KV-cache allocator of LLM serving engines."""

from kvtrace._siblings import pin_siblings

__version__ = "0.1.0"

pin_siblings()  # 'import allocator' means this kvtrace's own, not one found first on sys.path
