"""An experiment's run folders packed into one compressed file, and read from it unpacked.

A comparison folder (``results/EXP``) keeps what a reader reads as files (``RUN.md``,
``sweep.json``, ``summary.*``, plots); its ``runs/`` folder, hundreds of small files
(``config.json``, ``metrics.jsonl``, ``results.json``, logs), can be packed into
``runs.tar.xz`` beside it. :class:`RunFiles` reads a folder's runs from either form, so
``mhe report`` gives the same tables from the archive as from the files.

The archive is deterministic: members sorted by path, every one a plain file with mode 0644,
owner 0, no user or group name and time 0, xz at one preset; packing the same files again gives
the same bytes. Any folder packs the same way (``FOLDER`` -> ``FOLDER.tar.xz``, members named
``FOLDER/...``): results' log folders too. Resuming a packed comparison needs its folders back:
:func:`unpack` (``mhe report --unpack EXP``) restores ``runs/`` exactly and removes the archive.
"""

from __future__ import annotations

import io
import lzma
import shutil
import tarfile
from pathlib import Path, PurePosixPath

from mhe.errors import MheError
from mhe.training.atomic import TMP_PREFIX, write_bytes_atomic
from mhe.training.run_files import CONFIG, METRICS, RESULTS, parse_json, parse_metrics

SUFFIX = ".tar.xz"
RUNS = "runs"
XZ_PRESET = 6 | lzma.PRESET_EXTREME  # a dictionary of 8 MiB: more than any experiment's runs need


def archive_of(folder: str | Path) -> Path:
    """Where ``folder`` is packed: ``FOLDER.tar.xz`` beside it."""
    folder = Path(folder)
    return folder.with_name(folder.name + SUFFIX)


def pack_target(path: str | Path) -> Path:
    """The folder ``mhe report --pack PATH`` packs: an experiment's ``runs/``, else ``PATH`` itself."""
    path = Path(path)
    return path / RUNS if (path / RUNS).is_dir() else path


def unpack_target(path: str | Path) -> Path:
    """The folder ``mhe report --unpack PATH`` restores: an experiment's ``runs/`` (from
    ``runs.tar.xz``), the folder of ``PATH.tar.xz``, or of ``PATH`` when it is the archive."""
    path = Path(path)
    if path.name.endswith(SUFFIX) and path.is_file():
        return path.with_name(path.name[: -len(SUFFIX)])
    return path / RUNS if archive_of(path / RUNS).is_file() else path


def _files(folder: Path) -> list[tuple[str, Path]]:
    """(member name, file) of every file under ``folder``, sorted by name; a link or any other
    non-file is refused (an archive of plain files unpacks the same everywhere)."""
    out = []
    for p in folder.rglob("*"):
        if p.is_symlink() or not (p.is_file() or p.is_dir()):
            raise MheError(f"{p}: not a plain file or folder; only plain files are packed")
        if p.is_file():
            out.append((str(PurePosixPath(folder.name, *p.relative_to(folder).parts)), p))
    return sorted(out)


