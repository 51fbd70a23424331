"""Output folders: never overwrite what a user already has unless asked to (--force)."""

from __future__ import annotations

import shutil
from pathlib import Path


def prepare_output_dir(path: Path, force: bool, protect: tuple[Path, ...] = ()) -> Path:
    """Creates `path`, or empties it when `force` is set; a non-empty folder without `force` is an error.

    `protect` lists inputs that must survive: a forced output folder that is or contains one of them is refused.
    """
    path = Path(path)
    for keep in protect:
        keep = Path(keep).resolve()
        if keep == path.resolve() or path.resolve() in keep.parents:
            raise ValueError(f"output_dir {path} would replace the input {keep}; choose another output_dir")
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"output_dir {path} exists and is not a folder")
    if path.is_dir() and any(path.iterdir()):
        if not force:
            raise FileExistsError(f"output_dir {path} is not empty; pass --force to replace its contents")
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    return path
