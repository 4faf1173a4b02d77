"""Jobs (ADR 0016)."""
