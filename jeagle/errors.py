"""The errors a user can cause (bad input), which the CLIs report as one line instead of a traceback."""

from jeagle.cache import OutOfSlots
from jeagle.checkpoint import CheckpointError
from jeagle.config import ConfigError
from jeagle.engine import PromptTooLong
from jeagle.fetch import FetchError

USER_ERRORS = (CheckpointError, ConfigError, PromptTooLong, OutOfSlots, FetchError, FileNotFoundError, ValueError)
