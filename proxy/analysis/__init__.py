"""``prefix-proxy analyze``: what each canonicalization mode would save on captured traffic."""
