"""Errors that speak to the user.

Every error a user can cause is a `UserError`: its message is one line that
says what is wrong, where (file, key, tensor) and, where it helps, what to do.
The CLI prints it without a traceback and exits with `exit_code` (2 for bad
input). Anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input: printed as one line, exit code 2."""

    exit_code = 2

    def __init__(self, message: str):
        # One line, always: multi-line messages break the CLI contract.
        super().__init__(" ".join(str(message).split()))


class GGUFError(UserError):
    """A model file that cannot be used: corrupt, truncated or unsupported."""

    def __init__(self, path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class ConfigError(UserError):
    """A config key, flag or value that is not allowed."""


class PipelineError(UserError):
    """The pipeline could not finish a run: a process died, a read failed.
    One line like every user-facing error, but exit code 1: not bad input."""

    exit_code = 1
