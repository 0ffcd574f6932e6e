"""The TPLA decode engine as real multi-process gloo groups on loopback."""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import pytest
import torch

from common.group.comm import ShmCollectives
from common.loading.loader import load_model
from common.loading.serving_model import load_prefill_model
from common.messages import FailureScope, ResumedChoice
from common.model.contiguous_cache import ContiguousLatentCache
from common.model.generate import generate
from common.parallel import ParallelConfig, ParallelMode, RmsNormMode
from common.runtime.kernel_choice import KernelConfig
from common.sampling.params import SamplingParams
from common.sampling.sampler import first_tokens
from common.step_shapes import StepShape
from common.tpla.reference import AttentionSpec, ReferenceModel, Variant
from services.decode.config import EngineConfig
from services.decode.engine import DecodeEngine
from services.decode.local_kv import write_kv
from tests.tiny import save_hf
from tools.local_driver import collect, submit, write_prompt

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("engine-model")
    save_hf("v3-noaux-yarn", path, std=0.08)
    return path


def _engine(
    model_dir: Path,
    tp: int,
    r: int,
    collectives: str = "shm",
    kernel: str = "native",
    collective_timeout_s: float = 120.0,
    **kw: object,
) -> DecodeEngine:
    cfg = EngineConfig(
        model=str(model_dir),
        parallel=ParallelConfig(tp=tp, latent_groups=r, **kw),
        master_port=0,
        kv_budget_mb=2,
        block_size=4,
        record_logits=True,
        collectives=collectives,
        kernels=KernelConfig(decode_attention=kernel),
        collective_timeout_s=collective_timeout_s,
    )
    return DecodeEngine(cfg)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 160, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_pool_free(engine: DecodeEngine) -> None:
    load = engine.load()
    assert (load.running, load.waiting, load.reserved, load.blocks_used) == (0, 0, 0, 0)


@pytest.mark.parametrize(("collectives", "kernel"), [("shm", "native"), ("dist", "torch")])
def test_mla_tp2_equals_single_process(model_dir: Path, collectives: str, kernel: str) -> None:
    """Shared-memory collectives + native kernel (the defaults), and gloo + the PyTorch kernel:
    both give the single-process greedy tokens."""
    prompt = _prompt(23, 0)
    expected = generate(load_model(model_dir), prompt, GREEDY).token_ids
    with _engine(model_dir, tp=2, r=1, collectives=collectives, kernel=kernel) as engine:
        assert isinstance(engine.runtime.comm.data, ShmCollectives) == (collectives == "shm")
        assert engine.runtime.model.backend.name == kernel
        prefill = load_prefill_model(engine.cfg.model, engine.cfg.reparam)
        [(first, stream)] = submit(engine, prefill, [prompt], [GREEDY])
        result = collect(first, stream)
        assert result.token_ids == expected
        assert result.finish_reason == "length"
        _assert_pool_free(engine)


@pytest.mark.parametrize(
    ("tp", "r", "mode"), [(2, 2, RmsNormMode.EXACT), (4, 2, RmsNormMode.SLICED)]
)
def test_tpla_logits_match_oracle(model_dir: Path, tp: int, r: int, mode: RmsNormMode) -> None:
    prompt = _prompt(19, 1)
    model = load_model(model_dir)
    oracle = ReferenceModel(model, AttentionSpec(Variant.TPLA_PD, groups=r, rmsnorm=mode))
    with _engine(model_dir, tp=tp, r=r, rmsnorm=mode) as engine:
        prefill = load_prefill_model(engine.cfg.model, engine.cfg.reparam)
        [(first, stream)] = submit(engine, prefill, [prompt], [GREEDY])
        result = collect(first, stream)
        _assert_pool_free(engine)
    state = oracle.start()
    oracle.prefill(state, torch.tensor(prompt))
    fed = result.token_ids[:-1]  # each event's logits come from feeding the previous token
    assert len(fed) == len(result.events) == GREEDY.max_tokens - 1
    for token, event in zip(fed, result.events, strict=True):
        expected = oracle.decode(state, token)
        torch.testing.assert_close(event.logits, expected, atol=1e-5, rtol=0)
    mla = generate(model, prompt, GREEDY).token_ids
    assert result.token_ids != mla  # TPLA at r = 2 is an approximation, visibly so here


SP = {"mode": ParallelMode.SP, "chunk_size": 4}


