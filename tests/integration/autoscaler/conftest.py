"""The autoscaler against the router rig's real Redis and router (tests/router_rig.py)."""

from __future__ import annotations

from tests.router_rig import anyio_backend, model_dir, redis_server, redis_url, tokenizer

__all__ = ["anyio_backend", "model_dir", "redis_server", "redis_url", "tokenizer"]
