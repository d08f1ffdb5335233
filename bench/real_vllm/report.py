"""Markdown for a `bench.real_vllm.compare.compare` result (plus the run's configuration)."""

from __future__ import annotations

from typing import Any


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _s(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _n(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _signed(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:+.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def hit_table(scenarios: dict[str, dict[str, Any]]) -> str:
    header = [
        "scenario",
        "requests d/p",
        "errors d/p",
        "prompt tok direct",
        "cached direct: usage / metrics",
        "hit direct",
        "prompt tok proxied",
        "cached proxied: usage / metrics",
        "hit proxied",
        "fake hit direct",
        "fake hit proxied",
        "proxied − fake",
    ]
    rows = []
    for name, row in scenarios.items():
        d, p = row["direct"], row["proxied"]
        fd, fp = row.get("fake_direct") or {}, row.get("fake_proxied") or {}
        rows.append(
            [
                f"**{name}**" if name == "overall" else name,
                f"{d['requests']}/{p['requests']}",
                f"{d['errors']}/{p['errors']}",
                _n(d["prompt_tokens"]),
                f"{_n(d['cached_tokens'])} / {_n(d.get('metrics_hits'))}",
                _pct(d["hit_rate"]),
                _n(p["prompt_tokens"]),
                f"{_n(p['cached_tokens'])} / {_n(p.get('metrics_hits'))}",
                _pct(p["hit_rate"]),
                _pct(fd.get("hit_rate")),
                _pct(fp.get("hit_rate")),
                "-" if "proxied_minus_fake_pp" not in row else f"{row['proxied_minus_fake_pp']:+.1f} pp",
            ]
        )
    return _table(header, rows)


def agreement_table(scenarios: dict[str, dict[str, Any]]) -> str:
    header = [
        "scenario",
        "direct: usage prompt / metrics queries",
        "direct: usage cached − metrics hits",
        "proxied: usage prompt / metrics queries",
        "proxied: usage cached − metrics hits",
        "engine requests d/p",
    ]
    rows = []
    for name, row in scenarios.items():
        d, p = row["direct"], row["proxied"]
        rows.append(
            [
                name,
                f"{_n(d['prompt_tokens'])} / {_n(d.get('metrics_queries'))}",
                _n(d.get("usage_minus_metrics_hits")),
                f"{_n(p['prompt_tokens'])} / {_n(p.get('metrics_queries'))}",
                _n(p.get("usage_minus_metrics_hits")),
                f"{_n(d.get('engine_requests'))}/{_n(p.get('engine_requests'))}",
            ]
        )
    return _table(header, rows)


def latency_table(scenarios: dict[str, dict[str, Any]]) -> str:
    header = [
        "scenario",
        "TTFT direct p50 / p95 (s)",
        "TTFT proxied p50 / p95 (s)",
        "p50 proxied/direct",
        "prefill tok direct / proxied",
        "vLLM prefill time direct / proxied (s)",
        "prefill time saved: vLLM / client TTFT / fit (s)",
        "proxy overhead (ms)",
    ]
    rows = []
    for name, row in scenarios.items():
        d, p = row["direct"], row["proxied"]
        rows.append(
            [
                f"**{name}**" if name == "overall" else name,
                f"{_s(d['ttft_median_s'])} / {_s(d['ttft_p95_s'])}",
                f"{_s(p['ttft_median_s'])} / {_s(p['ttft_p95_s'])}",
                _s(row.get("ttft_median_ratio"), 2),
                f"{_n(d['prefill_tokens'])} / {_n(p['prefill_tokens'])}",
                f"{_s(d.get('engine_prefill_time_s'), 1)} / {_s(p.get('engine_prefill_time_s'), 1)}",
                f"{_s(row.get('engine_prefill_time_saved_s'), 1)} / {_s(row.get('client_ttft_sum_saved_s'), 1)}"
                f" / {_s(row.get('fit_prefill_time_saved_s'), 1)}",
                _s(p.get("proxy_overhead_ms_mean"), 1),
            ]
        )
    return _table(header, rows)


def targets_section(result: dict[str, Any]) -> str:
    targets = result["targets"]
    lines = []
    hv = targets.get("hit_rate_vs_fake")
    if hv:
        lines.append(
            f"- {'MET' if hv['met'] else 'NOT MET'}: overall hit rate through the proxy on vLLM "
            f"{_pct(hv['vllm_proxied_hit_rate'])} vs the fake backend's prediction {_pct(hv['fake_proxied_hit_rate'])}"
            f" ({hv['difference_pp']:+.1f} pp; target within ±{hv['tolerance_pp']:.0f} pp)"
        )
    th = targets["ttft_median_halved"]
    parts = ", ".join(f"{name} {_s(v['ratio'], 2)}" for name, v in th["per_scenario"].items())
    lines.append(
        f"- {'MET' if th['met'] else 'NOT MET'}: TTFT median through the proxy ≤ {th['target_ratio']:.1f}× direct on "
        f"the scenarios direct traffic misses (direct hit rate < {_pct(th['direct_hit_rate_below'])}): {parts or '-'}"
    )
    ua = targets.get("usage_agrees_with_metrics")
    if ua:
        lines.append(
            f"- {'MET' if ua['met'] else 'NOT MET'}: `usage.prompt_tokens_details.cached_tokens` and `prompt_tokens` "
            "sum to exactly the `vllm:prefix_cache_hits_total` / `..._queries_total` deltas, every scenario and side"
        )
    ne = targets["no_errors"]
    lines.append(f"- {'MET' if ne['met'] else 'NOT MET'}: no failed requests ({ne['errors']} errors)")
    agreement = result.get("per_request_vs_fake")
    if agreement:
        counts = ", ".join(f"{side} {a['identical']} of {a['requests']}" for side, a in agreement.items())
        lines.append(f"- Per request, vLLM and the fake backend reported the same prompt and cached tokens: {counts}")
    fit = result.get("ttft_fit")
    if fit:
        lines.append(
            f"- TTFT fit over every vLLM request: {fit['intercept_s'] * 1000:.0f} ms + "
            f"{fit['seconds_per_prefill_token'] * 1e6:.0f} µs per computed prompt token "
            "(the 'fit' column multiplies the prefill tokens saved by it)"
        )
    return "\n".join(lines)


def markdown(result: dict[str, Any], config: dict[str, Any]) -> str:
    scenarios = result["scenarios"]
    c = config
    head = (
        f"# prefix-proxy on a real vLLM ({c.get('vllm_version', '?')}, CPU, `{c['preset']}` model, "
        f"{c['block_size']}-token blocks)\n\n"
        f"sessions per scenario {c['sessions']}, seed {c['seed']}, max_tokens {c['max_tokens']}, "
        f"concurrency {c['concurrency']}, streaming; direct and proxied runs isolated by `cache_salt`; "
        f"proxy with its default settings. Fake backend: same sessions, the engine's tokenizer, "
        f"{c['block_size']}-token blocks, KV pool {_n(c.get('kv_cache_tokens'))} tokens. "
        f"Run {c.get('started', '')}, wall {c.get('wall_s', 0):.0f} s "
        f"(vLLM start-up {c.get('startup_s', 0):.0f} s).\n"
    )
    return (
        "\n\n".join(
            [
                head,
                "## Targets\n\n" + targets_section(result),
                "## Prefix-cache hits as vLLM reports them\n\n"
                "cached = `usage.prompt_tokens_details.cached_tokens` summed / `vllm:prefix_cache_hits_total` delta; "
                "hit = cached / prompt tokens.\n\n" + hit_table(scenarios),
                "## Time to first token and prefill\n\n"
                "TTFT at the client (streaming, to the first token event). vLLM prefill time = "
                "`vllm:request_prefill_time_seconds` sum delta. Saved = direct − proxied.\n\n"
                + latency_table(scenarios),
                "## usage vs /metrics\n\n" + agreement_table(scenarios),
            ]
        )
        + "\n"
    )
