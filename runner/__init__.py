"""The runtime: the speculative loop (`speculate.py`), DDTree (`tree.py`), per-rank workers and sessions, the
MPI runner (`python -m runner`), and the Triton model repository writer (`triton_repo.py`)."""
