"""The protocols vLLM serves besides chat completions, mapped onto the chat pipeline.

Each protocol module converts its request into the chat shape the pipeline canonicalizes
(a *view*), and maps the canonical view back onto the client's own body, so what the backend
receives stays in the client's protocol and byte-identical wherever nothing changed.
"""
