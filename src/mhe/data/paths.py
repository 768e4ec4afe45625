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
import sys
import zlib
from contextlib import contextmanager
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


def open_text(path: str | os.PathLike) -> "CheckedText":
    """Open plain, gzip or xz UTF-8 text by the file name's ending, for iteration by line
    or ``read()``; damaged files raise the one-line errors of :func:`iter_lines`."""
    return CheckedText(path)


class CheckedText:
    """A read-only text file (``with``, iteration, ``read``) read through :func:`iter_lines`."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.name = str(path)

    def __enter__(self) -> "CheckedText":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def __iter__(self):
        return iter_lines(self.name)

    def read(self) -> str:
        return read_text(self.name)


def _open_bytes(path: str) -> io.BufferedIOBase:
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".xz"):
        return lzma.open(path, "rb")
    return open(path, "rb")


# What a damaged file raises while it is decompressed or read.
_READ_ERRORS = (gzip.BadGzipFile, lzma.LZMAError, EOFError, zlib.error, OSError)


def _read_error(path: str, err: Exception, offset: int) -> MheError:
    if isinstance(err, EOFError):
        what = "truncated compressed file (ends before its end-of-stream marker)"
    elif isinstance(err, (gzip.BadGzipFile, lzma.LZMAError, zlib.error)):
        what = f"corrupt compressed file ({err})"
    else:
        what = f"cannot read ({err.strerror or err})"
    return MheError(f"{path}: {what}, after {offset} bytes of text")


def _decode(raw: bytes, path: str, line: int, offset: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MheError(f"{path}: line {line}: byte {offset + e.start} (0x{raw[e.start]:02x}) is not UTF-8; "
                       "the file must be UTF-8 text") from e


def iter_lines(path: str | os.PathLike):
    """Yield the lines of a plain, gzip or xz UTF-8 file with ``\n`` endings (``\r\n``
    becomes ``\n``, as text mode would). A corrupt or truncated archive, an unreadable
    file or a byte that is not UTF-8 raises :class:`MheError` naming the file, the line
    and the byte offset (of the uncompressed text)."""
    path = str(path)
    offset, n = 0, 0
    try:
        with _open_bytes(path) as f:
            for n, raw in enumerate(f, 1):
                line = _decode(raw, path, n, offset)
                offset += len(raw)
                yield line[:-2] + "\n" if line.endswith("\r\n") else line
    except _READ_ERRORS as e:
        raise _read_error(path, e, offset) from e


# What a record of the wrong structure raises inside a parser (a field of the wrong type).
SHAPE_ERRORS = (KeyError, TypeError, IndexError, AttributeError, ValueError)


@contextmanager
def record_shape(path, where: str):
    """Turn what a record of the wrong structure raises inside a parser (a missing key, a
    field of the wrong type) into one line naming the file and ``where`` (the record)."""
    try:
        yield
    except MheError:
        raise
    except SHAPE_ERRORS as e:
        detail = f"missing field {e.args[0]!r}" if isinstance(e, KeyError) else str(e).splitlines()[0]
        raise MheError(f"{path}: {where}: malformed record ({detail})") from e


def read_text(path: str | os.PathLike) -> str:
    """The whole UTF-8 text of a plain, gzip or xz file, with the errors of :func:`iter_lines`."""
    return "".join(iter_lines(path))


def read_source_lines(source: str) -> list[str]:
    """Lines (without their endings) of a UTF-8 file (plain, gzip or xz) or, for ``-``, of
    standard input; a byte that is not UTF-8 is an error naming the line and byte offset."""
    if source != "-":
        return [line.rstrip("\n") for line in iter_lines(source)]
    lines, offset = [], 0
    for n, raw in enumerate(sys.stdin.buffer, 1):
        lines.append(_decode(raw, "standard input", n, offset).rstrip("\r\n"))
        offset += len(raw)
    return lines


def hub_split(name: str, repo: str, config: str | None, split: str, *, offline: str):
    """The ``split`` of the hub's dataset ``repo`` (``config``), loaded by the optional ``datasets``
    package (``data.source=hub``): the one hub loader of corpora, parallel text and benchmarks.
    ``name`` is what is loaded and ``offline`` what to do instead (``put FILE under --data-dir``),
    for the one-line errors: the package missing, or the hub or network failing."""
    try:
        import datasets  # optional
    except ImportError as e:
        raise MheError(f"loading {name} from the hub needs the optional 'datasets' package "
                       f"(pip install mhe[datasets]); offline, {offline}") from e
    try:
        return datasets.load_dataset(repo, config, split=split)
    except Exception as e:  # network or hub failure: say what is missing and where to put it
        raise MheError(f"could not load {repo} ({config}) from the hub ({type(e).__name__}); offline, {offline}") from e
