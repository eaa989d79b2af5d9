"""pyproject.toml's lower bounds as exact pins, one per line, for the floor lane of ``.ci/versions``: first the Python
(``python3.10`` from ``requires-python``), then each runtime dependency and the embedded model's extra (``gguf``) at
its ``>=`` bound.  One list, so a raised floor is the one tested."""

from __future__ import annotations

import re
import sys
from pathlib import Path


def floor_pins(text: str) -> list[str]:
    """``[python3.X, name==bound, ...]`` from the text of pyproject.toml."""
    python = re.search(r'^requires-python = ">=(\d+\.\d+)"$', text, re.M)[1]
    deps = text[text.index("dependencies = ["):]
    deps = deps[: deps.index("]\n")]
    extra = re.search(r"^smollm2 = \[(.*)\]$", text, re.M)[1]
    return [f"python{python}"] + [f"{name}=={bound}" for name, bound in
                                  re.findall(r'"([\w.-]+(?:\[\w+\])?)>=([\d.]+)"', deps + extra)]


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent
    print("\n".join(floor_pins((root / "pyproject.toml").read_text())))
