"""``python -m traces.samples [NAME ...]``: rewrite bundled samples from their recipes."""

from __future__ import annotations

import sys

from traces.samples import RECIPES, regenerate


def main(argv: list[str]) -> int:
    names = argv or sorted(RECIPES)
    for name in names:
        print(regenerate(name))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
