"""The one place environment variables are read (prefix `TPLA_`); CLI flags override them."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TPLA_", extra="ignore")

    model: str = Field("models/demo", description="HF-format model directory")
    dtype: str = Field("float32", description="float32 | bfloat16 | float16")
    device: str = Field("cpu", description="cpu | cuda | cuda:N")
    # The local stack runs several processes on a small machine: each process gets a fixed
    # intra-op thread budget instead of torch's default of one thread per core.
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads per process")
    attention_backend: str = Field(
        "auto", description="prefill attention: auto | sdpa | flash-attn"
    )


def load_settings(**overrides: object) -> Settings:
    """Settings from the environment, with explicit (non-None) overrides applied."""
    return Settings(**{k: v for k, v in overrides.items() if v is not None})
