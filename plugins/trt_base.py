"""Shared machinery of the Python TensorRT plugins (IPluginV3 with the V3One core/build/runtime interfaces and an
IPluginCreatorV3One), for full TensorRT and TensorRT-RTX alike. Classes are made per TensorRT module, since the
two have different base classes; each plugin folder's `trt_plugin.py` supplies what is specific to its op.

Only the plugin's name, version, namespace and fields go into the engine plan, not its code: the process that
deserializes an engine must register the same creators (`plugins.registry.register_plugins`).
"""

from __future__ import annotations

import numpy as np

from plugins import DOMAIN


class OpSpec:
    """What the ops' specs share: the floating types they take, and an output of the first input's data type."""

    def __init__(self, trt):
        self.trt = trt
        self.floats = (trt.float32, trt.float16, trt.bfloat16)

    def output_types(self, plugin, in_types):
        return [in_types[0]]


def make_plugin_class(trt, op_name: str, field_types: dict[str, str], spec) -> tuple[type, type]:
    """`spec` provides output_types(plugin, in_types), output_shapes(plugin, inputs, exprs),
    supports(plugin, pos, io, n_in) and enqueue(plugin, in_desc, out_desc, inputs, outputs, workspace, stream)."""
    trt_types = {"float": trt.PluginFieldType.FLOAT32, "int": trt.PluginFieldType.INT32}
    np_types = {"float": np.float32, "int": np.int32}

    class Plugin(trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuild, trt.IPluginV3OneRuntime):
        def __init__(self, fields: dict):
            for base in (trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuild, trt.IPluginV3OneRuntime):
                base.__init__(self)
            self.plugin_name, self.plugin_version, self.plugin_namespace = op_name, "1", DOMAIN
            self.num_outputs = 1
            self.timing_cache_id = ""
            self.fields = dict(fields)

        def get_capability_interface(self, kind):
            return self

        def get_output_data_types(self, in_types):
            return spec.output_types(self, in_types)

        def get_output_shapes(self, inputs, shape_inputs, exprs):
            return spec.output_shapes(self, inputs, exprs)

        def supports_format_combination(self, pos, in_out, num_inputs):
            if in_out[pos].desc.format != trt.TensorFormat.LINEAR:
                return False
            return spec.supports(self, pos, in_out, num_inputs)

        def configure_plugin(self, inputs, outputs):
            pass

        def on_shape_change(self, inputs, outputs):
            pass

        def get_fields_to_serialize(self):
            return trt.PluginFieldCollection(
                [
                    trt.PluginField(name, np.array([self.fields[name]], dtype=np_types[kind]), trt_types[kind])
                    for name, kind in field_types.items()
                ]
            )

        def get_valid_tactics(self):
            return []

        def set_tactic(self, tactic):
            pass

        def attach_to_context(self, context):
            return self.clone()

        def enqueue(self, input_desc, output_desc, inputs, outputs, workspace, stream):
            spec.enqueue(self, input_desc, output_desc, inputs, outputs, workspace, stream)

        def clone(self):
            return Plugin(self.fields)

    class Creator(trt.IPluginCreatorV3One):
        def __init__(self):
            trt.IPluginCreatorV3One.__init__(self)
            self.name, self.plugin_version, self.plugin_namespace = op_name, "1", DOMAIN
            self.field_names = trt.PluginFieldCollection(
                [trt.PluginField(name, np.array([]), trt_types[kind]) for name, kind in field_types.items()]
            )

        def create_plugin(self, name, field_collection, phase):
            fields = {}
            for field in field_collection:
                if field.name in field_types:
                    value = np.asarray(field.data).ravel()[0]
                    fields[field.name] = float(value) if field_types[field.name] == "float" else int(value)
            missing = sorted(set(field_types) - set(fields))
            if missing:
                raise ValueError(f"{DOMAIN}::{op_name} node {name} lacks attributes {missing}")
            return Plugin(fields)

    return Plugin, Creator
