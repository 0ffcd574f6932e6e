"""The token -> text stream around stop strings: EOS hidden, logprobs aligned with the text."""

from __future__ import annotations

from common.sampling.sampler import SampledToken
from common.text.tokenizer import Tokenizer
from services.router.text import TextStream


def test_text_stream_hides_eos_and_aligns_logprobs(tokenizer: Tokenizer) -> None:
    eos = min(tokenizer.eos_token_ids)
    ids = [*tokenizer.encode("the quick brown"), eos]
    stream = TextStream(tokenizer, [], ["brown"], [eos], token_text=lambda i: f"<{i}>")
    outs = [stream.push(SampledToken(i, -0.5)) for i in ids[:-1]]
    assert stream.stopped
    final = stream.finish()
    texts = [o[0] for o in (*outs, final) if o is not None]
    assert "".join(texts) == "the quick "
    logprobs = [lp for o in (*outs, final) if o is not None for lp in o[1]]
    assert [lp.token for lp in logprobs] == [f"<{i}>" for i in ids[:-1]]
    assert stream.count == len(ids) - 1

    plain = TextStream(tokenizer, [], [], [eos])
    for i in ids:
        plain.push(SampledToken(i, 0.0))
    plain.finish()
    assert plain.text == "the quick brown" and plain.count == len(ids)
