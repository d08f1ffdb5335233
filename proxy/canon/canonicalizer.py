"""The proxy's stateful side of canonicalization: options from config and the memories."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from proxy.canon.engine import CanonOptions, CanonResult, canonicalize
from proxy.canon.layout import ForwardedLayouts
from proxy.canon.learned import LearnedVolatility
from proxy.canon.normalize import NormalTextMemo
from proxy.canon.textmemo import TextMemo
from proxy.canon.toolcalls import ToolCallMemory, remember_generated_calls
from proxy.canon.tools import ToolOrders
from proxy.canon.varying import VaryingPlaces
from proxy.canon.volatile import BUILTIN_DETECTORS, DetectionCache, Detector, marker_detector, regex_detector
from proxy.config import CanonSettings
from proxy.openai import ToolCall
from proxy.recent import RecentSet


def build_detectors(settings: CanonSettings) -> tuple[Detector, ...]:
    detectors: list[Detector] = []
    # Names are checked when settings load (config.DetectorName).
    detectors.extend(BUILTIN_DETECTORS[name] for name in settings.builtin_detectors)
    for rule in settings.rules:
        if rule.pattern:
            detectors.append(regex_detector(rule.name, rule.pattern))
        if rule.start_marker and rule.end_marker:
            detectors.append(marker_detector(rule.name, rule.start_marker, rule.end_marker))
    return tuple(detectors)


MAX_STRUCTURE_BOUND_MODELS = 1024


class Canonicalizer:
    def __init__(self, settings: CanonSettings) -> None:
        self.configure(settings)
        self.learned = (
            LearnedVolatility(settings.learned_apps_max, settings.learned_history)
            if settings.learn_volatility
            else None
        )
        self.tool_memory = ToolCallMemory()
        self.tool_orders = ToolOrders()
        self.varying = VaryingPlaces(max(settings.learned_apps_max, 1)) if settings.move_only_varying else None
        self.layouts = ForwardedLayouts(settings.layout_memory_entries) if settings.remember_layouts else None
        self.detection_cache = DetectionCache()
        self.normal_texts = NormalTextMemo()
        self.text_memo = TextMemo(settings.text_memory_lines) if settings.text_memory_lines else None
        # Models whose backend refused a request with an inserted system message: relocation
        # appends to the system prompt for them instead.
        self._structure_bound: RecentSet[str] = RecentSet(MAX_STRUCTURE_BOUND_MODELS)

    def configure(self, settings: CanonSettings) -> None:
        """Take the modes, rules, detectors and placement of ``settings`` (a reload): what was
        learned and remembered stays (memory sizes are read once, at start)."""
        detectors = build_detectors(settings)
        self._default = self._options(settings, settings.mode, detectors)
        self._per_model = {
            model: self._options(settings, mode, detectors) for model, mode in settings.model_modes.items()
        }

    @staticmethod
    def _options(settings: CanonSettings, mode: Any, detectors: tuple[Detector, ...]) -> CanonOptions:
        return CanonOptions(
            mode=mode,
            relocate_target=settings.relocate_target,
            normalize_whitespace=settings.normalize_whitespace,
            normalize_unicode=settings.normalize_unicode,
            restore_query_blocks=settings.restore_query_blocks,
            detectors=detectors,
        )

    def keep_structure(self, model: str | None) -> None:
        """From now on, never insert a message into requests for ``model``."""
        self._structure_bound.add(str(model))

    def forget_structure(self, model: str | None) -> None:
        self._structure_bound.discard(str(model))

    def keeps_structure(self, model: str | None) -> bool:
        return str(model) in self._structure_bound

    def one_system_message(self, model: str | None) -> bool:
        """Whether additions for ``model`` belong inside its system message: its backend refused a
        second one, or volatile lines are configured to go there (relocate_target system_end)."""
        return self._options_for(str(model)).relocate_target == "system_end"

    def _options_for(self, model: str) -> CanonOptions:
        options = self._per_model.get(model, self._default)
        if model in self._structure_bound and options.relocate_target != "system_end":
            options = replace(options, relocate_target="system_end")
        return options

    def apply(self, body: dict[str, Any], tenant: str) -> CanonResult:
        return canonicalize(
            body,
            self._options_for(str(body.get("model"))),
            namespace=tenant,
            learned=self.learned,
            tool_memory=self.tool_memory,
            detection_cache=self.detection_cache,
            normal_texts=self.normal_texts,
            varying=self.varying,
            layouts=self.layouts,
            tool_orders=self.tool_orders,
            text_memo=self.text_memo,
        )

    def record_reply(self, forwarded: dict[str, Any], tenant: str, calls: list[ToolCall]) -> None:
        if calls:
            remember_generated_calls(
                forwarded["messages"], tenant, [(c.id, c.name, c.arguments) for c in calls], self.tool_memory
            )


class PrefixTracker:
    """Bounded memory of stable-prefix hashes: was this prefix seen before.

    It also remembers the prefixes requests had *before* canonicalization, which
    tells whether a reused prefix exists only thanks to canonicalization.
    """

    def __init__(self, max_entries: int = 100_000) -> None:
        self._seen: RecentSet[str] = RecentSet(max_entries)
        self._raw: RecentSet[str] = RecentSet(max_entries)

    def raw_seen(self, raw_prefix_hash: str) -> bool:
        """Record a prefix as the client sent it; True when it was sent before."""
        return self._raw.add(raw_prefix_hash)

    def hit(self, prefix_hash: str) -> bool:
        """Record one request's prefix; True when it was seen before."""
        return self._seen.add(prefix_hash)
