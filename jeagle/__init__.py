"""jeagle: lossless EAGLE speculative decoding in JAX."""

import os as _os

__version__ = "0.1.0"

# The top-level `kernels/` folder is the subpackage `jeagle.kernels` (see pyproject.toml). An install
# maps it; a plain source checkout (PYTHONPATH=repo) gets the same mapping here, never a top-level
# `kernels` import that an unrelated PyPI distribution could shadow.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isfile(
        _os.path.join(_root, "kernels", "__init__.py")):
    __path__.append(_root)  # noqa: F821  (the package's own search path)
