"""ddtree-trt builder: HF checkpoints -> TP-N checkpoint -> ONNX per rank and role -> TensorRT engines.

Importing this package is cheap: torch, onnx and TensorRT are imported only by the submodules that need them.
"""

__version__ = "0.1.0"
