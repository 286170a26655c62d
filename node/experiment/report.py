"""The experiment's outputs: results.json (every curve), results.md (tables), curves.png.

Tables give, per pair, node, split and variant, the FINAL accuracy (at the last
evaluation) and the BEST one (the highest evaluation of each seed), each as the mean
over seeds ± the sample standard deviation over seeds. The plot has one panel per node
and split (and one for the training reward), one line per variant: the mean over seeds,
with a band spanning the lowest to the highest seed.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["VARIANT_COLORS", "render_markdown", "summarize", "plot_curves", "write_report"]

# Fixed colours, so a variant looks the same in every figure; "alone" is the reference.
VARIANT_COLORS = {
    "alone": "#000000",
    "nois": "#d62728",
    "vis": "#ff7f0e",
    "tis": "#bcbd22",
    "f-nois": "#9467bd",
    "f-vis": "#17becf",
    "f-tis": "#2ca02c",
}
REWARD_WINDOW = 5  # rounds averaged for the reward column and the reward panel


def _mean_spread(values: list[float]) -> tuple[float, float]:
    arr = np.asarray(values, dtype=float)
    return float(arr.mean()), float(arr.std(ddof=1)) if arr.size > 1 else 0.0


def _grouped(results: dict[str, Any]) -> dict[tuple[str, int, str], list[dict[str, Any]]]:
    """(pair, node index, variant) -> that node's curves, one per seed."""
    out: dict[tuple[str, int, str], list[dict[str, Any]]] = defaultdict(list)
    for run in results["runs"]:
        for i, node in enumerate(run["nodes"]):
            out[(run["pair"], i, run["variant"])].append(node)
    return out


