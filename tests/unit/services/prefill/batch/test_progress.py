"""A prompt's progress: a chunked prompt keeps its pieces' latents in one buffer, which it
drops when released (finished or dropped); a prompt computed whole never holds one."""

from __future__ import annotations

import torch

from common.model.causal_lm import PastLatents
from services.prefill.batch.progress import PromptProgress


def test_release_drops_the_buffer_and_the_past() -> None:
    progress = PromptProgress(40, 16)
    cached = PastLatents([torch.ones(8, 4)], [torch.ones(8, 2)])
    progress.start([], cached)
    piece = progress.piece()
    progress.add([torch.full((piece, 4), 2.0)], [torch.full((piece, 2), 2.0)], 0)
    past = progress.past()
    assert past is not None and past.length == 8 + piece
    assert float(past.n[0][:8].sum()) == 32.0 and float(past.n[0][8:].mean()) == 2.0
    progress.release()
    assert progress.past() is None


def test_a_whole_prompt_holds_no_buffer() -> None:
    progress = PromptProgress(10, 0)
    progress.start([], None)
    progress.release()
    assert progress.past() is None and progress.piece() == 10
