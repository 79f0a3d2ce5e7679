"""The lowest layer: value types and byte helpers that the gateway, the adapters and the
policies share (a parsed client request, an answer's summary, the worker and route types, the
gateway's errors, JSON-bytes and lax-scalar helpers). It imports nothing of this project, so
every arrow points down to it (docs/architecture.md, "Layers")."""
