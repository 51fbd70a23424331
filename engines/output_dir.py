"""Output folders: never overwrite what a user already has unless asked to (--force), never replace an input, and
never leave a half-written folder where a finished one was.

Every writer (convert, build, the demo checkpoints, the Triton repository) writes into a temporary folder beside the
output (`staged_output_dir`); only when everything is written does it take the output's place, and only then is a
previous output (allowed by --force) removed. A build that fails or is interrupted leaves the previous output as it
was, and no partial folder behind.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def check_output_dir(path: Path, force: bool, protect: tuple[Path, ...] = ()) -> None:
    """Raises unless `path` may be written: it is not and does not contain one of the inputs in `protect`, it is a
    folder if it exists, and an existing non-empty one needs `force`."""
    path = Path(path)
    for keep in protect:
        keep = Path(keep).resolve()
        if keep == path.resolve() or path.resolve() in keep.parents:
            raise ValueError(f"output_dir {path} would replace the input {keep}; choose another output_dir")
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"output_dir {path} exists and is not a folder")
    if path.is_dir() and any(path.iterdir()) and not force:
        raise FileExistsError(f"output_dir {path} is not empty; pass --force to replace its contents")


@contextmanager
def staged_output_dir(path: Path, force: bool, protect: tuple[Path, ...] = ()) -> Iterator[Path]:
    """Yields an empty temporary folder beside `path` to write into. When the block completes, the folder becomes
    `path` (a previous `path` is removed only then); when it fails, the folder is removed and `path` is untouched."""
    path = Path(path)
    check_output_dir(path, force, protect)
    path.parent.mkdir(parents=True, exist_ok=True)
    # the name is chosen before anything is created, so that an interrupt at any point (even between the mkdir and
    # the `try`) finds the folder to remove
    staging = path.with_name(f".{path.name}.partial-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        staging.mkdir()  # mode 0o777 less the umask, as any folder the user makes
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    previous = path.with_name(f".{path.name}.replaced-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        if path.exists():
            path.rename(previous)
        staging.rename(path)
    except BaseException:  # interrupted while moving into place: the previous output goes back where it was
        if previous.exists() and not path.exists():
            previous.rename(path)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(previous, ignore_errors=True)
