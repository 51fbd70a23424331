"""Custom operators, one folder each: torch reference (the oracle), ONNX export symbolic, ONNX Runtime op,
TensorRT plugin, and (where it has one) the GPU kernel. All ops live in the ONNX domain `ddtree`."""

DOMAIN = "ddtree"
