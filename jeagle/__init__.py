"""jeagle: lossless EAGLE speculative decoding in JAX."""

__version__ = "0.1.0"


def git_commit() -> str:
    """The code's commit, as runs record it: JEAGLE_COMMIT where set (a GPU runner gets a copy of the tree
    without .git), else git's short HEAD of this checkout, else "unknown"."""
    import os
    import subprocess
    from pathlib import Path

    if os.environ.get("JEAGLE_COMMIT"):
        return os.environ["JEAGLE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
