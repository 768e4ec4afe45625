"""Where benchmark data lives: one setting for every task, test and experiment.

``--data-dir`` on the command line, else the environment variable ``MHE_DATA``,
else ``../shared/data`` relative to the working directory (the layout this
repository's tests and experiments use; see that folder's MANIFEST.md).
"""

from __future__ import annotations

import gzip
import io
import lzma
import os
from pathlib import Path

from mhe.errors import MheError

ENV = "MHE_DATA"
DEFAULT = Path("..") / "shared" / "data"
COMPRESSED = (".gz", ".xz")


def data_root(override: str | os.PathLike | None = None) -> Path:
    """The data folder: ``override``, else ``$MHE_DATA``, else ``../shared/data``."""
    if override:
        return Path(override)
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    return DEFAULT


def find_file(relpath: str, root: Path | None = None) -> Path:
    """The file at ``root/relpath``, or its ``.gz`` / ``.xz`` form; a missing file names
    every path tried and the setting that moves the data folder."""
    root = data_root() if root is None else root
    tried = [root / relpath] + [root / (relpath + ext) for ext in COMPRESSED]
    for p in tried:
        if p.is_file():
            return p
    raise MheError(f"data file not found: {tried[0]} (also tried .gz/.xz); "
                   f"point --data-dir or {ENV} at the folder that holds it")


def open_text(path: str | os.PathLike) -> io.TextIOBase:
    """Open plain, gzip or xz text as UTF-8 by the file name's ending."""
    path = str(path)
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    if path.endswith(".xz"):
        return lzma.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")
