"""Allocator versions: a spec string (``builtin``, ``module:``, ``git:REV``, ``worktree``,
``sglang``...) -> how that version's allocator is built and where it runs.

``registry`` resolves specs and holds the built-in and in-process versions; ``git``
checks ``git:REV`` / ``worktree`` allocator packages out into a cache; ``sglang``
resolves the SGLang versions (SGLang's real allocator driven in another interpreter).
Importing this package imports none of them.
"""
