"""Typed errors for bad input. Each message names the file, key, rank or value and what was expected."""


def listing(items, limit: int = 12) -> str:
    """Items for a message: "a, b, c, ... (9 more)" beyond `limit`."""
    items = list(items)
    shown = ", ".join(str(x) for x in items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


class AccessoryError(Exception):
    """Base class: bad input that the user can fix."""


class ConfigError(AccessoryError, ValueError):
    """A model config that is unknown, inconsistent, or impossible at this model-parallel size."""


class CheckpointError(AccessoryError, ValueError):
    """A checkpoint folder or shard file that cannot be loaded as it is."""


class TokenizerError(AccessoryError, ValueError):
    """A tokenizer that is missing, unreadable, or lacks what was asked of it (a chat template, say)."""


class FailedInStep(AccessoryError):
    """A failure on one rank that the others have already been told of: every rank still ends in step, so the
    process group can be left normally (a port that was taken, say)."""


class RanksDisagree(RuntimeError):
    """The ranks of a model-parallel group are not at the same generation step: user code that differs between
    ranks (a `break` out of `stream_generate` on some ranks only, a call that only some ranks make), or a rank that
    stopped. Raised on every rank that can still raise; the group cannot be used after it."""


class CollectivesOutOfStep(RanksDisagree):
    """Ranks that share a shared-memory segment met in different collectives (their calls went out of step); the
    message names both."""
