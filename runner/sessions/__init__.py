"""Engine sessions: `run(profile, feeds) -> outputs` on torch modules, ONNX Runtime or TensorRT."""
