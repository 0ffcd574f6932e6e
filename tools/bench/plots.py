"""Figures for `tpla bench` results (matplotlib, Agg backend, imported only when plotting)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tools.bench.attn_work import GPUS, MODES, device_work, shapes
from tools.bench.load import Arrival, level

GPU_BATCHES = (1, 64)  # the projection is a formula, so it can show a serving-size batch too


def plot_decode_attn(result: dict[str, Any], path: Path) -> None:
    """Figure-3-style: TPLA speedup over MLA-TP per device vs context, one panel per shape.

    Solid lines: CPU measurements, one colour per batch size; dashed, same colour: this CPU's
    roofline prediction for that batch. Dotted / dash-dotted: H100 and H200 projected from
    published peaks at batch 1 and 64, a roofline model and not a measurement.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    baseline, compared = MODES
    tpla = [r for r in result["rows"] if r["mode"] == compared]
    names = list(dict.fromkeys(r["shape"] for r in tpla))
    by_name = {s.name: s for s in shapes()}
    roof = result["roofline"]
    fig, axes = plt.subplots(1, len(names), figsize=(5.4 * len(names), 5.0), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, name in zip(axes[0], names, strict=True):
        rows = [r for r in tpla if r["shape"] == name]
        batches = sorted({r["batch"] for r in rows})
        for color, batch in zip(colors, batches, strict=False):
            rs = sorted((r for r in rows if r["batch"] == batch), key=lambda r: r["context"])
            ctx = [r["context"] for r in rs]
            ax.plot(
                ctx,
                [r["speedup_vs_mla_tp"] for r in rs],
                "o-",
                color=color,
                label=f"CPU measured, batch {batch}",
            )
            ax.plot(
                ctx,
                [r["predicted_speedup_cpu"] for r in rs],
                "--",
                color=color,
                alpha=0.8,
                label=f"CPU roofline prediction, batch {batch}",
            )
        contexts = sorted({r["context"] for r in rows})
        shape = by_name[name]
        for gpu, style in zip(GPUS, (":", "-."), strict=True):
            for batch, width in zip(GPU_BATCHES, (1.6, 3.0), strict=True):
                ratio = [
                    gpu.bound_seconds(device_work(shape, baseline, batch, c))
                    / gpu.bound_seconds(device_work(shape, compared, batch, c))
                    for c in contexts
                ]
                ax.plot(
                    contexts,
                    ratio,
                    style,
                    color="black",
                    lw=width,
                    label=f"{gpu.name}, batch {batch} (roofline model)",
                )
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [f"{c // 1024}K" for c in contexts])
        ax.set_xlabel("context length (tokens per sequence)")
        ax.set_ylabel("TPLA speedup over MLA-TP (per device, TP=2)")
        ax.set_title(
            f"{name}: TPLA {shape.heads} heads x ({shape.d_c // 2}+{shape.d_r}), "
            f"MLA-TP {shape.heads // 2} x ({shape.d_c}+{shape.d_r})",
            fontsize=9,
        )
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(
        "Absorbed decode attention per device, TPLA (r=2) vs MLA-TP: fp32 CPU measured "
        f"({roof['threads']} thread, ridge {roof['ridge_flop_per_byte']:.1f} flop/B)\n"
        "Black lines: H100 SXM (3.35 TB/s) and H200 (4.8 TB/s) at 989 TFLOP/s bf16: roofline "
        "model, not a measurement (the two coincide where both are memory-bound)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.13, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_serve(report: dict, path: Path) -> None:
    """Throughput, TPOT p99 and ITL p99 against the load, one row per request mix."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    closed = report["sweep"]["arrival"] == Arrival.CLOSED
    mixes = [m["name"] for m in report["sweep"]["mixes"]]
    fig, axes = plt.subplots(len(mixes), 3, figsize=(17, 4.2 * len(mixes)), squeeze=False)
    labels = list(dict.fromkeys(r["config"] for r in report["results"]))
    colors = {label: f"C{i}" for i, label in enumerate(labels)}
    for (ax_t, ax_p, ax_i), mix in zip(axes, mixes, strict=True):
        for config in labels:
            pts = [
                r
                for r in report["results"]
                if r["config"] == config and r["mix"] == mix and r["completed"]
            ]
            if not pts:
                continue
            xs = [level(r) for r in pts]
            kw = dict(color=colors[config], marker="o", label=config)
            ax_t.plot(xs, [r["output_tok_s"] for r in pts], **kw)
            ax_p.plot(xs, [r["tpot_p99_ms"] for r in pts], **kw)
            ax_i.plot(xs, [r["itl_p99_ms"] for r in pts], **kw)
        prompt = next(m for m in report["sweep"]["mixes"] if m["name"] == mix)
        what = f"{mix} mix ({prompt['prompt_tokens']} prompt, {prompt['max_tokens']} output tokens)"
        ax_t.set_title(f"Output throughput - {what}", fontsize=10)
        ax_p.set_title(f"TPOT p99 - {what}", fontsize=10)
        ax_i.set_title(f"ITL p99 - {what}", fontsize=10)
        ax_t.set_ylabel("output tokens / s")
        ax_p.set_ylabel("ms per output token (log)")
        ax_i.set_ylabel("ms between two output chunks (log)")
        for ax in (ax_t, ax_p, ax_i):
            if closed:
                ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent streams" if closed else "requests / s (Poisson arrivals)")
            ax.grid(True, which="both", alpha=0.3)
        for ax in (ax_p, ax_i):
            ax.set_yscale("log")
        ax_t.legend(fontsize=8)
    fig.suptitle(f"tpla bench serve - {report['model']} - {report['date']} (2-core CPU, fp32)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_disagg(report: dict[str, Any], path: Path | str) -> None:
    """`tpla bench serve --disagg`: TTFT p50 and TPOT p99 against streams, one column per mix,
    one line per policy at its rounds' median, the bars its rounds' spread."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = report["summary"]
    mixes = list(dict.fromkeys(e["mix"] for e in summary))
    policies = list(dict.fromkeys(e["policy"] for e in summary))
    metrics = (("ttft_p50_ms", "TTFT p50 (ms)"), ("tpot_p99_ms", "TPOT p99 (ms)"))
    fig, axes = plt.subplots(
        len(metrics), len(mixes), figsize=(4.6 * len(mixes), 7.6), squeeze=False
    )
    for col, mix in enumerate(mixes):
        for row, (metric, label) in enumerate(metrics):
            ax = axes[row][col]
            for policy in policies:
                es = sorted(
                    (e for e in summary if (e["mix"], e["policy"]) == (mix, policy)),
                    key=lambda e: e["streams"],
                )
                x = [e["streams"] for e in es]
                y = [e[metric] for e in es]
                low = [e[metric] - e[f"{metric}_spread"][0] for e in es]
                high = [e[f"{metric}_spread"][1] - e[metric] for e in es]
                ax.errorbar(x, y, yerr=[low, high], marker="o", capsize=3, label=policy)
            ax.set_xscale("log", base=2)
            ax.set_xticks([e for e in report["sweep"]["streams"]])
            ax.set_xticklabels([str(e) for e in report["sweep"]["streams"]])
            ax.set_yscale("log")
            ax.set_xlabel("streams")
            ax.set_ylabel(label)
            ax.set_title(f"{mix}: {label.split(' (')[0]}")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(title="TPLA_DISAGG_POLICY")
    rounds = report["sweep"]["rounds"]
    fig.suptitle(f"where prompts are prefilled: median of {rounds} rounds, bars their spread")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
