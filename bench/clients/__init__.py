"""Real coding agents and chat clients against the fake (or real) vLLM, directly and through the proxy.

``python -m bench.clients --clients claude-code,codex,opencode,qwen-code,aider --turns 4``; see
docs/clients.md.
"""
