"""Files written so that readers never see half of one, and folders sealed by a manifest.

A folder is *sealed* when ``manifest.json`` (the sha256 of every other file) is
written last, after every file is fsynced; a folder without a manifest, or whose
files do not match it, is incomplete or corrupt. Checkpoints and ``best/`` are
sealed folders, written in a temporary folder and renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"  # temporary folders a writer left behind when killed start with this


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_json_atomic(path: str | Path, obj) -> None:
    """Write JSON through a temporary file, fsync and rename: readers never see half a file."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write text through a temporary file, fsync and rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    fsync_dir(path.parent)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write bytes through a temporary file, fsync and rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def new_temp_folder(root: Path, name: str) -> Path:
    """An empty ``root/.tmp-NAME-PID`` to fill and then :func:`seal_and_place`."""
    tmp = root / f"{TMP_PREFIX}{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def seal_and_place(tmp: Path, final: Path, **manifest_fields) -> Path:
    """Fsync every file of ``tmp``, write its manifest last and rename it to ``final``
    (replacing an older ``final``)."""
    files = sorted(p.name for p in tmp.iterdir())
    for name in files:
        fsync_file(tmp / name)
    write_json_atomic(tmp / MANIFEST, {**manifest_fields, "files": {name: sha256(tmp / name) for name in files}})
    fsync_dir(tmp)
    if final.exists():  # rename the old one aside first: a folder cannot be renamed over a full one
        old = final.with_name(f"{TMP_PREFIX}old-{final.name}-{os.getpid()}")
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    fsync_dir(final.parent)
    return final


def remove_folder(path: Path) -> None:
    """Delete the folder ``path`` so that no half of it is ever seen under its name: renamed aside
    to a temporary name first (one step), then deleted; a kill during the deletion leaves a
    temporary folder, which :func:`remove_temporaries` clears, never a torn ``path``."""
    aside = path.with_name(f"{TMP_PREFIX}removed-{path.name}-{os.getpid()}")
    try:
        path.rename(aside)
    except FileNotFoundError:
        return
    fsync_dir(path.parent)
    shutil.rmtree(aside, ignore_errors=True)


def verify(path: Path) -> str | None:
    """Why the sealed folder ``path`` cannot be loaded, or None when it is complete and intact."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return "no manifest (incomplete write)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return "unreadable manifest"
    for name, digest in files.items():
        f = path / name
        if not f.is_file():
            return f"missing {name}"
        if sha256(f) != digest:
            return f"{name} does not match its checksum"
    return None


def remove_temporaries(*roots: Path) -> list[Path]:
    """Delete the temporary folders and files killed writers left in ``roots``; returns them."""
    removed = []
    for root in roots:
        if not root.is_dir():
            continue
        for p in root.iterdir():
            if p.name.startswith(TMP_PREFIX) and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
            elif p.name.startswith(".") and ".tmp" in p.name and p.is_file():  # write_text_atomic's
                p.unlink(missing_ok=True)
                removed.append(p)
    return removed
