"""What a user got wrong: `pdd` says it in one line and exits 2.

Every sub-command raises `Mistake` (or one of its kinds: a config file's `ConfigError`,
a model's `ModelNotFound` or `UnsupportedCheckpoint`) for a mistake in what it was
given; `pdd.cli.main` prints `pdd COMMAND: what` to standard error, without a
traceback, and exits 2, as argparse does for a flag it cannot parse. Anything else that
escapes is a bug, and keeps its traceback.
"""

from __future__ import annotations


class Mistake(Exception):
    """A mistake in what the user gave: a file, a table or key in it, a name, a flag, a port, a model."""


class ModelNotFound(Mistake, FileNotFoundError):
    """No model where the user said (or no Hugging Face model directory there)."""
