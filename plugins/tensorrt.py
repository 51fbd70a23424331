"""Which TensorRT: full TensorRT when `import tensorrt` works (users' GPU machines), else TensorRT-RTX, which
builds real engines on a CPU. Imported lazily: nothing else in the package needs TensorRT.

TensorRT-RTX 1.7's ONNX parser dlopen()s the unversioned `libtensorrt_rtx.so` to add plugin layers, but the
wheel ships only `libtensorrt_rtx.so.1`; without the link the process aborts ("terminate called without an
active exception") as soon as a custom op is parsed. `ensure_rtx_parser_link` adds it next to the parser.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

log = logging.getLogger("ddtree.builder")


@dataclass(frozen=True)
class TensorRT:
    module: ModuleType
    flavor: str  # "tensorrt" or "tensorrt_rtx"
    version: str


def ensure_rtx_parser_link() -> Path:
    import tensorrt_rtx_libs

    folder = Path(os.path.dirname(tensorrt_rtx_libs.__file__))
    link = folder / "libtensorrt_rtx.so"
    if not link.exists():
        try:
            link.symlink_to("libtensorrt_rtx.so.1")
            log.info("added %s -> libtensorrt_rtx.so.1 (TensorRT-RTX ONNX parser needs it for plugins)", link)
        except FileExistsError:  # another process (a parallel build or test worker) made it first
            if not link.exists():
                raise RuntimeError(f"{link} exists but does not lead to libtensorrt_rtx.so.1: remove it") from None
        except OSError as err:
            raise RuntimeError(
                f"TensorRT-RTX's ONNX parser needs {link} -> libtensorrt_rtx.so.1 and it could not be created "
                f"({err}); create it once with: ln -s libtensorrt_rtx.so.1 {link}"
            ) from err
    return link


def import_tensorrt(prefer: str | None = None) -> TensorRT:
    """Full TensorRT if importable (or `prefer='tensorrt_rtx'` to force RTX), else TensorRT-RTX."""
    if prefer in (None, "tensorrt"):
        try:
            import tensorrt

            return TensorRT(tensorrt, "tensorrt", tensorrt.__version__)
        except ImportError:
            if prefer == "tensorrt":
                raise
    try:
        ensure_rtx_parser_link()
        import tensorrt_rtx_bindings
    except ImportError as err:
        raise ImportError(
            "neither TensorRT (`import tensorrt`) nor TensorRT-RTX (`pip install tensorrt-rtx-cu13-libs==1.7.1.116 "
            "tensorrt-rtx-cu13-bindings==1.7.1.116`) is importable"
        ) from err
    return TensorRT(tensorrt_rtx_bindings, "tensorrt_rtx", tensorrt_rtx_bindings.__version__)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    found = import_tensorrt()
    print(f"{found.flavor} {found.version}")