def summarize(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (pair, node, split, variant): final and best accuracy over seeds, and the reward."""
    rows = []
    for (pair, index, variant), nodes in _grouped(results).items():
        for split in nodes[0]["evals"]:
            finals = [n["evals"][split][-1][1] for n in nodes]
            bests = [max(v for _, v in n["evals"][split]) for n in nodes]
            rewards = [float(np.mean([r["reward_mean"] for r in n["rounds"][-REWARD_WINDOW:]])) for n in nodes]
            final, final_sd = _mean_spread(finals)
            best, best_sd = _mean_spread(bests)
            reward, reward_sd = _mean_spread(rewards)
            rows.append(
                {
                    "pair": pair,
                    "node": index,
                    "label": nodes[0]["label"],
                    "split": split,
                    "variant": variant,
                    "seeds": len(nodes),
                    "initial": nodes[0]["evals"][split][0][1],
                    "final": final,
                    "final_sd": final_sd,
                    "best": best,
                    "best_sd": best_sd,
                    "reward_last": reward,
                    "reward_last_sd": reward_sd,
                }
            )
    return rows


def _cell(mean: float, sd: float, seeds: int) -> str:
    return f"{mean:.3f} ± {sd:.3f}" if seeds > 1 else f"{mean:.3f}"


def render_markdown(results: dict[str, Any], rows: list[dict[str, Any]] | None = None) -> str:
    """The tables of results.md: per pair, variants down, (node, split) x (final, best) across."""
    rows = rows if rows is not None else summarize(results)
    cfg = results["config"]
    seeds = len(cfg["seeds"])
    sets = ", ".join(f"{k} = `{v['task']}` ({v['problems']} problems)" for k, v in results["eval_sets"].items())
    lines = [
        "# Experiment results",
        "",
        f"Greedy pass@1 on {sets}; "
        f"{cfg['rounds']} rounds, evaluated after steps {results['eval_steps']}; "
        f"{seeds} seed(s) {cfg['seeds']}" + (", mean ± sample std over seeds." if seeds > 1 else "."),
        f"Final = last evaluation, best = highest evaluation of each seed; reward = mean training reward "
        f"of the last {REWARD_WINDOW} rounds. G = {cfg['group_size']}, {cfg['prompts_per_round']} prompts per round, "
        f"C = {cfg['is_cap']}, g = {cfg['kl_threshold'] if cfg['kl_threshold'] is not None else 'default'} "
        f"({cfg['kl_reduction']}), peer share {cfg['peer_share']}.",
        "",
        f"Command: `{results.get('command') or '?'}` ({results['wall_seconds']:.0f} s).",
        "",
    ]
    by_pair: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_pair[row["pair"]].append(row)
    for pair, prow in by_pair.items():
        nodes = sorted({(r["node"], r["label"]) for r in prow})
        splits = list(dict.fromkeys(r["split"] for r in prow))
        variants = list(dict.fromkeys(r["variant"] for r in prow))
        index = {(r["node"], r["split"], r["variant"]): r for r in prow}
        lines += [f"## Pair `{pair}`", ""]
        head = ["variant"]
        for _, label in nodes:
            head += [f"{label} {s} final" for s in splits] + [f"{label} {s} best" for s in splits]
            head.append(f"{label} reward")
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        initial = ["*start*"]
        for n, _ in nodes:
            initial += [f"{index[(n, s, variants[0])]['initial']:.3f}" for s in splits] + [""] * len(splits) + [""]
        lines.append("| " + " | ".join(initial) + " |")
        for v in variants:
            cells = [f"**{v}**" if v == "f-tis" else v]
            for n, _ in nodes:
                cells += [_cell(index[(n, s, v)]["final"], index[(n, s, v)]["final_sd"], seeds) for s in splits]
                cells += [_cell(index[(n, s, v)]["best"], index[(n, s, v)]["best_sd"], seeds) for s in splits]
                r = index[(n, splits[0], v)]
                cells.append(_cell(r["reward_last"], r["reward_last_sd"], seeds))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    dht = results.get("dht_check")
    if dht:
        verdict = "identical" if dht["identical"] else ("agree" if dht["agree"] else "DISAGREE")
        lines += [
            "## In-process vs real DHT",
            "",
            f"Pair `{dht['dht']['pair']}`, variant `{dht['dht']['variant']}`, seed {dht['dht']['seed']}, "
            f"{dht['dht']['rounds']} rounds through two hivemind DHTs on 127.0.0.1 and through the "
            f"in-process exchange: **{verdict}** (tolerance {dht['tolerance']}).",
            "",
            "| node | max abs diff reward | max abs diff loss | max abs diff accuracy | peer samples/round (min) |",
            "|---|---|---|---|---|",
        ]
        for n in dht["nodes"]:
            lines.append(
                f"| {n['label']} | {n['reward_max_abs_diff']:.3g} | {n['loss_max_abs_diff']:.3g} | "
                f"{n['accuracy_max_abs_diff']:.3g} | {n['min_peer_samples']} |"
            )
        lines.append("")
    return "\n".join(lines)


def _band(curves: list[list[tuple[float, float]]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x, mean, low, high over seeds (curves share their x)."""
    x = np.array([p[0] for p in curves[0]], dtype=float)
    y = np.array([[p[1] for p in c] for c in curves], dtype=float)
    return x, y.mean(0), y.min(0), y.max(0)


def _smooth(y: list[float], window: int) -> list[float]:
    return [float(np.mean(y[max(0, i - window + 1) : i + 1])) for i in range(len(y))]


def plot_curves(results: dict[str, Any], path: str | Path, dpi: int = 80) -> Path:
    """curves.png: rows = (pair, node), columns = evaluation splits + training reward."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("the experiment plot needs matplotlib: pip install matplotlib") from e

    groups = _grouped(results)
    keys = list(dict.fromkeys((pair, i) for pair, i, _ in groups))
    variants = list(dict.fromkeys(v for _, _, v in groups))
    splits = list(next(iter(groups.values()))[0]["evals"])
    cols = len(splits) + 1
    fig, axes = plt.subplots(len(keys), cols, figsize=(3.6 * cols, 2.6 * len(keys)), squeeze=False)
    for row, (pair, i) in enumerate(keys):
        label = groups[(pair, i, variants[0])][0]["label"]
        for col in range(cols):
            ax = axes[row][col]
            for v in variants:
                nodes = groups.get((pair, i, v))
                if not nodes:
                    continue
                if col < len(splits):
                    curves = [[tuple(p) for p in n["evals"][splits[col]]] for n in nodes]
                else:
                    curves = [
                        list(enumerate(_smooth([r["reward_mean"] for r in n["rounds"]], REWARD_WINDOW))) for n in nodes
                    ]
                x, mean, low, high = _band(curves)
                color = VARIANT_COLORS.get(v)
                width = 2.0 if v in ("alone", "f-tis") else 1.2
                ax.plot(x, mean, color=color, lw=width, label=v)
                if len(nodes) > 1:
                    ax.fill_between(x, low, high, color=color, alpha=0.12, lw=0)
            if col == len(splits):
                what = f"train reward ({REWARD_WINDOW}-round mean)"
            elif splits[col].endswith("-sampled"):
                what = f"{splits[col].removesuffix('-sampled')} sampled reward (4 per problem)"
            else:
                what = f"{splits[col]} greedy pass@1"
            ax.set_title(f"{pair}: {label}\n{what}", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
            if row == len(keys) - 1:
                ax.set_xlabel("round", fontsize=7)
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=len(names), fontsize=8, frameon=False)
    seeds = len(results["config"]["seeds"])
    fig.suptitle(f"mean over {seeds} seed(s)" + (", band = seed range" if seeds > 1 else ""), fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    _to_palette(path)
    return path


def _to_palette(path: Path) -> None:
    """Re-save with a 256-colour palette: a third of the size, so the figure can live in git."""
    try:
        from PIL import Image
    except ImportError:  # matplotlib normally brings Pillow; without it the RGBA file stays
        return
    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)


def _finite(value: Any) -> Any:
    """JSON has no infinity: a missing comparison is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def write_report(results: dict[str, Any], out_dir: str | Path, plot: bool = True) -> dict[str, str]:
    """Write results.json, results.md and (plot) curves.png; returns their paths by kind."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = summarize(results)
    files = {"json": str(out / "results.json"), "markdown": str(out / "results.md")}
    if plot:
        files["plot"] = str(plot_curves(results, out / "curves.png"))
    payload = _finite({**results, "summary": rows, "files": files})
    Path(files["json"]).write_text(json.dumps(payload, indent=1))
    markdown = render_markdown(results, rows)
    if plot:
        markdown += "\n![curves](curves.png)\n"
    Path(files["markdown"]).write_text(markdown)
    return files
