"""Output paths checked before any work starts: a command that would fail only when it
writes its result (after minutes of training or timing) fails at once instead, with one
line naming the option and the path. Only :func:`make_folder` creates anything."""

from __future__ import annotations

import os
from pathlib import Path

from mhe.errors import MheError


def _writable_parent(path: Path, option: str) -> None:
    """The nearest existing ancestor of ``path`` must be a folder this process may write."""
    parent = path.parent
    while not parent.exists():
        if parent == parent.parent:
            break
        parent = parent.parent
    if not parent.is_dir():
        raise MheError(f"{option} {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise MheError(f"{option} {path}: folder {parent} is not writable")


def portable_path(path: str) -> str:
    """``path`` as a run record keeps it: relative to the working folder where it lies inside it
    (a data folder given as ``/ABS/REPO/data-cache/data`` from ``/ABS/REPO`` is recorded as
    ``data-cache/data``, so no machine's path lands in a committed run), else as given."""
    if not path or not os.path.isabs(path):
        return path
    rel = os.path.relpath(path, os.getcwd())
    return path if rel == os.pardir or rel.startswith(os.pardir + os.sep) else rel


def shown_path(path: str | Path) -> str:
    """``path`` as a log line shows it: :func:`portable_path`, or with the home folder written ``~``
    (a cache under ``~/.cache/mhe``), so console logs kept with a run name no machine's folders."""
    path = str(path)
    shown = portable_path(path)
    if os.path.isabs(shown):
        home = os.path.expanduser("~")
        if home not in ("", "/") and (shown == home or shown.startswith(home + os.sep)):
            return "~" + shown[len(home):]
    return shown


RUNS = "runs"


def default_run_dir(command: str, *parts: str) -> Path:
    """The folder a command writes to when no ``--out`` is given: ``runs/COMMAND-PART-...``
    with the empty parts left out, e.g. ``runs/lm-ptb-tiny-decoder-mha``. Every part that tells
    two runs apart (task, data, preset, attention kind) belongs in it, so that commands run one
    after the other (PTB, then WikiText-2) write to different folders."""
    return Path(RUNS) / "-".join(p for p in (command, *parts) if p)


def free_name(path: str | os.PathLike) -> Path:
    """``path`` itself when nothing is there, else the first of ``path-2``, ``path-3``, ...
    that does not exist (what an error suggests when a folder holds another run)."""
    path = Path(path)
    if not path.exists():
        return path
    n = 2
    while path.with_name(f"{path.name}-{n}").exists():
        n += 1
    return path.with_name(f"{path.name}-{n}")


def check_output_dir(path: str | os.PathLike, option: str = "--out", *, temp: str = "") -> Path:
    """A folder a run may write into: an existing folder, or a path whose nearest existing
    ancestor is a writable folder (it is created later, by the run). Writing is tried, not
    guessed from permissions (which a file system mounted read-only, or ``/proc``, answer
    wrongly for root): the folder ``temp`` (the temporary sibling the atomic write of ``path``
    will use; default a probe of its own) is created and removed beside ``path``, or, where its
    parent does not exist yet, a probe in the nearest existing ancestor. Nothing is left behind."""
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise MheError(f"{option} {path} is an existing file, not a folder")
        if not os.access(path, os.W_OK | os.X_OK):
            raise MheError(f"{option} {path}: folder is not writable")
        _probe(path if not temp else path.parent, temp or f".probe-{os.getpid()}", option, path)
        return path
    _writable_parent(path, option)
    where = path.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    _probe(where, temp if where == path.parent and temp else f".probe-{os.getpid()}", option, path)
    return path


def check_empty_out(path: str | os.PathLike, option: str = "--out") -> Path:
    """A folder a command writes whole (``mhe convert``): :func:`check_output_dir`, and absent or empty."""
    path = check_output_dir(path, option)
    if path.exists() and any(path.iterdir()):
        raise MheError(f"{option} {path} is not empty; choose another {option} ({free_name(path)} is free)")
    return path


def _probe(where: Path, name: str, option: str, path: Path) -> None:
    """Create and remove the folder ``where/name``: a write that would fail fails now, in one line."""
    probe = where / name
    try:
        probe.mkdir()
    except FileExistsError:  # a folder of that name (a killed writer's) is there: writing worked once
        return
    except OSError as e:
        raise MheError(f"{option} {path}: nothing can be written in {where} ({e.strerror or e})") from None
    probe.rmdir()


def check_output_file(path: str | os.PathLike, option: str, *, suffixes: tuple[str, ...] = (),
                      parent_must_exist: bool = False) -> Path:
    """A file a command may write: not a folder, with one of ``suffixes`` (when given), in a
    writable folder (which must already exist when ``parent_must_exist``)."""
    path = Path(path)
    if str(path) in ("", "."):
        raise MheError(f"{option} needs a file name, got {str(path)!r}")
    if path.is_dir():
        raise MheError(f"{option} {path} is a folder; give a file name")
    if suffixes and path.suffix.lower() not in suffixes:
        raise MheError(f"{option} {path}: unknown file type {path.suffix or '(none)'!r}; "
                       f"valid: {', '.join(suffixes)}")
    if parent_must_exist and not path.parent.is_dir():
        what = "is a file, not a folder" if path.parent.exists() else "does not exist"
        raise MheError(f"{option} {path}: folder {path.parent} {what}")
    if path.exists() and not os.access(path, os.W_OK):
        raise MheError(f"{option} {path}: file is not writable")
    _writable_parent(path, option)
    return path


def make_folder(path: str | os.PathLike, option: str) -> Path:
    """Create the folder ``path`` (and its parents) now, before the work whose output goes
    there; a folder that cannot be made is one line naming the option and the reason."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MheError(f"{option} {path}: the folder cannot be created ({e.strerror or e})") from e
    return path


def image_suffixes() -> tuple[str, ...]:
    """File endings matplotlib can save (``.png``, ``.pdf``, ``.svg``, ...)."""
    from matplotlib.backend_bases import FigureCanvasBase

    return tuple(sorted(f".{k}" for k in FigureCanvasBase.get_supported_filetypes()))
