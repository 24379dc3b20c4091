"""Who may write a run's checkpoints, where they are kept, and which one a resume reads.

A writer is a pair of integers ``(fit, attempt)``, and the larger pair is the newer
writer: the estimators take the driver's ``time_ns()`` when the fit started and the
Spark stage attempt, so a later fit, or a later attempt of one, is newer. Rank 0 of each
attempt claims the run as it starts (:meth:`RunStore.claim_run
<ringcore.runs.stores.RunStore.claim_run>`), and from then on no older writer's
checkpoint is ever the one a resume reads: a zombie (an attempt its launcher gave up on
whose process still runs: a partitioned executor, a retried stage's straggler) may be
anywhere inside a write when the claim lands. This rests on writers being unique: two
live processes with one ``(fit, attempt)`` are one writer here.

Two keepers, by what the filesystem guarantees:

- :class:`InPlaceCheckpoints` (``LocalRunStore``, the estimators' ``LocalStore``:
  POSIX rename, ``flock``). The run keeps ``checkpoint/checkpoint.pt``, the one before
  it as ``checkpoint.pt.prev`` and its claim as ``checkpoint/writer.json``. A claim,
  and every checkpoint's rename, hold the run's lock file
  (``runs/<run_id>/.checkpoint.lock``) across the read of ``writer.json`` and the
  rename: the owner is checked at the commit point itself, so a zombie that paused
  anywhere before its rename is refused there, and nothing of the owner's is touched.
- :class:`PerWriterCheckpoints` (``FsspecRunStore``, the estimators' ``FsspecStore``:
  object stores have neither an atomic rename nor a lock). Each writer keeps its
  checkpoints in a folder of its own, ``checkpoint/writer-<fit>-<attempt>/``
  (``checkpoint.pt``, ``checkpoint.pt.prev``, ``claim.json``). A claim copies the
  checkpoint it resumes from into its folder, then writes its ``claim.json``; a reader
  reads the folder of the newest claim only. A zombie's write therefore lands in a
  folder no reader picks, whenever it lands, and no writer ever writes or removes
  another's files except an older writer's whole folder (after a newer writer's
  checkpoint is in place: nobody reads it any more). A folder of a writer killed
  mid-write is removed that way too.

In both, a writer's temporary files are its own (``<path>.tmp-<pid>-<random>``); on a
local filesystem a cleanup removes only those no live process holds
(:mod:`ringcore.runs.files`).
Both fall back from a damaged newest checkpoint to the previous one
(:func:`first_whole`). A claim that cannot be read (an OSError: the store unreachable)
is retried, then refused with :class:`ClaimUnreadableError`: an unreadable claim must not
let a zombie write. A torn ``writer.json`` (a crash while it was written) claims nothing.

Runs written before the per-writer folders (``checkpoint/checkpoint.pt`` on an object
store) are read in place until a writer claims the run; the claim copies the checkpoint
into its folder, and its first checkpoint removes the old files (migrated).
"""

from __future__ import annotations

import json
import logging
import posixpath
import re
import time
import zipfile
import zlib
from collections.abc import Callable
from typing import Any, BinaryIO, TypeVar

from .files import PREVIOUS_SUFFIX, run_lock, write_file

__all__ = [
    "CHECKPOINT_FILE",
    "WRITER_FILE",
    "ClaimUnreadableError",
    "InPlaceCheckpoints",
    "PerWriterCheckpoints",
    "StaleWriterError",
    "checkpoint_problem",
    "first_whole",
    "worth_keeping",
]

log = logging.getLogger("ringtrain.runs")

CHECKPOINT_FILE = "checkpoint.pt"
WRITER_FILE = "writer.json"  # the in-place layout's claim: which writer owns the run
CLAIM_FILE = "claim.json"  # a per-writer folder's claim
LOCK_FILE = ".checkpoint.lock"  # in the run's folder, beside checkpoint/ (never removed)
WRITER_FOLDER = "writer-"
_WRITER_FOLDER = re.compile(r"^writer-(-?\d+)-(-?\d+)$")  # an attempt may be < 0
CLAIM_READ_TRIES = 4  # then fail closed; waits 0.1, 0.2, 0.4 s between tries

