"""The router's app in process, with no workers: the rig's fixtures (tests/router_rig.py) that
need no Redis and no gRPC."""

from __future__ import annotations

from tests.router_rig import anyio_backend, client, model_dir, tokenizer

__all__ = ["anyio_backend", "client", "model_dir", "tokenizer"]
