"""Serving: the runner's JSON-lines mode and the Triton Inference Server model that drives it."""
