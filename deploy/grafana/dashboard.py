"""Source of deploy/grafana/dashboards/prefix-proxy.json (the JSON is committed; tests check they agree).

Edit the panels here, then regenerate:

    python deploy/grafana/dashboard.py > deploy/grafana/dashboards/prefix-proxy.json

Every panel reads the data source picked in the ``datasource`` variable, so the JSON works both when
provisioned (deploy/grafana/provisioning) and when imported by hand into any Grafana with a Prometheus
data source. ``$model`` filters the proxy's ``model`` label and vLLM's ``model_name``; ``$tenant``
filters the proxy's ``tenant`` label. What each panel means: docs/metrics.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

DS = {"type": "prometheus", "uid": "${datasource}"}
RI = "$__rate_interval"
P = 'model=~"$model", tenant=~"$tenant"'  # proxy series with model and tenant labels
V = 'model_name=~"$model"'  # vLLM series


@dataclass
class Target:
    expr: str
    legend: str


@dataclass
class Panel:
    title: str
    description: str
    targets: list[Target]
    unit: str = "short"
    kind: str = "timeseries"
    width: int = 12
    height: int = 8
    stack: bool = False
    min: float | None = 0
    max: float | None = None
    decimals: int | None = None
    overrides: list[dict[str, Any]] = field(default_factory=list)


def ratio(numerator: str, denominator: str) -> str:
    return f"{numerator}\n  /\n{denominator}"


def quantile(q: float, bucket: str, by: str = "le") -> str:
    return f"histogram_quantile({q}, sum by ({by}) (rate({bucket}[{RI}])))"


ROWS: list[tuple[str, list[Panel]]] = [
    (
        "Prefix cache",
        [
            Panel(
                "Prefix-cache hit rate",
                "Share of prompt tokens served from vLLM's prefix cache. Proxy-observed: "
                "usage.prompt_tokens_details.cached_tokens / usage.prompt_tokens of the requests that went "
                "through the proxy. vLLM: prefix_cache_hits / prefix_cache_queries as the engine counts them "
                "(every client of the engine). The two agree when all traffic goes through the proxy.",
                [
                    Target(
                        ratio(
                            f"sum(rate(prefix_proxy_cached_tokens_total{{{P}}}[{RI}]))",
                            f"sum(rate(prefix_proxy_prompt_tokens_total{{{P}}}[{RI}]))",
                        ),
                        "proxy-observed (cached / prompt tokens)",
                    ),
                    Target(
                        ratio(
                            f"sum(rate(vllm:prefix_cache_hits_total{{{V}}}[{RI}]))",
                            f"sum(rate(vllm:prefix_cache_queries_total{{{V}}}[{RI}]))",
                        ),
                        "vLLM (prefix_cache_hits / prefix_cache_queries)",
                    ),
                ],
                unit="percentunit",
                max=1,
                width=16,
            ),
            Panel(
                "Hit rate (time range)",
                "Proxy-observed hit rate over the whole time range picked at the top of the dashboard.",
                [
                    Target(
                        ratio(
                            f"sum(increase(prefix_proxy_cached_tokens_total{{{P}}}[$__range]))",
                            f"sum(increase(prefix_proxy_prompt_tokens_total{{{P}}}[$__range]))",
                        ),
                        "hit rate",
                    )
                ],
                unit="percentunit",
                kind="stat",
                max=1,
                width=8,
                decimals=1,
            ),
            Panel(
                "Prefill tokens: computed vs saved",
                "Tokens per second. Computed: prompt tokens vLLM had to prefill (prompt - cached). Saved: "
                "prefill the proxy avoided, by source (canonicalization: cached tokens of requests whose prefix "
                "hit only because the proxy rewrote it; summary: history replaced by summaries).",
                [
                    Target(f"sum(rate(prefix_proxy_prefill_tokens_total{{{P}}}[{RI}]))", "computed (prefill)"),
                    Target(
                        f"sum by (source) (rate(prefix_proxy_tokens_saved_total{{{P}}}[{RI}]))",
                        "saved: {{source}}",
                    ),
                    Target(f"sum(rate(prefix_proxy_cached_tokens_total{{{P}}}[{RI}]))", "served from cache (all)"),
                ],
                unit="short",
            ),
            Panel(
                "Hit rate by tenant",
                "Proxy-observed hit rate per tenant (API key): a tenant far below the others usually sends a "
                "volatile prefix the proxy does not recognise yet.",
                [
                    Target(
                        ratio(
                            f"sum by (tenant) (rate(prefix_proxy_cached_tokens_total{{{P}}}[{RI}]))",
                            f"sum by (tenant) (rate(prefix_proxy_prompt_tokens_total{{{P}}}[{RI}]))",
                        ),
                        "{{tenant}}",
                    )
                ],
                unit="percentunit",
                max=1,
            ),
            Panel(
                "Canonicalization actions by kind",
                "Rewrites per second, by kind (volatile_datetime, volatile_moved, tools_canonicalized, "
                "tool_call_ids_restored, ...). A kind that suddenly rises or vanishes means clients changed.",
                [Target(f"sum by (kind) (rate(prefix_proxy_canon_actions_total[{RI}]))", "{{kind}}")],
                unit="ops",
                stack=True,
            ),
            Panel(
                "Stable-prefix reuse",
                "Requests per second whose canonical stable prefix (system prompt and tools) the proxy has seen "
                "before (repeat) or not (new). Mostly new: every request carries a unique prefix.",
                [Target(f"sum by (reuse) (rate(prefix_proxy_prefix_requests_total[{RI}]))", "{{reuse}}")],
                unit="reqps",
                stack=True,
            ),
            Panel(
                "Where prefill goes",
                "Prefill tokens per second by why they were not served from the cache (docs/analysis.md): the "
                "estimated tokens each cache break cost, by cause (system_changed, tools_changed, history_trimmed, "
                "model_output_rewritten, cache_evicted, ...), and the rest of the prefill: the new turns "
                "themselves, which no cache can serve. Causes are counted over all models and tenants.",
                [
                    Target(f"sum by (cause) (rate(prefix_proxy_cache_break_tokens_total[{RI}]))", "{{cause}}"),
                    Target(
                        f"clamp_min(sum(rate(prefix_proxy_prefill_tokens_total{{{P}}}[{RI}]))"
                        f" - sum(rate(prefix_proxy_cache_break_tokens_total[{RI}])), 0)",
                        "new turns",
                    ),
                ],
                unit="short",
                stack=True,
                width=24,
            ),
        ],
    ),
    (
        "Traffic and latency",
        [
            Panel(
                "Requests by status",
                "Requests per second answered by the proxy, by HTTP status.",
                [Target(f"sum by (status) (rate(prefix_proxy_requests_total{{{P}}}[{RI}]))", "{{status}}")],
                unit="reqps",
                stack=True,
                width=8,
            ),
            Panel(
                "Error rate",
                "Share of requests answered 5xx (proxy or upstream failure) and 4xx (client errors, budget "
                "rejections, upstream 4xx).",
                [
                    Target(
                        ratio(
                            f'sum(rate(prefix_proxy_requests_total{{{P}, status=~"5.."}}[{RI}]))',
                            f"sum(rate(prefix_proxy_requests_total{{{P}}}[{RI}]))",
                        ),
                        "5xx",
                    ),
                    Target(
                        ratio(
                            f'sum(rate(prefix_proxy_requests_total{{{P}, status=~"4.."}}[{RI}]))',
                            f"sum(rate(prefix_proxy_requests_total{{{P}}}[{RI}]))",
                        ),
                        "4xx",
                    ),
                ],
                unit="percentunit",
                max=1,
                width=8,
            ),
            Panel(
                "Upstream errors by kind",
                "Upstream failures per second: unreachable (connection refused, DNS), timeout, http_4xx, "
                "http_5xx (the upstream's own error answers).",
                [
                    Target(
                        f"sum by (kind) (rate(prefix_proxy_upstream_errors_total[{RI}]))",
                        "{{kind}}",
                    )
                ],
                unit="ops",
                stack=True,
                width=8,
            ),
            Panel(
                "Proxy overhead p50 / p99",
                "Time the proxy itself adds to a request: parsing, canonicalization, session and budget work, "
                "until the upstream request is sent and its headers relayed (upstream time excluded).",
                [
                    Target(quantile(0.5, "prefix_proxy_overhead_seconds_bucket"), "p50"),
                    Target(quantile(0.99, "prefix_proxy_overhead_seconds_bucket"), "p99"),
                ],
                unit="s",
                width=8,
            ),
            Panel(
                "Time to first token p50 / p99",
                "Streaming requests: time to the first token as the client sees it through the proxy, and as "
                "vLLM measures it inside the engine. Prefix-cache hits shorten both (less prefill).",
                [
                    Target(
                        quantile(0.5, 'prefix_proxy_time_to_first_token_seconds_bucket{model=~"$model"}'),
                        "proxy p50",
                    ),
                    Target(
                        quantile(0.99, 'prefix_proxy_time_to_first_token_seconds_bucket{model=~"$model"}'),
                        "proxy p99",
                    ),
                    Target(quantile(0.5, f"vllm:time_to_first_token_seconds_bucket{{{V}}}"), "vLLM p50"),
                    Target(quantile(0.99, f"vllm:time_to_first_token_seconds_bucket{{{V}}}"), "vLLM p99"),
                ],
                unit="s",
                width=8,
            ),
            Panel(
                "Upstream time p50 / p99",
                "Time from sending a request upstream to its last byte (the whole generation for streams).",
                [
                    Target(quantile(0.5, "prefix_proxy_upstream_seconds_bucket"), "p50"),
                    Target(quantile(0.99, "prefix_proxy_upstream_seconds_bucket"), "p99"),
                ],
                unit="s",
                width=8,
            ),
            Panel(
                "Tokens per second",
                "Prompt and completion tokens per second the upstream reported for proxied requests.",
                [
                    Target(f"sum(rate(prefix_proxy_prompt_tokens_total{{{P}}}[{RI}]))", "prompt"),
                    Target(f"sum(rate(prefix_proxy_completion_tokens_total{{{P}}}[{RI}]))", "completion"),
                ],
                unit="short",
            ),
            Panel(
                "Streams cancelled",
                "Streams per second closed early because the client went away (or the upstream broke off).",
                [Target(f"sum(rate(prefix_proxy_streams_cancelled_total[{RI}]))", "cancelled")],
                unit="ops",
            ),
        ],
    ),
    (
        "Capacity and sessions",
        [
            Panel(
                "vLLM KV-cache usage",
                "Fill of vLLM's KV-cache block pool (1 = full). Near full, vLLM evicts cached prefixes (LRU) and "
                "the hit rate drops; sustained 100% means requests queue.",
                [Target(f"max by (instance) (vllm:kv_cache_usage_perc{{{V}}})", "{{instance}}")],
                unit="percentunit",
                max=1,
                width=8,
            ),
            Panel(
                "vLLM requests running / waiting",
                "Requests in vLLM's running batch and in its queue.",
                [
                    Target(f"sum(vllm:num_requests_running{{{V}}})", "running"),
                    Target(f"sum(vllm:num_requests_waiting{{{V}}})", "waiting"),
                ],
                unit="short",
                width=8,
            ),
            Panel(
                "Active sessions and their KV footprint",
                "Sessions seen within the activity window, and the KV-cache bytes their contexts represent "
                "(needs the served model's shape: kv_model / kv_config_json). Replicas sharing one Redis report "
                "the same numbers, hence max.",
                [
                    Target("max(prefix_proxy_sessions_active)", "sessions"),
                    Target("max(prefix_proxy_session_kv_bytes)", "KV bytes"),
                ],
                unit="short",
                width=8,
                overrides=[
                    {
                        "matcher": {"id": "byName", "options": "KV bytes"},
                        "properties": [
                            {"id": "unit", "value": "bytes"},
                            {"id": "custom.axisPlacement", "value": "right"},
                        ],
                    }
                ],
            ),
            Panel(
                "Compactions by outcome",
                "Summary compactions per second, by outcome (started, succeeded, failed). Failed compactions "
                "forward the original history, so they cost cache hits, not correctness.",
                [Target(f"sum by (outcome) (rate(prefix_proxy_compactions_total[{RI}]))", "{{outcome}}")],
                unit="ops",
                width=8,
            ),
            Panel(
                "Compaction time p50 / p99 and tokens removed",
                "How long a compaction takes, and history tokens per second replaced by summaries versus the "
                "tokens of the summaries written.",
                [
                    Target(quantile(0.5, "prefix_proxy_compaction_seconds_bucket"), "p50"),
                    Target(quantile(0.99, "prefix_proxy_compaction_seconds_bucket"), "p99"),
                    Target(f"sum(rate(prefix_proxy_compaction_tokens_removed_total[{RI}]))", "tokens removed/s"),
                    Target(f"sum(rate(prefix_proxy_summary_tokens_total[{RI}]))", "summary tokens/s"),
                ],
                unit="s",
                width=8,
                overrides=[
                    {
                        "matcher": {"id": "byRegexp", "options": "/tokens/"},
                        "properties": [
                            {"id": "unit", "value": "short"},
                            {"id": "custom.axisPlacement", "value": "right"},
                        ],
                    }
                ],
            ),
            Panel(
                "Budget rejections",
                "Requests per second refused by a budget, by kind (context: over the context limit, 400; "
                "session / tenant: usage budget of the window exhausted, 429) and tenant.",
                [
                    Target(
                        "sum by (kind, tenant) "
                        f'(rate(prefix_proxy_budget_rejections_total{{tenant=~"$tenant"}}[{RI}]))',
                        "{{kind}} ({{tenant}})",
                    )
                ],
                unit="reqps",
                width=8,
            ),
            Panel(
                "Session store (Redis) health",
                "1 while every replica's session store answers, 0 while one is degraded (requests then pass "
                "through without sessions or usage budgets); and failed store operations per second.",
                [
                    Target("min(prefix_proxy_store_up)", "store up (min over replicas)"),
                    Target(f"sum(rate(prefix_proxy_store_errors_total[{RI}]))", "store errors/s"),
                ],
                unit="short",
                width=12,
            ),
            Panel(
                "Backends up and in flight",
                "Per backend (host:port): 1 while every replica routes to it, 0 while one has ejected it after "
                "failures (min over replicas); and requests in flight to it (sum over replicas). With one "
                "backend only the in-flight line moves.",
                [
                    Target("min by (backend) (prefix_proxy_backend_up)", "{{backend}} up"),
                    Target("sum by (backend) (prefix_proxy_backend_in_flight)", "{{backend}} in flight"),
                ],
                unit="short",
                width=12,
                overrides=[
                    {
                        "matcher": {"id": "byRegexp", "options": "/in flight/"},
                        "properties": [{"id": "custom.axisPlacement", "value": "right"}],
                    }
                ],
            ),
            Panel(
                "Backend attempts and failovers",
                "Attempts per second sent to each backend by outcome (ok, unreachable, timeout, http_5xx), "
                "and requests per second moved off a backend to the next one. Under affinity routing a "
                "backend's share follows its conversations; failovers move them, and their cache, elsewhere.",
                [
                    Target(
                        f"sum by (backend, outcome) (rate(prefix_proxy_backend_requests_total[{RI}]))",
                        "{{backend}} {{outcome}}",
                    ),
                    Target(
                        f"sum by (backend) (rate(prefix_proxy_backend_failovers_total[{RI}]))",
                        "{{backend}} failed over",
                    ),
                ],
                unit="reqps",
                width=12,
            ),
            Panel(
                "Proxy replicas up",
                "Proxy replicas and vLLM servers Prometheus can scrape (the up metric of their jobs).",
                [
                    Target('sum(up{job="prefix-proxy"})', "prefix-proxy"),
                    Target('sum(up{job="vllm"})', "vllm"),
                ],
                unit="short",
                width=12,
                decimals=0,
            ),
        ],
    ),
]


def panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": panel.unit, "color": {"mode": "palette-classic"}}
    if panel.min is not None:
        defaults["min"] = panel.min
    if panel.max is not None:
        defaults["max"] = panel.max
    if panel.decimals is not None:
        defaults["decimals"] = panel.decimals
    if panel.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 20 if panel.stack else 0,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"mode": "normal" if panel.stack else "none", "group": "A"},
            "axisPlacement": "auto",
        }
        options: dict[str, Any] = {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    else:
        defaults["color"] = {"mode": "thresholds"}
        defaults["thresholds"] = {
            "mode": "absolute",
            "steps": [
                {"color": "red", "value": None},
                {"color": "orange", "value": 0.3},
                {"color": "green", "value": 0.6},
            ],
        }
        options = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "none",
            "justifyMode": "auto",
            "orientation": "auto",
            "textMode": "auto",
        }
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DS,
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": panel.overrides},
        "options": options,
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": DS,
                "expr": target.expr,
                "legendFormat": target.legend,
                "range": panel.kind == "timeseries",
                "instant": panel.kind != "timeseries",
            }
            for i, target in enumerate(panel.targets)
        ],
    }


def label_variable(name: str, label: str, metric: str) -> dict[str, Any]:
    query = f"label_values({metric}, {label})"
    return {
        "name": name,
        "label": name,
        "type": "query",
        "datasource": DS,
        "definition": query,
        "query": {"query": query, "refId": f"{name}-variable"},
        "refresh": 2,
        "sort": 1,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "hide": 0,
        "regex": "",
        "options": [],
    }


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    panel_id = 1
    y = 0
    for row_title, row_panels in ROWS:
        panels.append(
            {
                "id": panel_id,
                "type": "row",
                "title": row_title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        panel_id += 1
        y += 1
        x = 0
        line_height = 0
        for panel in row_panels:
            if x + panel.width > 24:
                x, y = 0, y + line_height
                line_height = 0
            panels.append(panel_json(panel, panel_id, x, y))
            panel_id += 1
            x += panel.width
            line_height = max(line_height, panel.height)
        y += line_height
    return {
        "title": "prefix-proxy",
        "uid": "prefix-proxy",
        "description": "Prefix-cache hit rate, savings, latency, sessions and health of prefix-proxy and vLLM "
        "(panel reference: docs/metrics.md).",
        "tags": ["prefix-proxy", "vllm", "llm"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "links": [],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                    "refresh": 1,
                    "regex": "",
                    "options": [],
                },
                label_variable("model", "model", "prefix_proxy_requests_total"),
                label_variable("tenant", "tenant", "prefix_proxy_requests_total"),
            ]
        },
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    print(render(), end="")
