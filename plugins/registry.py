"""Registers every ddtree TensorRT plugin creator: the one module that knows all plugin folders (each folder's
`trt_plugin.py` builds on `trt_base.py`; none imports this one, so no import circle)."""

from __future__ import annotations

from plugins import DOMAIN
from plugins.collectives.trt_plugin import creators as collective_creators
from plugins.int4_moe.trt_plugin import creator as int4_moe_creator
from plugins.tree_attention.trt_plugin import creator as tree_attention_creator

_REGISTERED: dict[int, list] = {}


def register_plugins(trt) -> list:
    """Registers every ddtree plugin creator with `trt`'s registry (once per process); returns the creators."""
    key = id(trt)
    if key not in _REGISTERED:
        made = [tree_attention_creator(trt), int4_moe_creator(trt), *collective_creators(trt)]
        registry = trt.get_plugin_registry()
        for creator in made:
            if not registry.register_creator(creator, DOMAIN):
                raise RuntimeError(f"TensorRT refused to register plugin creator {DOMAIN}::{creator.name}")
        _REGISTERED[key] = made
    return _REGISTERED[key]
