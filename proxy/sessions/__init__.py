"""Sessions: which conversation a request belongs to, and its record in the store (memory or Redis)."""
