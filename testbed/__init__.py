"""Development tooling, never imported by the proxy's request path: a vLLM-faithful fake backend
(``testbed.fakevllm``), the traffic workload (``testbed.workload``) and ``prefix-proxy demo``."""
