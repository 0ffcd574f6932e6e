"""KV pushes over the torch transport land on a decode group's receiver threads while its loop
runs decode steps (gloo here: the data group's collectives on the loop thread, the pairs'
receives on the receivers' gRPC threads, the order docs/design.md §5 writes down for NCCL).
Neither disturbs the other: the stream decoding meanwhile keeps the tokens and logits it has
alone, and the prompt pushed meanwhile decodes as one written in process does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.pushes_during_steps import LONG, logits, pushes_during_steps
from tests.tiny import save_hf


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pushes-model")
    save_hf("v2-group-yarn", path, std=0.08)
    return path


def test_pushes_on_receiver_threads_during_decode_steps(model_dir: Path) -> None:
    run = pushes_during_steps(model_dir)
    assert run.steps >= LONG.max_tokens - 1
    assert len(run.pushes) >= 4 and all(n > 0 for n in run.pushes)
    assert run.meanwhile.token_ids == run.alone.token_ids
    for a, b in zip(logits(run.alone), logits(run.meanwhile), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert run.pushed == run.written
