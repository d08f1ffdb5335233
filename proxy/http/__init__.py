"""The HTTP edge: request context and body, the forwarding of a request upstream (failover, errors),
and the relay of the answer back (streamed unbuffered, or whole)."""