@pytest.mark.parametrize("layout", ["tpla", "sp"])
def test_continuous_batching_and_aborts(model_dir: Path, layout: str) -> None:
    """8 requests joining at different steps decode exactly as each does alone."""
    lengths = [5, 31, 12, 20, 8, 27, 16, 3]
    prompts = [_prompt(n, 10 + i) for i, n in enumerate(lengths)]
    params = [SamplingParams(max_tokens=6 + i, temperature=0.0, ignore_eos=True) for i in range(8)]
    sampled = SamplingParams(max_tokens=9, temperature=0.9, top_p=0.9, seed=42, ignore_eos=True)
    kw = SP if layout == "sp" else {}
    with _engine(model_dir, tp=2, r=1 if layout == "sp" else 2, **kw) as engine:
        prefill = load_prefill_model(engine.cfg.model, engine.cfg.reparam)
        alone = [
            collect(*submit(engine, prefill, [p], [sp])[0]).token_ids
            for p, sp in zip(prompts, params, strict=True)
        ]
        seeded_alone = collect(*submit(engine, prefill, [prompts[0]], [sampled])[0]).token_ids
        _assert_pool_free(engine)

        started = []
        for i in range(0, 8, 2):  # join in pairs while earlier requests are mid-stream
            started += submit(engine, prefill, prompts[i : i + 2], params[i : i + 2])
            time.sleep(0.05)
        victim = submit(
            engine, prefill, [prompts[3]], [SamplingParams(max_tokens=40, ignore_eos=True)]
        )[0]
        seeded = submit(engine, prefill, [prompts[0]], [sampled])[0]
        victim_id = next(rid for rid, seq in engine.scheduler.seqs.items() if seq.max_tokens == 40)
        assert engine.abort(victim_id)
        together = [collect(*s).token_ids for s in started]
        assert together == alone
        assert collect(*seeded).token_ids == seeded_alone  # per-request seeds reproduce
        assert collect(*victim).finish_reason == "abort"
        _assert_pool_free(engine)


