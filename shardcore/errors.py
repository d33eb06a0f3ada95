"""One error hierarchy: every failure shardcore reports on purpose is a ``ShardcoreError``.

Messages name the offending key, the value that was given and the fix, so that a user can act on
the message alone.
"""

from __future__ import annotations

import difflib
from typing import Iterable

#: every message starts with it, so a user can tell shardcore's refusals from a library's failures
PREFIX = "shardcore"


class ShardcoreError(Exception):
    """Base class of every error shardcore raises on purpose. The message starts with ``shardcore``
    (a more precise ``shardcore.save:``, ``shardcore config key 'x':`` ... where the raiser gives one,
    ``shardcore:`` otherwise)."""

    def __init__(self, *args: object):
        if args and isinstance(args[0], str) and not args[0].startswith(PREFIX):
            args = (f"{PREFIX}: {args[0]}", *args[1:])
        super().__init__(*args)


class ShardConfigError(ShardcoreError, ValueError):
    """A config key has a bad name, type or value, or keys conflict.

    ``key`` is the offending key (dotted for nested settings) so callers and tests can tell which
    key was at fault without parsing the message.
    """

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"shardcore config key {key!r}: {message}")


class UnknownKeyError(ShardConfigError):
    """A key that no config source or backend knows."""

    def __init__(self, key: str, known: Iterable[str], where: str = "config"):
        known = sorted(set(known))
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        super().__init__(
            key,
            f"unknown key in {where}.{hint} Known keys: {', '.join(known)}.",
        )


class UnsupportedKeyError(ShardConfigError):
    """A valid key that the selected backend cannot honour."""


class WrapPlanError(ShardcoreError, ValueError):
    """The model and the wrap settings cannot give a sharding plan."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"shardcore wrap plan ({key}): {message}")


class BackendUnavailableError(ShardcoreError, RuntimeError):
    """The backend asked for is not installed or cannot run here."""


class BackendNotFoundError(ShardcoreError, LookupError):
    """No backend of that name is registered."""


class AlreadyShardedError(ShardcoreError, RuntimeError):
    """``shard`` was called on a model that is already sharded."""


class DistributedSetupError(ShardcoreError, RuntimeError):
    """The process group or device mesh could not be set up (missing peer, bad world size...)."""


class BatchError(ShardcoreError, ValueError):
    """A global batch cannot be split over the ranks or devices (``local_batch``)."""


class CheckpointError(ShardcoreError, RuntimeError):
    """A checkpoint could not be written or read."""
