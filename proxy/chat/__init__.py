"""One conversation turn through the proxy: session, budget, summary (compaction), accounting."""