def test_cache_bytes_leases_and_bad_input(model_dir: Path) -> None:
    cfg = load_model(model_dir).config
    for r in (1, 2):
        with _engine(model_dir, tp=2, r=r) as engine:
            layout = engine.runtime.layout
            assert (
                layout.bytes_per_token_per_layer
                == (cfg.kv_lora_rank // r + cfg.qk_rope_head_dim) * 4
            )
            full = sum(p.numel() * p.element_size() for p in load_model(model_dir).parameters())
            assert 0 < engine.runtime.model.parameter_bytes() < full  # a rank keeps only its share
            if r == 2:
                res = engine.reserve("leased", prompt_len=10, max_tokens=5)
                assert [t.latent_width for t in res.targets] == [16, 16]
                assert engine.load().blocks_used == 4  # ceil(14 / 4)
                # An unclaimed reservation is freed once its lease runs out.
                engine.scheduler.seqs["leased"].lease_deadline = time.monotonic()
                deadline = time.monotonic() + 5
                while engine.load().blocks_used and time.monotonic() < deadline:
                    time.sleep(0.05)
                _assert_pool_free(engine)
                with pytest.raises(ValueError, match="exceeds the context limit"):
                    engine.reserve("huge", prompt_len=1000, max_tokens=100)
                with pytest.raises(ValueError, match="no open reservation"):
                    write_kv(engine, "nobody", 0, torch.zeros(1), torch.zeros(1))
                engine.reserve("shape", prompt_len=3, max_tokens=2)
                with pytest.raises(ValueError, match="expected"):
                    write_kv(engine, "shape", 1, torch.zeros(3, 2, 16), torch.zeros(3, 2, 8))
                assert engine.abort("shape")
                _assert_pool_free(engine)


@pytest.mark.parametrize("tp", [2, 4])
def test_sp_is_exact_and_splits_the_cache(model_dir: Path, tp: int) -> None:
    """SP over a prompt several chunks long, decoding across chunk boundaries: greedy tokens
    and every step's logits equal single-process MLA."""
    prompt = _prompt(29, 3)
    model = load_model(model_dir)
    with _engine(model_dir, tp=tp, r=1, **SP) as engine:
        cfg = model.config
        assert engine.runtime.layout.latent_width == cfg.kv_lora_rank  # full width per token
        prefill = load_prefill_model(engine.cfg.model, engine.cfg.reparam)
        [(first, stream)] = submit(engine, prefill, [prompt], [GREEDY])
        result = collect(first, stream)
        _assert_pool_free(engine)
        res = engine.reserve("split", prompt_len=29, max_tokens=4)
        # 32 tokens in chunks of 4: each of the tp ranks holds 32 / tp (blocks of 4).
        assert [len(t.block_ids) for t in res.targets] == [32 // tp // 4] * tp
        assert engine.abort("split")
    cache = ContiguousLatentCache(cfg, 1, len(prompt) + GREEDY.max_tokens)
    out = model.prefill(torch.tensor(prompt), [len(prompt)])
    cache.load_prefill(0, out, 0, len(prompt))
    fed = result.token_ids[:-1]
    for step, (token, event) in enumerate(zip(fed, result.events, strict=True)):
        pos = torch.tensor([len(prompt) + step])
        expected = model.decode(torch.tensor([token]), pos, cache)[0]
        torch.testing.assert_close(event.logits, expected, atol=1e-5, rtol=0)
    assert result.token_ids == generate(model, prompt, GREEDY).token_ids


def test_shutdown_ends_live_streams(model_dir: Path) -> None:
    """A stream open when the engine stops gets a final event instead of blocking forever."""
    engine = _engine(model_dir, tp=1, r=1)
    try:
        prefill = load_prefill_model(engine.cfg.model, engine.cfg.reparam)
        long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
        [(_, stream)] = submit(engine, prefill, [_prompt(8, 5)], [long])
    finally:
        engine.shutdown()
    events = list(stream)  # returns: the last event carries a finish reason
    assert events[-1].finish_reason == "error: decode engine shut down"
    assert events[-1].failure is FailureScope.GROUP  # the group's failure: it may migrate
    assert len(events) < long.max_tokens


@pytest.mark.parametrize("collectives", ["shm", "dist"])
def test_an_idle_group_outlives_its_collective_timeout(model_dir: Path, collectives: str) -> None:
    """Followers wait for plans inside a collective with a timeout: an idle leader pings them,
    so an idle group lives on; a follower that hangs while idle makes the ping stall like a
    step (the group reports itself stalled) and the group recovers when it resumes."""
    with _engine(model_dir, tp=2, r=1, collectives=collectives, collective_timeout_s=4.0) as engine:
        time.sleep(9.0)  # more than twice the timeout, with nothing to do
        assert engine.failed is None and all(engine.follower_alive())
        if collectives == "shm":  # a gloo broadcast need not wait for its receivers
            follower = engine.follower_pids[0]
            os.kill(follower, signal.SIGSTOP)
            try:
                time.sleep(2.5)  # a ping starts within a second and cannot finish
                assert engine.step_running_for() > 0.5
            finally:
                os.kill(follower, signal.SIGCONT)
            time.sleep(0.5)
            assert engine.step_running_for() < 0.5 and engine.failed is None
        prefill = load_prefill_model(engine.cfg.model, engine.cfg.reparam)
        [(first, stream)] = submit(engine, prefill, [_prompt(9, 3)], [GREEDY])
        assert collect(first, stream).finish_reason == "length"
        _assert_pool_free(engine)


def _submit_forked(engine: DecodeEngine, prefill, prompt: list[int], p: SamplingParams, n: int):
    """Prefill once, ship once, fork n choices (first tokens as the prefill worker draws them)."""
    out = prefill.prefill(torch.tensor(prompt), [len(prompt)])
    rid = uuid.uuid4().hex
    reservation = engine.reserve(rid, len(prompt), p.max_tokens, n=n)
    write_prompt(engine, reservation, out, 0, len(prompt))
    firsts = first_tokens(out.logits[0], p, n, position=len(prompt))
    return rid, firsts, engine.generate(rid, [t.token_id for t in firsts], p)


def _choices(firsts, stream) -> list[list[int]]:
    tokens = [[t.token_id] for t in firsts]
    for event in stream:
        if event.token is not None:
            tokens[event.index].append(event.token.token_id)
    return tokens


@pytest.mark.parametrize("layout", ["tpla", "mla-tp", "sp"])
def test_forked_choices_decode_as_separate_requests(model_dir: Path, layout: str) -> None:
    """n choices of one prompt (prefilled and shipped once, the last block copied on every
    rank) decode exactly as n = 1 requests: greedy choices all equal the n = 1 answer, a
    seeded choice 0 equals the n = 1 request and every choice reproduces; aborting the
    request ends every fork; no block is left."""
    kw = SP if layout == "sp" else {}
    prompt = _prompt(13, 7)  # 13 tokens: the last block (of 4) is partly filled
    greedy = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=7, temperature=1.0, seed=5, ignore_eos=True)
    with _engine(model_dir, tp=2, r=2 if layout == "tpla" else 1, **kw) as engine:
        prefill = load_prefill_model(engine.cfg.model, engine.cfg.reparam)
        alone = collect(*submit(engine, prefill, [prompt], [greedy])[0]).token_ids
        _, firsts, stream = _submit_forked(engine, prefill, prompt, greedy, 3)
        assert _choices(firsts, stream) == [alone] * 3
        seeded_alone = collect(*submit(engine, prefill, [prompt], [seeded])[0]).token_ids
        _, firsts, stream = _submit_forked(engine, prefill, prompt, seeded, 3)
        first_run = _choices(firsts, stream)
        _, firsts, stream = _submit_forked(engine, prefill, prompt, seeded, 3)
        assert _choices(firsts, stream) == first_run
        assert first_run[0] == seeded_alone and len({tuple(c) for c in first_run}) > 1
        _assert_pool_free(engine)
        long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
        rid, firsts, stream = _submit_forked(engine, prefill, prompt, long, 3)
        assert engine.abort(rid)
        ends = [e for e in stream if e.finish_reason is not None]
        assert sorted(e.index for e in ends) == [0, 1, 2]
        assert {e.finish_reason for e in ends} == {"abort"}
        _assert_pool_free(engine)


def _resume(
    engine: DecodeEngine,
    prefill,
    prompt: list[int],
    p: SamplingParams,
    firsts: list[int],
    resumed: list[ResumedChoice],
):
    """A migrated request's live choices on a group: the prompt prefilled and shipped once,
    one fork per resumed choice, each from its own first token."""
    out = prefill.prefill(torch.tensor(prompt), [len(prompt)])
    rid = uuid.uuid4().hex
    reservation = engine.reserve(rid, len(prompt), p.max_tokens, n=len(resumed))
    write_prompt(engine, reservation, out, 0, len(prompt))
    return rid, engine.generate(rid, firsts, p, resumed=resumed)


def test_resumed_choices_continue_as_undisturbed(model_dir: Path) -> None:
    """A migrated n > 1 request's live choices (forked anew from the prompt, each replaying
    its own tokens after its first) continue exactly as without the move: greedy, penalized
    and seeded alike (each draw is keyed by its choice and position, so nothing needs
    advancing over the replayed tokens). A finished choice is not resumed; a resumed choice
    is aborted by its index in the request; no block is left."""
    prompt = _prompt(13, 7)
    greedy = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    penalized = SamplingParams(
        max_tokens=7, temperature=0.0, ignore_eos=True, frequency_penalty=1.0, presence_penalty=1
    )
    seeded = SamplingParams(max_tokens=7, temperature=1.0, seed=5, ignore_eos=True)
    with _engine(model_dir, tp=2, r=2) as engine:
        prefill = load_prefill_model(engine.cfg.model, engine.cfg.reparam)
        for p in (greedy, penalized, seeded):
            _, firsts, stream = _submit_forked(engine, prefill, prompt, p, 3)
            whole = _choices(firsts, stream)
            # Choice 1 finished; choices 0 and 2 had sent 3 and 5 tokens.
            cut = {0: 3, 2: 5}
            firsts = [whole[i][0] for i in cut]
            resumed = [ResumedChoice(i, tuple(whole[i][1:k])) for i, k in cut.items()]
            _, stream = _resume(engine, prefill, prompt, p, firsts, resumed)
            got = {i: whole[i][:k] for i, k in cut.items()}
            ends = []
            for event in stream:
                if event.token is not None:
                    got[event.index].append(event.token.token_id)
                if event.finish_reason is not None:
                    ends.append((event.index, event.finish_reason))
            assert got == {0: whole[0], 2: whole[2]}, p
            assert sorted(ends) == [(0, "length"), (2, "length")]
        assert len({tuple(c) for c in whole}) > 1  # seeded: the choices differ
        _assert_pool_free(engine)
        long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
        rid, stream = _resume(engine, prefill, prompt, long, [5], [ResumedChoice(2, (6, 7))])
        assert engine.abort(rid, frozenset({2}))
        assert [e.finish_reason for e in stream if e.finish_reason] == ["abort"]
        _assert_pool_free(engine)


@pytest.mark.parametrize("layout", ["tpla", "sp"])
def test_warm_up_steps_every_bucket_and_leave_no_trace(model_dir: Path, layout: str) -> None:
    """The start-up warm-up (run on CUDA, where it compiles kernels and captures graphs) is a
    padded step at every bucket on every rank: it writes only the trash slot, so requests
    decode the same tokens after it, and no block is taken."""
    par = ParallelConfig(tp=2, latent_groups=2) if layout == "tpla" else ParallelConfig(tp=2, **SP)
    cfg = EngineConfig(
        model=str(model_dir),
        parallel=par,
        master_port=0,
        kv_budget_mb=2,
        block_size=4,
        max_batch=4,
        max_model_len=48,
    )
    prompts = [_prompt(n, 30 + n) for n in (5, 14, 9)]
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)] * 3
    with DecodeEngine(cfg) as engine:
        assert engine.shapes[0] == StepShape(4, 12) and engine.shapes[-1] == StepShape(1, 12)
        prefill = load_prefill_model(engine.cfg.model, engine.cfg.reparam)
        before = [collect(*s).token_ids for s in submit(engine, prefill, prompts, params)]
        engine.warm_up()
        _assert_pool_free(engine)
        after = [collect(*s).token_ids for s in submit(engine, prefill, prompts, params)]
    assert after == before
