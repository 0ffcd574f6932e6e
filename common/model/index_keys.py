"""How indexer keys are stored in a cache row (TPLA_INDEX_CACHE_DTYPE), and what a score
reads back from them.

- `model`: the key in the model's dtype, d_I values: HF-exact.
- `fp8`: DeepSeek's format (common/model/fp8_index.py, its reference): the key rotated by a
  Hadamard matrix, e4m3 with one power-of-two scale, packed as d_I bytes then the scale's 4
  (132 bytes at d_I = 128, against 256 in bf16); the queries are rotated and quantized alike.

A format encodes keys once (prefill for a prompt, the decode step for each new token; the
encoding is deterministic, so both agree) and decodes them, tile by tile, into fp32 for
`index_scores`. Math only.
"""

from __future__ import annotations

import abc

import torch
from torch import Tensor

from common.model.args import ModelConfig
from common.model.fp8_index import act_quant, hadamard

FORMATS = ("model", "fp8")


class IndexKeyFormat(abc.ABC):
    """One way of holding [*, d_I] indexer keys as cache rows [*, width] of `dtype`."""

    name: str

    def __init__(self, head_dim: int, model_dtype: torch.dtype) -> None:
        self.head_dim, self.model_dtype = head_dim, model_dtype

    @property
    @abc.abstractmethod
    def width(self) -> int:
        """Elements of `dtype` a key takes."""

    @property
    @abc.abstractmethod
    def dtype(self) -> torch.dtype:
        """The cache rows' dtype."""

    @property
    def row_bytes(self) -> int:
        return self.width * torch.empty((), dtype=self.dtype).element_size()

    @abc.abstractmethod
    def encode(self, keys: Tensor) -> Tensor:
        """Keys [*, d_I] -> cache rows [*, width]."""

    @abc.abstractmethod
    def decode(self, rows: Tensor) -> Tensor:
        """Cache rows [*, width] -> the keys a score reads, fp32 [*, d_I]."""

    @abc.abstractmethod
    def queries(self, q: Tensor) -> Tensor:
        """Index queries [*, H, d_I] as the score pairs them with decoded keys."""


class ModelDtypeKeys(IndexKeyFormat):
    name = "model"

    @property
    def width(self) -> int:
        return self.head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.model_dtype

    def encode(self, keys: Tensor) -> Tensor:
        return keys.to(self.model_dtype)

    def decode(self, rows: Tensor) -> Tensor:
        return rows.float()

    def queries(self, q: Tensor) -> Tensor:
        return q


class Fp8Keys(IndexKeyFormat):
    name = "fp8"

    @property
    def width(self) -> int:
        return self.head_dim + 4

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8

    def encode(self, keys: Tensor) -> Tensor:
        q, scale = act_quant(hadamard(keys.to(self.model_dtype)))
        packed = torch.cat((q.view(torch.uint8), scale.contiguous().view(torch.uint8)), dim=-1)
        return packed.contiguous()

    def decode(self, rows: Tensor) -> Tensor:
        d = self.head_dim
        values = rows[..., :d].contiguous().view(torch.float8_e4m3fn).float()
        scale = rows[..., d:].contiguous().view(torch.float32)
        return values * scale

    def queries(self, q: Tensor) -> Tensor:
        q8, scale = act_quant(hadamard(q.to(self.model_dtype)))
        return q8.float() * scale


def index_format(config: ModelConfig, name: str, model_dtype: torch.dtype) -> IndexKeyFormat | None:
    """The key format `name` of a model's indexer keys; None for a model without DSA."""
    if config.dsa is None:
        return None
    return key_format(name, config.dsa.index_head_dim, model_dtype)


def key_format(name: str, head_dim: int, model_dtype: torch.dtype) -> IndexKeyFormat:
    """The format TPLA_INDEX_CACHE_DTYPE names (ValueError naming the choices)."""
    if name == "model":
        return ModelDtypeKeys(head_dim, model_dtype)
    if name == "fp8":
        if head_dim > 128 or head_dim & (head_dim - 1):
            # One quantization block a key: DeepSeek's d_I = 128.
            raise ValueError(f"fp8 index keys need d_I a power of two <= 128, not {head_dim}")
        return Fp8Keys(head_dim, model_dtype)
    raise ValueError(f"index cache dtype {name!r} is not one of {FORMATS}")
