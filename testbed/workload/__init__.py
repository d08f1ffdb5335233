"""A workload that reproduces how real clients break vLLM's prefix cache, from real content.

Scenarios (see ``testbed/workload/scenarios/``) are simulated client applications; each has
many multi-turn sessions whose assistant turns are the backend's own replies. The runner
sends them to any OpenAI-compatible server and reports prompt / cached tokens per scenario::

    from testbed.workload import run_workload
    results = run_workload("http://127.0.0.1:8080/v1", ["dify_rag", "fc_agent"],
                           sessions_per_scenario=8, seed=0)
    print(results["dify_rag"].hit_rate)
"""

from testbed.workload.registry import (
    Scenario,
    build_sessions,
    get_scenario,
    register_scenario,
    resolve_scenarios,
    scenario_names,
)
from testbed.workload.runner import (
    Exchange,
    RequestStat,
    ScenarioResult,
    overall,
    run_workload,
    run_workload_async,
)
from testbed.workload.session import Session

__all__ = [
    "Exchange",
    "RequestStat",
    "Scenario",
    "ScenarioResult",
    "Session",
    "build_sessions",
    "get_scenario",
    "overall",
    "register_scenario",
    "resolve_scenarios",
    "run_workload",
    "run_workload_async",
    "scenario_names",
]
