"""The device loop: a whole greedy step as one tensor program (one CUDA graph a step on GPUs) and its kernels."""
