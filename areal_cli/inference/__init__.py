"""Local inference: a tiny-model builder, a continuous-batching engine and its HTTP server."""
