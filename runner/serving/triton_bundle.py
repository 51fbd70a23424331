"""tritonserver for a machine with no package index: the server of a Triton venv packed into one archive, unpacked
there as a venv over that machine's own Python and packages.

    python -m runner.serving.triton_bundle pack --triton_venv .venv-triton --python 3.12 OUT.tar.xz
    python3 -m runner.serving.triton_bundle unpack OUT.tar.xz DIR
    DDTREE_TRITON_VENV=DIR python3 benchmarks/concurrency.py ...   (or triton_server --triton_venv DIR)

`pack` takes what `runner.serving.triton_server` runs from the venv's `nvidia-pytriton`: the server binary, the
Python backend, the response cache, the backend stub built for `--python` (the target machine's interpreter, not the
venv's), the wheel's bundled libraries but its own libpython (the stub links the target interpreter's), and the
venv's numpy 1.x for that Python (the stub's compiled numpy interface misreads numpy 2's arrays: requests fail to
decode) from pip. About 35 MB with xz for Triton 2.51. `unpack` makes DIR a venv of the running interpreter that
sees its packages (numpy, torch: the base's by `--system-site-packages`, and the interpreter's own by a .pth file
where it is itself a venv), extracts the archive into DIR's site-packages, and checks with ldd that every library
the server binary and the stub need is found (the stub: this interpreter's shared libpython). An archive whose stub
was built for another Python than the one unpacking it is refused, naming both.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import venv
import zipfile
from pathlib import Path

from runner.serving.triton_server import venv_paths

SERVER = "pytriton/tritonserver"
LIBS = "nvidia_pytriton.libs"
MANIFEST = "ddtree-triton-bundle.json"


def pack(triton_venv: Path, python: str, out: Path) -> dict:
    """Writes `out` (.tar.xz, .tar.gz or .tar by its name) and returns its manifest."""
    site = Path(venv_paths(Path(triton_venv))["purelib"])
    server = site / SERVER
    stub = server / "python_backend_stubs" / python / "triton_python_backend_stub"
    if not (server / "bin" / "tritonserver").exists():
        raise FileNotFoundError(f"{triton_venv} has no pytriton tritonserver (pip install nvidia-pytriton==0.7.0)")
    if not stub.exists():
        have = sorted(p.name for p in (server / "python_backend_stubs").iterdir())
        raise ValueError(f"--python {python}: {triton_venv}'s pytriton has no backend stub for it (it has {have})")
    members = [server / "bin", server / "backends", server / "caches", stub.parent]
    members += [lib for lib in sorted((site / LIBS).iterdir()) if not lib.name.startswith("libpython")]
    manifest = {"python": python, "files": [str(m.relative_to(site)) for m in members]}
    mode = {".xz": "w:xz", ".gz": "w:gz"}.get(Path(out).suffix, "w")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    with tarfile.open(partial, mode) as archive, tempfile.TemporaryDirectory() as scratch:
        for member in members:
            archive.add(member, arcname=str(member.relative_to(site)))
        manifest["numpy"] = _add_numpy(archive, Path(triton_venv), python, Path(scratch))
        info = tarfile.TarInfo(MANIFEST)
        data = json.dumps(manifest).encode()
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
    partial.replace(out)  # a pack stopped half way leaves no archive that looks whole
    return manifest


def _add_numpy(archive: tarfile.TarFile, triton_venv: Path, python: str, scratch: Path) -> str:
    """The Triton venv's numpy (1.x: the stub's compiled numpy interface reads arrays of numpy 2 wrongly), as a wheel
    for `python` that pip downloads, added to the archive's site-packages without its tests; returns the wheel."""
    check = [str(triton_venv / "bin" / "python"), "-c", "import numpy; print(numpy.__version__)"]
    version = subprocess.check_output(check, text=True).strip()
    pip = [str(triton_venv / "bin" / "python"), "-m", "pip", "download", "-q", f"numpy=={version}", "--no-deps",
           "--only-binary=:all:", "--implementation", "cp", "--python-version", python,
           "--platform", "manylinux2014_x86_64", "-d", str(scratch)]  # fmt: skip
    done = subprocess.run(pip, capture_output=True, text=True, check=False)
    wheels = sorted(scratch.glob("numpy-*.whl"))
    if done.returncode != 0 or not wheels:
        raise RuntimeError(f"no numpy {version} wheel for Python {python}: {done.stderr[-800:]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        for entry in wheel.infolist():
            if entry.is_dir() or "/tests/" in entry.filename:
                continue
            info = tarfile.TarInfo(entry.filename)
            info.size, info.mode = entry.file_size, (entry.external_attr >> 16) or 0o644
            archive.addfile(info, wheel.open(entry))
    return wheels[0].name


def unpack(archive_path: Path, target: Path) -> Path:
    """Makes `target` a venv of this interpreter with the archive's server in its site-packages; returns the server
    binary's path."""
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    with tarfile.open(archive_path) as archive:
        manifest = json.loads(archive.extractfile(MANIFEST).read())
        if manifest["python"] != version:
            raise ValueError(f"{archive_path} holds the backend stub for Python {manifest['python']}; this is "
                             f"Python {version} ({sys.executable}): pack it with --python {version}")  # fmt: skip
        if target.exists() and any(target.iterdir()):
            raise FileExistsError(f"{target} exists and is not empty: unpack into a new folder")
        venv.EnvBuilder(system_site_packages=True, with_pip=False, symlinks=True).create(target)
        paths = venv_paths(target)  # one subprocess: the new venv's site-packages and its interpreter's LIBDIR
        site = Path(paths["purelib"])
        # this interpreter's own packages too, where it is itself a venv (whose base --system-site-packages shows)
        own = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
        (site / "ddtree-parent-site.pth").write_text("".join(f"{path}\n" for path in own))
        archive.extractall(site, filter="tar")
    binary = site / SERVER / "bin" / "tritonserver"
    missing = _missing_libraries(binary, [site / LIBS])
    if missing:
        raise RuntimeError(f"{binary} needs libraries the archive lacks: {missing}")
    # the stub links this interpreter's libpython, found where triton_server looks (its LIBDIR, then the bundle's)
    stub = site / SERVER / "python_backend_stubs" / version / "triton_python_backend_stub"
    libdir = paths["libdir"]
    missing = _missing_libraries(stub, [Path(libdir), site / LIBS])
    if missing:
        raise RuntimeError(f"the Python backend stub needs {missing}, not found in this Python's LIBDIR {libdir} "
                           f"({sys.executable}): the stub needs a Python built with a shared libpython")  # fmt: skip
    return binary


def _missing_libraries(binary: Path, folders: list[Path]) -> list[str]:
    """The libraries `ldd` cannot find for `binary` with `folders` on the search path."""
    env = {"LD_LIBRARY_PATH": ":".join(map(str, folders)), "PATH": "/usr/bin:/bin"}
    listing = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, env=env, check=False).stdout
    return [line.split()[0] for line in listing.splitlines() if "not found" in line]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m runner.serving.triton_bundle", description=__doc__.split("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    packing = commands.add_parser("pack", help="the Triton venv's server into one archive")
    packing.add_argument("out", type=Path, help="the archive (.tar.xz, .tar.gz or .tar)")
    packing.add_argument("--triton_venv", type=Path, default=Path(".venv-triton"))
    packing.add_argument("--python", required=True, help="the target machine's Python, MAJOR.MINOR (the stub's)")
    unpacking = commands.add_parser("unpack", help="an archive into a new venv of this Python")
    unpacking.add_argument("archive", type=Path)
    unpacking.add_argument("target", type=Path)
    args = parser.parse_args(argv)
    if args.command == "pack":
        manifest = pack(args.triton_venv, args.python, args.out)
        print(f"{args.out}: {args.out.stat().st_size / 1e6:.1f} MB, {len(manifest['files'])} entries, stub for "
              f"Python {manifest['python']}")  # fmt: skip
    else:
        print(f"tritonserver ready at {unpack(args.archive, args.target)}; DDTREE_TRITON_VENV={args.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
