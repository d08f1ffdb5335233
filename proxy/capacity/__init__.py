"""KV pressure: how many tokens the KV pool holds, and where a backend's context length knees."""

from proxy.capacity.command import add_kv_capacity_arguments, add_ramp_arguments, kv_capacity, run_ramp_command
from proxy.capacity.kvcache import DTYPE_BYTES, PRESETS, describe, resolve_shape, shape_from_hf_config

__all__ = [
    "DTYPE_BYTES",
    "PRESETS",
    "add_kv_capacity_arguments",
    "add_ramp_arguments",
    "describe",
    "kv_capacity",
    "resolve_shape",
    "run_ramp_command",
    "shape_from_hf_config",
]
