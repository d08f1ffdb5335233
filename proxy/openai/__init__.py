"""The OpenAI chat protocol's data: messages, usage, the assistant's reply, JSON as the wire has it.

A leaf: it imports nothing else from the proxy, so every part (and ``summarizer``) may import it.
"""
