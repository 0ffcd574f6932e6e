"""Colocated prefill + decode for `tpla bench serve`: the baseline disaggregation is against.

One decode group (the same engine, layout and weights as the disaggregated TPLA stack), and
the exact prefill model inside its leader process. As in a colocated server without chunked
prefill, a request's prefill runs *on the engine loop thread, between decode steps*: while a
prompt is prefilled every running sequence waits, which is precisely the interference that
disaggregation removes. The latent cache is then written locally (services/decode/local_kv.py,
no transfer) and the request joins the continuous batch. Timings are taken in-process, so this
baseline pays no HTTP, router or gRPC cost: any TPOT advantage of the disaggregated stack
over it is not an artifact of the client path.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

import torch

from common.loading.serving_model import load_prefill_model
from common.model.causal_lm import PrefillOutput
from common.parallel import ParallelConfig
from common.runtime.kernel_choice import kernel_config
from common.runtime.settings import load_settings
from common.sampling.params import SamplingParams
from common.sampling.sampler import first_tokens
from services.decode.config import EngineConfig
from services.decode.engine import DecodeEngine
from services.prefill.batch.threads import PrefillThreads
from tools.bench.stats import RequestTiming, gaps
from tools.local_driver import write_prompt


class ColocatedServer:
    """Thread-safe `request()`: any number of callers, one engine, prefill in its loop."""

    def __init__(
        self,
        model: str,
        reparam: str | None,
        tp: int,
        latent_groups: int,
        max_batch: int = 32,
    ) -> None:
        # The prefill runs as the stack's prefill worker runs it (the same settings: kernels,
        # thread policy), so that the two configurations differ only in placement.
        settings = load_settings()
        self.threads = PrefillThreads.from_settings(settings)
        cfg = EngineConfig(
            model=model,
            parallel=ParallelConfig(tp, latent_groups),
            reparam=reparam or None,
            master_port=0,
            max_batch=max_batch,
            kernels=kernel_config(settings),
        )
        self.engine = DecodeEngine(cfg)
        try:
            self.prefill_model = load_prefill_model(
                cfg.model, cfg.reparam, cfg.dtype, cfg.kernels, cfg.device
            )
        except BaseException:
            self.engine.shutdown()
            raise

    def close(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> ColocatedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _prefill_in_loop(self, prompt: Sequence[int]) -> PrefillOutput:
        ids = torch.tensor(list(prompt), dtype=torch.long)

        def run() -> PrefillOutput:
            with torch.no_grad(), self.threads.applied(len(prompt)):
                return self.prefill_model.prefill(ids, [len(prompt)])

        # The engine runs queued commands on its loop thread between steps (its only way to
        # touch engine state); a prefill queued there stalls decoding exactly as in a
        # colocated server that interleaves whole prefills with decode steps.
        return self.engine.run_between_steps(run)

    def request(self, prompt: Sequence[int], max_tokens: int) -> RequestTiming:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        try:
            rid = uuid.uuid4().hex
            reservation = self.engine.reserve(rid, len(prompt), max_tokens)
            out = self._prefill_in_loop(prompt)
            write_prompt(self.engine, reservation, out, 0, len(prompt))
            [first] = first_tokens(out.logits[0], params, position=len(prompt))
            times = [time.perf_counter()]
            reason = ""
            for event in self.engine.generate(rid, first.token_id, params):
                if event.token is not None:
                    times.append(time.perf_counter())
                reason = event.finish_reason or reason
            if reason.startswith("error"):
                raise RuntimeError(reason)
        except Exception as exc:  # a failed request is reported, never hangs the sweep
            elapsed = time.perf_counter() - t0
            return RequestTiming(elapsed, elapsed, 0, max_tokens, f"{type(exc).__name__}: {exc}")
        end = time.perf_counter()
        return RequestTiming(times[0] - t0, end - t0, len(times), max_tokens, itl_s=gaps(times))
