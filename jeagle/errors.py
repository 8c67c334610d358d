"""The errors a user can cause (bad input), which the CLIs report as one line instead of a traceback.

The typed errors below are always input problems. A plain ValueError usually is too (argument and
shape validation across the package raise it), but JAX and NumPy raise it for internal bugs as well:
those lines carry a hint, and `JEAGLE_DEBUG=1` makes every CLI re-raise with the full traceback.
"""

from __future__ import annotations

import os
import sys

from jeagle.speculative.adaptive import AdaptiveConfigError
from jeagle.runtime.slots import OutOfSlots
from jeagle.loading.checkpoint import CheckpointError
from jeagle.config import ConfigError
from jeagle.runtime.requests import PromptTooLong
from jeagle.loading.fetch import FetchError

TYPED_USER_ERRORS = (CheckpointError, ConfigError, AdaptiveConfigError, PromptTooLong, OutOfSlots, FetchError,
                     FileNotFoundError)
USER_ERRORS = (*TYPED_USER_ERRORS, ValueError)
DEBUG_ENV = "JEAGLE_DEBUG"


def debugging() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def report(e: BaseException, typed: tuple[type[BaseException], ...] = TYPED_USER_ERRORS) -> int:
    """Print a user error as one line on stderr and return the CLI's exit status 2; with JEAGLE_DEBUG
    set, re-raise it instead (the traceback). `typed`: the error types that need no hint."""
    if debugging():
        raise e
    hint = "" if isinstance(e, typed) else f" (if this looks like a bug: rerun with {DEBUG_ENV}=1 for the traceback)"
    print(f"error: {e}{hint}", file=sys.stderr)
    return 2
