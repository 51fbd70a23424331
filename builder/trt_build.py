"""ONNX graph -> serialized TensorRT engine with explicit named optimization profiles (Polygraphy's
EngineBytesFromNetwork shape): parse, add one profile per name, build, and fail on any error the builder logs
(TensorRT-RTX, for one, drops an invalid attention mask with only a log line)."""

from __future__ import annotations

import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from engines.io import TensorIO
from engines.spec import Profile
from plugins.tensorrt import TensorRT


class BuildError(RuntimeError):
    pass


def make_logger(trt, verbose: bool = False):
    class CapturingLogger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.messages: list[tuple[str, str]] = []

        def log(self, severity, message):
            level = str(severity).rsplit(".", 1)[-1]
            if verbose or severity <= trt.ILogger.Severity.INFO:
                self.messages.append((level, message))

        def errors(self) -> list[str]:
            return [m for level, m in self.messages if level in ("ERROR", "INTERNAL_ERROR")]

    return CapturingLogger()


@contextmanager
def deferred_interrupt():
    """Ctrl-C while TensorRT parses or builds is held until it returns, then raised as KeyboardInterrupt. Raised at
    once, it lands in one of the Python callbacks TensorRT makes meanwhile (the logger's, the plugins'), which
    TensorRT swallows, and the build went on to write the output as if nothing had happened. (Cancelling through the
    build's progress monitor instead crashed TensorRT-RTX 1.7 in malloc.)"""
    if threading.current_thread() is not threading.main_thread():  # only the main thread receives signals
        yield
        return
    interrupted = []

    def hold(signum, frame):
        if not interrupted:
            print("build-engine: interrupted; stopping once TensorRT returns", file=sys.stderr, flush=True)
        interrupted.append(signum)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if interrupted:
        raise KeyboardInterrupt


def check_plugin_creators(trt: TensorRT, onnx_path: Path) -> None:
    """Every custom-domain node needs a registered creator; say which one is missing before TensorRT parses."""
    import onnx

    registry = trt.module.get_plugin_registry()
    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    for op in sorted({(n.domain, n.op_type) for n in graph.node if n.domain not in ("", "ai.onnx")}):
        if registry.get_creator(op[1], "1", op[0]) is None:
            raise BuildError(
                f"no TensorRT plugin creator is registered for {op[0]}::{op[1]} (version 1), used by {onnx_path}; "
                "plugins.registry.register_plugins() registers the ddtree ops"
            )


@deferred_interrupt()  # the parse calls the plugins' Python creators, the build the logger and the plugins
def build_engine(trt: TensorRT, onnx_path: Path, inputs: list[TensorIO], profiles: list[Profile]) -> tuple[bytes, dict]:
    """Returns (plan bytes, build record). Profile i of the engine is `profiles[i]`."""
    rt = trt.module
    check_plugin_creators(trt, onnx_path)
    logger = make_logger(rt)
    builder = rt.Builder(logger)
    network = builder.create_network(1 << int(rt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = rt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise BuildError(f"TensorRT could not parse {onnx_path}: {errors}")
    plugins = []
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type == rt.LayerType.PLUGIN_V3:
            plugins.append(layer.name)
    config = builder.create_builder_config()
    recorded = {}
    for profile in profiles:
        optimization = builder.create_optimization_profile()
        for tensor in inputs:
            optimization.set_shape(tensor.name, *tensor.shape_range(profile))
        index = config.add_optimization_profile(optimization)
        if index < 0:
            raise BuildError(f"TensorRT rejected optimization profile {profile.name} of {onnx_path}: {logger.errors()}")
        recorded[profile.name] = {
            "index": index,
            "shapes": {t.name: [list(s) for s in optimization.get_shape(t.name)] for t in inputs},
        }
    start = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    seconds = time.perf_counter() - start
    errors = logger.errors()
    if plan is None or errors:
        raise BuildError(f"TensorRT build of {onnx_path} failed: {errors or 'no engine returned'}")
    data = bytes(plan)
    record = {
        "builder": trt.flavor,
        "builder_version": trt.version,
        "onnx": onnx_path.name,
        "engine_bytes": len(data),
        "build_seconds": round(seconds, 3),
        "layers": network.num_layers,
        "profiles": recorded,
        "plugin_layers": plugins,
        "plan_records": {op: op.encode() in data for op in ("TreeAttention", "AllReduce", "AllGather")},
        "log": [f"{level}: {message}" for level, message in logger.messages if level != "VERBOSE"][-200:],
    }
    return data, record
