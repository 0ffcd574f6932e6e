"""`tpla generate`: one process, no services; the distributed engine with --tp, the
single-process TPLA oracle with --mode."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from common.parallel import LAYOUT_NAMES, RMSNORM_MODES, ParallelMode
from common.runtime.settings import Settings, load_settings, placed
from tools.cli.tpla import METHODS

if TYPE_CHECKING:  # heavy imports stay lazy: `tpla --help` must not import torch
    from common.model.causal_lm import DeepseekForCausalLM
    from common.model.generate import Generation
    from common.sampling.params import SamplingParams
    from common.text.tokenizer import Tokenizer

MODES = ("mla", "tpla", "tpla-pd", "gla")  # the oracle's variants (common/tpla/reference.py)


def _configure_torch(settings: Settings) -> None:
    import torch

    torch.set_num_threads(settings.torch_threads)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as exc:
        raise SystemExit(f"--prompt-ids must be comma-separated integers: {exc}") from exc


def cmd_generate(args: argparse.Namespace) -> int:
    from common.loading.loader import load_model, serving_dtype
    from common.loading.serving_kernels import PrefillKernels
    from common.model.args import ModelConfig
    from common.model.generate import generate
    from common.runtime.kernel_choice import kernel_config
    from common.sampling.params import SamplingParams
    from common.text.tokenizer import Tokenizer

    settings = placed(
        load_settings(
            model=args.model, dtype=args.dtype, device=args.device, torch_threads=args.threads
        )
    )
    _configure_torch(settings)
    config = ModelConfig.from_dir(settings.model)
    tokenizer = None
    if args.prompt is not None:
        tokenizer = Tokenizer.from_dir(settings.model)
        prompt_ids = tokenizer.encode(args.prompt)
    else:
        prompt_ids = _parse_ids(args.prompt_ids)
    eos = set(config.eos_token_ids)
    if tokenizer is not None:
        eos |= tokenizer.eos_token_ids
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    if args.tp is not None:  # the engine's ranks load their own shares of the weights
        from tools.cli.local import generate_distributed

        result = generate_distributed(
            settings.model, prompt_ids, params, sorted(eos), args, settings
        )
        return _print_generation(args, settings, tokenizer, result)
    dtype = serving_dtype(settings.dtype)
    kernels = PrefillKernels.select(kernel_config(settings), settings.device, dtype)
    model = load_model(settings.model, dtype=dtype, device=settings.device)
    kernels.weights.apply(model)
    model.prefill_attention = kernels.attention_backend()
    if args.mode is not None:
        result = generate_with_mode(model, settings.model, prompt_ids, params, sorted(eos), args)
    else:
        result = generate(model, prompt_ids, params, eos_ids=sorted(eos), path=args.path)
    return _print_generation(args, settings, tokenizer, result)


def _print_generation(
    args: argparse.Namespace, settings: Settings, tokenizer: Tokenizer | None, result: Generation
) -> int:
    from common.text.tokenizer import Tokenizer

    text = None
    if tokenizer is None:
        try:
            tokenizer = Tokenizer.from_dir(settings.model)
        except ValueError:
            tokenizer = None  # a weights-only directory still generates ids
    if tokenizer is not None:
        text = tokenizer.decode(result.token_ids)
    if args.json:
        print(
            json.dumps(
                {"token_ids": result.token_ids, "text": text, "finish_reason": result.finish_reason}
            )
        )
    else:
        print(
            args.prompt + text
            if args.prompt is not None and text is not None
            else (text if text is not None else " ".join(map(str, result.token_ids)))
        )
    return 0


def add_generate_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    gen = sub.add_parser("generate", help="generate from a model in one process (no services)")
    gen.add_argument("--model", help="model directory (default: TPLA_MODEL or models/demo)")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (encoded with the model's tokenizer)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument(
        "--path",
        choices=["absorbed", "expanded"],
        default="absorbed",
        help="absorbed: latent-cache decode; expanded: full recompute reference",
    )
    gen.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    gen.add_argument("--device")
    gen.add_argument("--threads", type=int, help="torch threads (default TPLA_TORCH_THREADS or 1)")
    gen.add_argument("--json", action="store_true", help="last stdout line is a JSON object")
    gen.add_argument(
        "--parallel",
        choices=LAYOUT_NAMES,
        default=ParallelMode.TPLA.value,
        help="with --tp: split the cache by latent columns (tpla), not at all (mla-tp), "
        "or by token chunks (sp, exact)",
    )
    gen.add_argument("--chunk-size", type=int, default=256, help="SP tokens per chunk")
    gen.add_argument(
        "--tp",
        type=int,
        help="run the distributed decode engine with this many "
        "ranks (TPLA with --latent-groups; --latent-groups 1 is MLA-TP)",
    )
    _add_mode_arguments(gen)
    gen.set_defaults(func=cmd_generate)


def _add_mode_arguments(p: argparse.ArgumentParser) -> None:
    """The TPLA options of `tpla generate` (absent --mode keeps the plain engine path)."""
    p.add_argument(
        "--mode",
        choices=MODES,
        help="run the single-process oracle: mla, tpla (prompt sliced too), tpla-pd (exact "
        "prompt, sliced decode, as the served engine), gla",
    )
    p.add_argument("--latent-groups", type=int, default=2, help="latent groups r for tpla/gla")
    p.add_argument("--method", choices=METHODS, default="pca", help="latent basis (side file)")
    p.add_argument("--rmsnorm", choices=RMSNORM_MODES, default="exact")


def generate_with_mode(
    model: DeepseekForCausalLM,
    model_dir: str | Path,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    eos_ids: Sequence[int],
    args: argparse.Namespace,
) -> Generation:
    """`tpla generate --mode ...`: reparameterize from the side file, generate with the oracle."""
    from common.loading.side_file import Method
    from common.parallel import RmsNormMode
    from common.tpla.convert import load_reparameterization
    from common.tpla.reference import AttentionSpec, ReferenceModel, Variant, generate

    variant = Variant(args.mode)
    groups = 1 if variant is Variant.MLA else args.latent_groups
    spectra = None
    if variant.sliced_latents:
        spectra = load_reparameterization(model, model_dir, Method(args.method))
    oracle = ReferenceModel(
        model, AttentionSpec(variant, groups, RmsNormMode(args.rmsnorm)), spectra
    )
    return generate(oracle, prompt_ids, params, eos_ids=eos_ids)
