"""The engine contract: the speculation spec and its profiles (`spec.py`) and the engine directory (`engine_dir.py`).

Built engine directories are written wherever `--output_dir` says; `engines/demo*` is where `make demo` puts its own.
"""
