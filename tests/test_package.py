"""The package stays import-light: configs, specs and the engine contract load without torch or TensorRT."""

import subprocess
import sys


def test_core_modules_import_without_torch_or_tensorrt():
    code = ("import sys, builder, engines.spec, engines.engine_dir, engines.io, models.config, models.layout, "
            "builder.cli, runner.tree\n"
            "heavy = [m for m in ('torch', 'tensorrt', 'tensorrt_rtx_bindings', 'onnxruntime') if m in sys.modules]\n"
            "assert not heavy, heavy")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_build_engine_help_needs_no_heavy_imports():
    done = subprocess.run([sys.executable, "-m", "builder.cli", "build", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--ddtree_budget" in done.stdout and "--max_input_len" in done.stdout