Writer = tuple[int, int]
T = TypeVar("T")


class StaleWriterError(RuntimeError):
    """A zombie attempt tried to write a run's checkpoint after a newer one took the run
    over: the write is refused and the run's checkpoints stay the newer attempt's."""


class ClaimUnreadableError(RuntimeError):
    """The claim on a run's checkpoints could not be read (the store failed each try):
    the write or read that needed it is refused rather than let a zombie through."""


def checkpoint_problem(f: BinaryIO, crc: bool = True) -> str | None:
    """Why the checkpoint in ``f`` is not whole, or None. torch and Keras checkpoints are
    zip archives: an empty file, a zip without its central directory (truncated) or, with
    ``crc``, a member failing its CRC is damaged; another format, non-empty, passes."""
    try:
        head = f.read(4)
        if not head:
            return "it is empty"
        if head != b"PK\x03\x04":
            return None
        f.seek(0)
        with zipfile.ZipFile(f) as archive:
            bad = archive.testzip() if crc else None
    except zipfile.BadZipFile as exc:
        return f"not a whole zip archive: {exc}"
    except (OSError, EOFError, zlib.error) as exc:
        return f"unreadable: {type(exc).__name__}: {exc}"
    return f"its member {bad!r} fails its CRC" if bad is not None else None


_MISSING = "there is no such file"


def _problem(store: Any, path: str, crc: bool = True) -> str | None:
    """:func:`checkpoint_problem` of the file at ``path``; :data:`_MISSING` when there is
    none. (Not ``exists``: fsspec's takes any error for "not there".)"""
    try:
        with store.open_read(path) as f:
            return checkpoint_problem(f, crc)
    except FileNotFoundError:
        return _MISSING
    except OSError as exc:
        return f"unreadable: {type(exc).__name__}: {exc}"


def first_whole(store: Any, candidates: list[str]) -> str | None:
    """The first of ``candidates`` that exists and is whole. Each damaged one (or one the
    store fails to read) is passed over with a warning naming it; when none is whole, the
    first damaged one is returned, so the caller's error names it."""
    damaged = None
    for candidate in candidates:
        problem = _problem(store, candidate)
        if problem is None:
            return candidate
        if problem == _MISSING:
            continue
        log.warning(
            "the checkpoint %s is damaged (%s; a crash while it was written?): "
            "trying the previous one",
            candidate,
            problem,
        )
        damaged = damaged or candidate
    return damaged


def in_place_candidates(store: Any, run_id: str) -> list[str]:
    """The in-place layout's checkpoints, newest first (then the legacy run folder's)."""
    paths = (store.get_checkpoint_path(run_id), store.get_legacy_checkpoint_path(run_id))
    return [c for path in paths for c in (path, path + PREVIOUS_SUFFIX)]


def _retrying(read: Callable[[], T], missing: T, run_id: str, where: str, doing: str) -> T:
    """``read()``, ``missing`` when it finds nothing (FileNotFoundError); another OSError
    is retried, then raised as :class:`ClaimUnreadableError` (fail closed)."""
    for attempt in range(CLAIM_READ_TRIES):
        try:
            return read()
        except FileNotFoundError:
            return missing
        except OSError as exc:
            error = exc
        if attempt + 1 < CLAIM_READ_TRIES:
            time.sleep(0.1 * 2**attempt)
    raise ClaimUnreadableError(
        f"run {run_id!r}: could not {doing}: the claim on its checkpoints at {where} could "
        f"not be read in {CLAIM_READ_TRIES} tries ({type(error).__name__}: {error}), and "
        "without it a stale task's checkpoint cannot be told from the current one, so "
        "nothing was written or read. Check that the store is reachable and readable "
        "there, then fit again with the same run_id: it resumes from the last checkpoint."
    ) from error


def _parse_claim(raw: bytes) -> Writer | None:
    try:
        value = json.loads(raw)
        return int(value["fit"]), int(value["attempt"])
    except (ValueError, KeyError, TypeError):
        return None  # a torn claim (a crash while it was written) claims nothing


