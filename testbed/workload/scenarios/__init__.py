"""The built-in scenarios, registered in the order of ``BUILTIN``.

To add a scenario, write a module here that defines ``SCENARIO`` and append it below.
"""

from testbed.workload.registry import Scenario, register_scenario
from testbed.workload.scenarios import (
    append_only,
    coding_agent,
    constant_context,
    dify_rag,
    dify_workflow,
    fc_agent,
    inline_query,
    long_session,
    open_webui,
    responses_agent,
    sliding_window,
    stable_app,
    timestamp_user,
)

BUILTIN: tuple[Scenario, ...] = (
    dify_rag.SCENARIO,
    timestamp_user.SCENARIO,
    fc_agent.SCENARIO,
    inline_query.SCENARIO,
    stable_app.SCENARIO,
    sliding_window.SCENARIO,
    long_session.SCENARIO,
    append_only.SCENARIO,
    constant_context.SCENARIO,
    open_webui.SCENARIO,
    coding_agent.SCENARIO,
    coding_agent.COMMITS_SCENARIO,
    responses_agent.SCENARIO,
    dify_workflow.SCENARIO,
)

for _scenario in BUILTIN:
    register_scenario(_scenario)
