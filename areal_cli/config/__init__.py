"""Recipe schema, allocation grammar, loading and validation."""