def archive_bytes(members: list[tuple[str, bytes]]) -> bytes:
    """The deterministic ``.tar.xz`` of ``members`` (name, bytes), in the order given."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    return lzma.compress(buf.getvalue(), format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=XZ_PRESET)


def read_archive(path: str | Path) -> dict[str, bytes]:
    """Every member of a packed folder, by name; anything but plain files with relative names
    that stay inside the folder is refused (a damaged or foreign archive)."""
    path = Path(path)
    try:
        with tarfile.open(path, mode="r:xz") as tar:
            out = {}
            for m in tar.getmembers():
                parts = PurePosixPath(m.name).parts
                if not m.isfile() or m.name.startswith("/") or ".." in parts or len(parts) < 2:
                    raise MheError(f"{path}: member {m.name!r} is not a plain file inside the packed folder")
                out[m.name] = tar.extractfile(m).read()
            return out
    except (tarfile.TarError, lzma.LZMAError, EOFError, OSError) as e:
        raise MheError(f"{path}: not a readable .tar.xz archive ({e})") from e


def pack(folder: str | Path) -> Path:
    """Pack ``folder`` into ``FOLDER.tar.xz``, check that the archive reads back to the same
    bytes, then remove the folder; returns the archive. Refused when the archive exists already
    or the folder is missing or empty (nothing is written then)."""
    folder = Path(folder)
    target = archive_of(folder)
    if target.exists():
        raise MheError(f"{target} exists already; unpack it first (mhe report --unpack {folder.parent})")
    if not folder.is_dir():
        raise MheError(f"{folder} is not a folder; pass an experiment folder (with runs/) or a folder to pack")
    files = _files(folder)
    if not files:
        raise MheError(f"{folder} holds no files to pack")
    members = [(name, p.read_bytes()) for name, p in files]
    write_bytes_atomic(target, archive_bytes(members))
    if read_archive(target) != dict(members):
        target.unlink()
        raise MheError(f"{target} did not read back to the files of {folder}; nothing was removed")
    shutil.rmtree(folder)
    return target


def unpack(folder: str | Path) -> Path:
    """Restore ``folder`` from ``FOLDER.tar.xz`` (written in a temporary folder, then renamed
    into place) and remove the archive; returns the folder. Refused when the folder exists."""
    folder = Path(folder)
    source = archive_of(folder)
    if not source.is_file():
        raise MheError(f"{source} does not exist (nothing packed there to unpack)")
    if folder.exists():
        raise MheError(f"{folder} exists already beside {source.name}; move one of them away first")
    members = read_archive(source)
    tmp = folder.with_name(f"{TMP_PREFIX}{folder.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for name, data in members.items():
            parts = PurePosixPath(name).parts
            if parts[0] != folder.name:
                raise MheError(f"{source}: member {name!r} is not under {folder.name}/")
            dest = tmp.joinpath(*parts[1:])
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    source.unlink()
    return folder


class RunFiles:
    """The runs of one comparison folder, read from ``runs/`` or from ``runs.tar.xz`` (read
    once, whole: an experiment's archive is a few MB). A folder holding both is refused: which
    one is current cannot be told."""

    def __init__(self, exp: str | Path):
        self.exp = Path(exp)
        self.folder, self.archive = self.exp / RUNS, archive_of(self.exp / RUNS)
        self.packed = self.archive.is_file()
        if self.packed and self.folder.exists():
            raise MheError(f"{self.exp} holds both {RUNS}/ and {self.archive.name}; keep one "
                           f"(mhe report --pack or --unpack {self.exp} after moving the other away)")
        self._members = read_archive(self.archive) if self.packed else {}

    def finished(self) -> list[str]:
        """The names of the runs with a ``results.json``, sorted."""
        if self.packed:
            return sorted(PurePosixPath(n).parts[1] for n in self._members
                          if len(PurePosixPath(n).parts) == 3 and n.endswith("/" + RESULTS))
        return sorted(f.parent.name for f in self.folder.glob(f"*/{RESULTS}"))

    def read(self, run: str, name: str) -> bytes | None:
        """The bytes of ``runs/RUN/NAME``, None where the run has no such file."""
        if self.packed:
            return self._members.get(f"{RUNS}/{run}/{name}")
        f = self.folder / run / name
        return f.read_bytes() if f.is_file() else None

    def where(self, run: str, name: str = "") -> str:
        """How messages name ``runs/RUN/NAME``: its path, or the archive and the member."""
        member = "/".join(p for p in (RUNS, run, name) if p)
        return f"{self.archive}:{member}" if self.packed else str(self.exp / member)

    def json(self, run: str, name: str) -> object | None:
        """``runs/RUN/NAME`` parsed (a one-line error where it is not JSON), None where missing."""
        data = self.read(run, name)
        return None if data is None else parse_json(data, where=self.where(run, name))

    def results(self, run: str) -> dict:
        res = self.json(run, RESULTS)
        if not isinstance(res, dict):
            raise MheError(f"{self.where(run, RESULTS)}: must be a JSON object, got {type(res).__name__}")
        return res

    def config(self, run: str) -> dict | None:
        """The run's ``config.json`` (the record the trainer wrote), None where it has none."""
        rec = self.json(run, CONFIG)
        return rec if isinstance(rec, dict) else None

    def metrics(self, run: str) -> list[dict] | None:
        """The run's ``metrics.jsonl`` records, None where it has none."""
        data = self.read(run, METRICS)
        return None if data is None else parse_metrics(data, where=self.where(run, METRICS))
