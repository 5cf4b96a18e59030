"""Output folders: refuse to clobber earlier results, and publish all files or none."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from optkit.core.errors import OptkitError


def prepare_output_dir(out_dir: str | os.PathLike, produced: Iterable[str], *, force: bool) -> Path:
    """Check that ``out_dir`` can take the files a run will produce.

    Raises:
        OptkitError: if it is a file, is not writable, or already holds any of
            ``produced`` and ``force`` is not set.
    """
    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        raise OptkitError(f"output folder {path} is a file; choose another --out")
    existing = sorted(name for name in produced if (path / name).exists())
    if existing and not force:
        raise OptkitError(f"{path} already holds results ({', '.join(existing)}); pass --force to overwrite or choose another --out")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise OptkitError(f"cannot write to output folder {path}: {e.strerror or e}") from e
    return path


@contextlib.contextmanager
def removed_if_left_empty(path: Path, *, created: bool) -> Iterator[None]:
    """On a failure inside the block, remove ``path`` if this run ``created`` it and nothing is in it (a refused
    run leaves no empty folder; a folder holding anything, e.g. training checkpoints to resume from, stays).

    This process's staging and scratch folders in ``path`` go first: an interrupt (Ctrl-C, SIGTERM) that lands
    between a folder's creation and the block that cleans it up would leave one otherwise.
    """
    try:
        yield
    except BaseException:
        for item in Path(path).glob(f"{STAGING_PREFIX}{os.getpid()}-*"):
            shutil.rmtree(item, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                path.rmdir()
        raise


STAGING_PREFIX = ".optkit-staging-"


class StagedOutputs:
    """Write a run's files into a hidden staging folder, then move them into place together.

    Use as a context manager: files written under :attr:`staging` are moved to
    the output folder only if the block finishes without an exception;
    otherwise the staging folder is deleted and the output folder is unchanged.
    An ``OSError`` while writing (a full disk, a read-only folder) becomes an
    :class:`OptkitError` that names the folder and what to do.

    The staging folder's name holds the writer's process id. A run killed
    outright (SIGKILL, power loss) cannot clean up, so each new run first
    removes staging folders left by processes that no longer exist.

    Args:
        out_dir: the output folder.
        superseded: names of files an earlier run may have left that this run
            does not write (``model.onnx`` from an earlier ``--export``); they
            are removed when the new files are published, so the folder never
            mixes two runs' results.
    """

    def __init__(self, out_dir: str | os.PathLike, superseded: Iterable[str] = ()):
        self.out_dir = Path(out_dir)
        self.superseded = tuple(superseded)
        remove_stale_staging(self.out_dir)
        self.staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", dir=self.out_dir))

    def __enter__(self) -> StagedOutputs:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                written = sorted(self.staging.iterdir())
                for name in set(self.superseded) - {item.name for item in written}:
                    (self.out_dir / name).unlink(missing_ok=True)
                for item in written:
                    os.replace(item, self.out_dir / item.name)
        except OSError as e:
            raise _write_error(self.out_dir, e) from e
        finally:
            shutil.rmtree(self.staging, ignore_errors=True)
        if exc_type is not None and issubclass(exc_type, OSError):
            raise _write_error(self.out_dir, exc) from exc

    def path(self, name: str) -> Path:
        """Where to write the output file ``name`` while staging."""
        return self.staging / name


@contextlib.contextmanager
def scratch_folder(out_dir: str | os.PathLike, label: str = "scratch") -> Iterator[Path]:
    """A hidden working folder inside the output folder, removed when the block ends however it ends.

    Named like a staging folder (with the writer's process id), so a run killed outright (SIGKILL), which
    cannot remove it, leaves it only in the output folder, where the next run's :func:`remove_stale_staging`
    deletes it; nothing is left in the system's temporary folder.
    """
    folder = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-{label}-", dir=out_dir))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _write_error(out_dir: Path, error: OSError) -> OptkitError:
    return OptkitError(f"cannot write results to {out_dir}: {error.strerror or error}; "
                       "free space or choose another --out")


def remove_stale_staging(out_dir: str | os.PathLike) -> list[Path]:
    """Delete staging folders in ``out_dir`` whose writing process has exited; returns those removed."""
    removed = []
    for item in Path(out_dir).glob(f"{STAGING_PREFIX}*"):
        pid = item.name[len(STAGING_PREFIX):].split("-", 1)[0]
        if item.is_dir() and pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(item, ignore_errors=True)
            removed.append(item)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, owned by another user
    return True
