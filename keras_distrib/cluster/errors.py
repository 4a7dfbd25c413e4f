"""The one error type of cluster discovery."""

from __future__ import annotations

from typing import Iterable

__all__ = ["ClusterConfigError", "PeersMissingError"]


class ClusterConfigError(ValueError):
    """A cluster description is malformed; the message is one line with the fix."""

    def __init__(self, message: str):
        # Launchers and log scrapers print errors as one line; collapse any
        # newline a caller's value may have smuggled in.
        super().__init__(" ".join(str(message).split()))


class PeersMissingError(ClusterConfigError):
    """Peers did not answer at start-up; `ranks` are the training tasks
    among them (positions in `ClusterInfo.workers`)."""

    def __init__(self, message: str, ranks: Iterable[int] = ()):
        super().__init__(message)
        self.ranks = tuple(ranks)
