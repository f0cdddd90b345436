"""SGLang inside kvtrace: SGLang's own allocator as a version, and a recorder for a live SGLang.

* ``kvtrace.versions.sglang``: the versions ``sglang`` (the sglang this interpreter
  imports) and ``sglang:PYTHON`` (another environment's interpreter): a child process
  runs ``driver.py`` there, which drives SGLang's real ``ReqToTokenPool``, token /
  paged allocators, radix cache, ``Req`` and allocation / release functions
  (``world.py``) and answers the ``Allocator`` protocol of ``allocator.base``
  (``server.py``) over a pipe (``wire.py``);
* ``kvtrace.sglang.hooks`` / ``kvtrace.sglang.launch``: record a live SGLang's
  allocation and release calls into a trace (``kvtrace.record.recorder.Recorder``).

The modules run by the driver (``driver``, ``world``, ``server``, ``scenario``,
``wire``) import only the standard library, numpy, torch and sglang, so any
interpreter with sglang runs them by path, without kvtrace installed. This file
imports the standard library only, for the same reason.
"""

from __future__ import annotations

# The SGLang releases whose allocation path the driver knows (emulation decisions of
# ``world.py`` checked against them by the differential tests).
KNOWN_SGLANG_VERSIONS: tuple[str, ...] = ("0.5.23",)
