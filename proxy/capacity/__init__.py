"""KV pressure: how many tokens the KV pool holds, and where a backend's context length knees."""

from proxy.capacity.command import add_kv_capacity_arguments, add_ramp_arguments, kv_capacity, run_ramp_command
from proxy.capacity.kvcache import describe, resolve_shape

__all__ = [
    "add_kv_capacity_arguments",
    "add_ramp_arguments",
    "describe",
    "kv_capacity",
    "resolve_shape",
    "run_ramp_command",
]
