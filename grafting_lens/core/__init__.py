"""The foundation: errors, what counts as a number, files and the cache root, the console, and
what differs between dependency releases; it imports nothing of the package above it."""

from grafting_lens.core.lazy import submodules

__getattr__ = submodules(__name__)
