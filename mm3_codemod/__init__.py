"""``python -m mm3_codemod``: the mm3-codemod command line, for environments where the
console script is not on PATH. The code lives in ``rewriter`` and ``codemods``."""

from rewriter import __version__

__all__ = ["__version__"]