def _claim_json(writer: Writer) -> dict[str, int]:
    return {"fit": writer[0], "attempt": writer[1]}


def refuse_if_newer(run_id: str, writer: Writer, owner: Writer | None, doing: str) -> None:
    """A :class:`StaleWriterError` when ``owner`` (the run's claim) is newer than ``writer``."""
    if owner is not None and owner > writer:
        raise StaleWriterError(
            f"run {run_id!r}: this task (fit {writer[0]}, stage attempt {writer[1]}) "
            f"would {doing}, but a newer attempt (fit {owner[0]}, stage attempt "
            f"{owner[1]}) owns the run's checkpoints now; it stops without writing. "
            "This is a zombie attempt left behind by a retried stage or a later fit "
            "of the same run_id: nothing to fix unless it keeps happening."
        )


def worth_keeping(store: Any, path: str) -> bool:
    """Whether the checkpoint at ``path`` exists and is whole enough (a zip's central
    directory is there) to stay as the previous one: a damaged newest one is replaced
    without pushing a whole previous one out."""
    return _problem(store, path, crc=False) is None


class InPlaceCheckpoints:
    """A local store's run checkpoints, renamed in place under the run's lock (see the
    module docstring)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def _lock(self, run_id: str) -> str:
        return posixpath.join(self.store.get_run_path(run_id), LOCK_FILE)

    def owner(self, run_id: str, doing: str) -> Writer | None:
        path = self.store.get_writer_path(run_id)
        raw = _retrying(lambda: self.store.read_bytes(path), None, run_id, path, doing)
        return None if raw is None else _parse_claim(raw)

    def claim(self, run_id: str, writer: Writer) -> None:
        with run_lock(self._lock(run_id)):
            refuse_if_newer(run_id, writer, self.owner(run_id, "claim the run"), "claim the run")
            self.store.write_json(self.store.get_writer_path(run_id), _claim_json(writer))

    def write(self, run_id: str, writer: Writer, write: Callable[[BinaryIO], object]) -> None:
        def still_the_owner() -> None:  # at the commit point, under the run's lock
            doing = "write a checkpoint"
            refuse_if_newer(run_id, writer, self.owner(run_id, doing), doing)

        write_file(
            self.store.get_checkpoint_path(run_id),
            write,
            keep_previous=lambda path: worth_keeping(self.store, path),
            lock=self._lock(run_id),
            before_commit=still_the_owner,
        )

    def find(self, run_id: str) -> str | None:
        return first_whole(self.store, in_place_candidates(self.store, run_id))


class PerWriterCheckpoints:
    """An fsspec store's run checkpoints, one folder per writer, read from the newest
    claim's folder (see the module docstring)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def folder(self, run_id: str, writer: Writer) -> str:
        name = f"{WRITER_FOLDER}{writer[0]}-{writer[1]}"
        return posixpath.join(self.store.get_checkpoints_path(run_id), name)

    def _writers(self, names: list[str]) -> list[tuple[Writer, str]]:
        found = []
        for name in names:
            match = _WRITER_FOLDER.match(posixpath.basename(name.rstrip("/")))
            if match:
                found.append(((int(match[1]), int(match[2])), name))
        return found

    def owner(self, run_id: str, doing: str) -> Writer | None:
        """The newest writer whose claim is written, listed afresh. (Not fsspec's glob,
        find or exists: they take a failing listing for an empty one.)"""
        folder = self.store.get_checkpoints_path(run_id)
        return _retrying(lambda: self._newest_claim(folder), None, run_id, folder, doing)

    def _newest_claim(self, folder: str) -> Writer | None:
        fs = self.store.fs
        fs.invalidate_cache(folder)
        for writer, name in sorted(self._writers(fs.ls(folder, detail=False)), reverse=True):
            fs.invalidate_cache(name)  # (a listing cached before its claim landed)
            try:
                if CLAIM_FILE in (posixpath.basename(n) for n in fs.ls(name, detail=False)):
                    return writer
            except FileNotFoundError:
                continue  # removed meanwhile: an older writer's, or one that never claimed
        return None

    def _candidates(self, run_id: str, owner: Writer | None) -> list[str]:
        if owner is None:  # nobody claimed the run: the layout before per-writer folders
            return in_place_candidates(self.store, run_id)
        latest = posixpath.join(self.folder(run_id, owner), CHECKPOINT_FILE)
        return [latest, latest + PREVIOUS_SUFFIX]

    def claim(self, run_id: str, writer: Writer) -> None:
        owner = self.owner(run_id, "claim the run")
        refuse_if_newer(run_id, writer, owner, "claim the run")
        if owner == writer:
            return
        folder = self.folder(run_id, writer)
        self._copy_base(run_id, writer, owner, folder)
        self.store.write_json(posixpath.join(folder, CLAIM_FILE), _claim_json(writer))

    def _copy_base(self, run_id: str, writer: Writer, owner: Writer | None, folder: str) -> None:
        """The checkpoint a new claim resumes from, copied from ``owner``'s folder into its
        own (``owner`` may go on writing in its own: a zombie's later ones are never read).
        The owner is listed again after the copy: when another claim landed meanwhile
        (the copy may be of a zombie's later checkpoint, or its folder gone), it copies
        again from the new owner's."""
        self.store.fs.makedirs(folder, exist_ok=True)
        for _ in range(3):
            base = first_whole(self.store, self._candidates(run_id, owner))
            try:
                if base is not None:
                    self.store.fs.cp_file(base, posixpath.join(folder, CHECKPOINT_FILE))
                copied = True
            except FileNotFoundError:
                copied = False  # the owner renamed it away meanwhile, or its folder went
            now = self.owner(run_id, "claim the run")
            refuse_if_newer(run_id, writer, now, "claim the run")
            if copied and now == owner:
                return
            owner = now
        raise FileNotFoundError(
            f"run {run_id!r}: its checkpoint changed under this attempt three times as it "
            "copied it to resume from (other attempts claiming the run at once). Fit again."
        )

    def write(self, run_id: str, writer: Writer, write: Callable[[BinaryIO], object]) -> None:
        owner = self.owner(run_id, "write a checkpoint")
        refuse_if_newer(run_id, writer, owner, "write a checkpoint")
        if owner != writer:  # a newer writer that did not claim the run yet
            self.claim(run_id, writer)
        folder = self.folder(run_id, writer)
        try:
            self.store.write_atomic(posixpath.join(folder, CHECKPOINT_FILE), write)
        except OSError:  # a newer writer's cleanup may have removed the folder under it
            self._refuse_if_superseded(run_id, writer, folder)
            raise
        self._refuse_if_superseded(run_id, writer, folder)
        self._remove_older(run_id, writer)

    def _refuse_if_superseded(self, run_id: str, writer: Writer, folder: str) -> None:
        """After a write: a StaleWriterError, and the writer's folder removed, when a newer
        writer claimed the run meanwhile (it copied what it resumes from before its claim
        landed, so nothing reads this folder any more)."""
        owner = self.owner(run_id, "write a checkpoint")
        if owner is not None and owner > writer:
            self.store.rm(folder)
            refuse_if_newer(run_id, writer, owner, "write a checkpoint")

    def _remove_older(self, run_id: str, writer: Writer) -> None:
        """Older writers' folders, and the files of the layout before them: no reader
        picks them now that ``writer``'s checkpoint is in place."""
        fs, folder = self.store.fs, self.store.get_checkpoints_path(run_id)
        try:
            fs.invalidate_cache(folder)
            names = list(fs.ls(folder, detail=False))
        except OSError:
            return  # the next checkpoint's cleanup tries again
        old = [name for w, name in self._writers(names) if w < writer]
        old += [*in_place_candidates(self.store, run_id), self.store.get_writer_path(run_id)]
        for name in old:
            try:
                self.store.rm(name)
            except OSError as exc:
                log.debug("could not remove %s (%s); a later checkpoint tries again", name, exc)

    def find(self, run_id: str) -> str | None:
        return first_whole(
            self.store, self._candidates(run_id, self.owner(run_id, "find its checkpoint"))
        )
