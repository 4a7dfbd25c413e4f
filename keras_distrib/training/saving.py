"""Atomic writes: a file is either the old complete one or the new one.

Keras writes `.keras` archives and `.weights.h5` files in place, so a crash
(or a pre-empted worker) mid-write leaves a truncated checkpoint behind. We
write beside the target under a temporary name that keeps the target's
suffix (Keras checks it) and `os.replace` it into place.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Iterator, Union

PathLike = Union[str, os.PathLike]


def is_local(filepath: PathLike) -> bool:
    return "://" not in os.fspath(filepath)


@contextlib.contextmanager
def atomic_path(filepath: PathLike) -> Iterator[str]:
    """Yields a temporary path to write; moves it onto `filepath` on success.

    On failure the temporary file is removed and `filepath` is untouched.
    """
    target = os.path.abspath(os.fspath(filepath))
    directory, base = os.path.split(target)
    tmp = os.path.join(directory, f".tmp-{uuid.uuid4().hex[:12]}-{base}")
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
