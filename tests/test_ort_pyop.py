"""The ONNX Runtime Python ops' outputs go back to C++ as arrays (plugins/ort_pyop.py), with the same values as the
library's own list form, in every element type the ddtree ops declare."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper
from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op

from plugins import ort_pyop


@onnx_op(op_type="ddtree_test::TwoOutputs", inputs=[PyCustomOpDef.dt_float],
         outputs=[PyCustomOpDef.dt_float, PyCustomOpDef.dt_int64])  # fmt: skip
def _two_outputs(x):
    # a non-contiguous float64 view and an int32 array: the hook makes them contiguous arrays of the declared types
    return (x.astype(np.float64).T.T[:, ::-1] * 2, np.arange(x.shape[0], dtype=np.int32))


def test_outputs_are_arrays_with_the_declared_types_and_the_same_values():
    assert ort_pyop.install()
    node = helper.make_node("TwoOutputs", ["x"], ["y", "n"], domain="ddtree_test")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [33, 70])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("n", TensorProto.INT64, None)])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ddtree_test", 1)])
    options = ort.SessionOptions()
    options.register_custom_ops_library(get_library_path())
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((33, 70)).astype(np.float32)
    y, n = session.run(None, {"x": x})
    np.testing.assert_array_equal(y, (x[:, ::-1] * 2).astype(np.float32))
    assert y.dtype == np.float32 and n.dtype == np.int64 and n.tolist() == list(range(33))
    from onnxruntime_extensions import _ocos

    op_id = next(k for k, v in _ocos.Opdef._odlist.items() if v.op_type == "ddtree_test::TwoOutputs")
    reply = ort_pyop.array_outputs_hook(op_id, [x], {})
    assert reply[0] == op_id and reply[1] == (33, 70) and isinstance(reply[2], np.ndarray)
    assert reply[2].dtype == np.float32 and reply[2].flags.c_contiguous and reply[4].dtype == np.int64
