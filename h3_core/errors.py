"""Error kinds shared by every layer of the pack.

Messages are sentences a user can act on: they name the input, quote what was given and say what is
allowed. The node layer turns them into one line under the node that failed.
"""

__all__ = ["H3InputError", "H3BackendUnavailable", "H3DoesNotFit"]


class H3InputError(ValueError):
    """An argument, file or geometry that cannot be used as given."""


class H3BackendUnavailable(RuntimeError):
    """An explicitly chosen backend or kernel cannot run here; the message names what would fix it."""


class H3DoesNotFit(H3InputError):
    """A request that no memory plan fits on the device it would run on; the message says what it needs."""
