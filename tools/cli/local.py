"""`tpla generate --tp G`: exact MLA prefill here, decode in a rank group of G, in one
process tree (tools/local_driver.py drives the engine)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from common.loading.serving_model import load_prefill_model, load_prefill_mtp
from common.loading.side_file_choice import side_file_path
from common.model.generate import Generation
from common.parallel import parse_mode
from common.runtime.settings import Settings
from common.sampling.params import SamplingParams
from services.decode.engine import DecodeEngine
from tools.local_driver import collect, submit


def generate_distributed(
    model_dir: str,
    prompt_ids: list[int],
    params: SamplingParams,
    eos_ids: Sequence[int],
    args: argparse.Namespace,
    settings: Settings,
) -> Generation:
    """`tpla generate --tp G --latent-groups R`: exact prefill here, decode in a rank group."""
    from services.decode.config import engine_config

    # The oracle modes mla and gla split no latent; of the layouts, only tpla takes r.
    asked = args.latent_groups if args.mode in (None, "tpla") else 1
    r = parse_mode(args.parallel).latent_groups(asked)
    reparam = None
    if r > 1 and args.method != "identity":
        side = side_file_path(model_dir, f"tpla_{args.method}")
        if side.exists():
            reparam = side.stem
        else:
            print(
                f"note: no {side.name} in {model_dir}; TPLA uses the identity basis with e_i = 1/r",
                file=sys.stderr,
            )
    layout = settings.model_copy(
        update={
            "model": model_dir,
            "tp": args.tp,
            "latent_groups": r,
            "parallel": args.parallel,
            "rmsnorm": args.rmsnorm,
            "chunk_size": args.chunk_size,
            "reparam": reparam or "",
            "torch_threads": args.threads or 1,
        }
    )
    # One process tree, no services: no KV receivers, any free rendezvous port.
    cfg = dataclasses.replace(
        engine_config(layout),
        master_port=0,
        kv_port_base=None,
        internal_token=None,
        max_model_len=len(prompt_ids) + params.max_tokens,
    )
    with DecodeEngine(cfg, eos_token_ids=tuple(eos_ids)) as engine:
        # The exact prefill model, in the same (possibly rotated) latent basis as the ranks.
        prefill = load_prefill_model(
            cfg.model, cfg.reparam, cfg.dtype, cfg.kernels, cfg.device, cfg.weight_dtype
        )
        mtp = None
        if cfg.speculative.method == "mtp":
            mtp = load_prefill_mtp(cfg.model, cfg.reparam, prefill, cfg.dtype, cfg.device)
        [(first, stream)] = submit(engine, prefill, [prompt_ids], [params], mtp)
        result = collect(first, stream)
    tokens = [first] + [e.token for e in result.events if e.token is not None]
    return Generation(result.token_ids, tokens, result.finish_reason)
