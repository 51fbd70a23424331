"""`build-engine`: the builder's command line, in trtllm-build's idiom.

build-engine convert --model_dir HF_TARGET --draft_model_dir HF_DRAFTER --output_dir CKPT --tp_size 8
build-engine build   --checkpoint_dir CKPT --output_dir ENGINE_DIR [--max_input_len ...] [--ddtree_budget 32]
build-engine inspect ENGINE_DIR
build-engine --model_dir HF_TARGET --draft_model_dir HF_DRAFTER --tp_size 8 --output_dir ENGINE_DIR   (all steps)
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import tempfile
from pathlib import Path

SUBCOMMANDS = ("convert", "build", "inspect")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'4GiB', '500MB', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    size = (
        int(float(match.group(1)) * _UNITS[match.group(2).upper()]) if match and match.group(2).upper() in _UNITS else 0
    )
    if size <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive byte count such as 4GiB, 500MB or 1000000, got {text!r}")
    return size


def _add_convert_args(parser: argparse.ArgumentParser, output_help: str) -> None:
    parser.add_argument("--model_dir", type=Path, required=True, help="HF Kimi K2.x target checkpoint")
    parser.add_argument("--draft_model_dir", type=Path, required=True, help="HF DFlash drafter checkpoint")
    parser.add_argument("--output_dir", type=Path, required=True, help=output_help)
    parser.add_argument("--tp_size", type=int, default=1, help="tensor-parallel ranks (default 1)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="weight dtype of the converted checkpoint (auto: the checkpoint's)",
    )
    parser.add_argument("--force", action="store_true", help="replace a non-empty output_dir")
    parser.add_argument(
        "--max_shard_size",
        default="4GiB",
        type=parse_size,
        help="converted tensors held in memory before each rank's next shard file is written (default 4GiB); "
        "peak memory is about one layer's weights plus this",
    )
    parser.add_argument(
        "--dequantize_experts",
        action="store_true",
        help="write INT4 routed experts dequantized in --dtype (4x the bytes) instead of packed, for comparisons",
    )


def _add_build_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max_batch_size", type=int, default=1, help="requests per engine step (only 1 today)")
    parser.add_argument("--max_input_len", type=int, default=256, help="longest prompt (prefill profile max)")
    parser.add_argument("--max_seq_len", type=int, default=1024, help="prompt + output (KV cache capacity)")
    parser.add_argument(
        "--max_num_tokens",
        type=int,
        default=None,
        help="largest token count of one verify step; must hold ddtree_budget + 1",
    )
    parser.add_argument("--block_size", type=int, default=None, help="draft block size (default: the drafter's)")
    parser.add_argument("--ddtree_budget", type=int, default=32, help="tree nodes verified per step (default 32)")
    parser.add_argument(
        "--extra_budgets",
        type=_budget_list,
        default=(),
        help="more tree budgets the engines verify, a profile each, chosen at run time with --ddtree_budget "
        "(comma-separated, e.g. 8,16)",
    )
    parser.add_argument("--max_topk", type=int, default=None, help="per-depth branching cap of the tree")
    parser.add_argument(
        "--no_tensorrt",
        action="store_true",
        help="write ONNX graphs + checkpoint only (ort/torch backends), no TensorRT engines",
    )
    parser.add_argument(
        "--no_onnx",
        action="store_true",
        help="write the checkpoint only (the torch backend's engine directory): no ONNX export, no TensorRT engines",
    )
    parser.add_argument("--log_level", default="info", choices=["error", "warning", "info", "verbose"])


def _budget_list(text: str) -> tuple[int, ...]:
    try:
        budgets = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated tree budgets like 8,16; got {text!r}") from None
    if any(b < 1 for b in budgets):
        raise argparse.ArgumentTypeError(f"tree budgets must be >= 1; got {text!r}")
    return budgets


def build_parser(command: str | None) -> argparse.ArgumentParser:
    if command == "convert":
        parser = argparse.ArgumentParser(prog="build-engine convert", description="HF checkpoints -> TP-N checkpoint")
        _add_convert_args(parser, "checkpoint directory to write")
    elif command == "build":
        parser = argparse.ArgumentParser(prog="build-engine build", description="TP-N checkpoint -> engines")
        parser.add_argument("--checkpoint_dir", type=Path, required=True)
        parser.add_argument("--output_dir", type=Path, required=True)
        parser.add_argument("--force", action="store_true", help="replace a non-empty output_dir")
        _add_build_args(parser)
    elif command == "inspect":
        parser = argparse.ArgumentParser(prog="build-engine inspect", description="describe an engine directory")
        parser.add_argument("engine_dir", type=Path)
    else:
        parser = argparse.ArgumentParser(prog="build-engine", description=__doc__.split("\n\n")[0])
        _add_convert_args(parser, "engine directory to write")
        _add_build_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in SUBCOMMANDS else None
    parser = build_parser(command)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[build-engine] %(message)s")
    try:
        if command == "convert":
            from builder.convert import convert

            convert(
                args.model_dir,
                args.draft_model_dir,
                args.output_dir,
                args.tp_size,
                args.dtype,
                args.force,
                args.max_shard_size,
                args.dequantize_experts,
            )
        elif command == "build":
            from builder.build import build_from_args

            build_from_args(args, parser)
        elif command == "inspect":
            from builder.inspect_engine import inspect_engine_dir

            print(inspect_engine_dir(args.engine_dir))
        else:
            from builder.build import build_from_args
            from builder.convert import convert
            from engines.output_dir import check_output_dir

            # before converting: the engine directory must not replace either HF checkpoint (with --force it did)
            check_output_dir(args.output_dir, args.force, protect=(args.model_dir, args.draft_model_dir))
            with tempfile.TemporaryDirectory(prefix="ddtree-ckpt-") as ckpt:
                convert(
                    args.model_dir,
                    args.draft_model_dir,
                    Path(ckpt),
                    args.tp_size,
                    args.dtype,
                    force=True,
                    max_shard_size=args.max_shard_size,
                    dequantize_experts=args.dequantize_experts,
                )
                args.checkpoint_dir = Path(ckpt)
                build_from_args(args, parser)
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        print(f"build-engine: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"build-engine: interrupted; {getattr(args, 'output_dir', 'the output')} is as it was", file=sys.stderr)
        return 130
    except RuntimeError as err:
        from builder.trt_build import BuildError

        if not isinstance(err, BuildError):
            raise
        print(f"build-engine: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
