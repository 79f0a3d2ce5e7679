"""The engines' KV-cache events: a subscriber per worker feeding the precise prefix index."""
