"""The router against scripted gRPC workers: the rig's fixtures (tests/router_rig.py)."""

from __future__ import annotations

from tests.router_rig import anyio_backend, client, model_dir, redis_server, redis_url, tokenizer

__all__ = ["anyio_backend", "client", "model_dir", "redis_server", "redis_url", "tokenizer"]
