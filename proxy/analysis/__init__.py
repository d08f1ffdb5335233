"""``prefix-proxy analyze``: what each canonicalization mode would save on captured traffic."""

from proxy.analysis.captured import read_capture
from proxy.analysis.command import add_arguments, run
from proxy.analysis.floors import FloorResult, measure_floors
from proxy.analysis.replay import MODES, captured_tally, replay
from proxy.analysis.report import to_json

__all__ = [
    "MODES",
    "FloorResult",
    "add_arguments",
    "captured_tally",
    "measure_floors",
    "read_capture",
    "replay",
    "run",
    "to_json",
]
