"""The swarm-gain bench's figures: the summary JSON, the markdown table and the plot.

Each shared configuration is compared with isolation node by node (same swarm, seed and
node: the same prompts every round): the ratio of cumulative training rewards, and the
held-out and OOD reward after training minus isolation's. Means are over nodes, then
over seeds; the weakest node is the one with the lowest isolation cumulative reward.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

__all__ = ["summarize_gain", "write_gain_report"]

SAPO_RATIO = 1.94  # SAPO's +94 % cumulative reward over isolation (4/4)


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def _load_runs(runs_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(Path(runs_dir).glob("*.json"))]


def _config_name(loss: str, share: float) -> str:
    from node.bench.swarm_gain import mix_label

    return "isolation 8/0" if loss == "alone" else f"{loss} {mix_label(share)}"


def summarize_gain(settings, runs_dir: Path, command: str = "") -> dict[str, Any]:
    """Per swarm and configuration: the comparison with isolation; plus the headline keys."""
    runs = _load_runs(runs_dir)
    iso = {(r["swarm"], r["seed"]): r for r in runs if r["loss"] == "alone"}
    configs: list[dict[str, Any]] = []
    for swarm in settings.swarms:
        shared = [r for r in runs if r["swarm"] == swarm and r["loss"] != "alone"]
        keys = sorted({(r["loss"], r["share"]) for r in shared}, key=lambda k: (-k[1], k[0]))
        iso_runs = [iso[(swarm, s)] for s in settings.seeds if (swarm, s) in iso]
        if iso_runs:
            configs.append(_config_row(swarm, "alone", 0.0, iso_runs, iso))
        for loss, share in keys:
            chosen = [r for r in shared if (r["loss"], r["share"]) == (loss, share)]
            configs.append(_config_row(swarm, loss, share, chosen, iso))
    ftis = [c for c in configs if c["loss"] == "f-tis" and c["ratio_vs_isolation"] is not None]
    best = max(ftis, key=lambda c: c["ratio_vs_isolation"], default=None)
    diff = _ftis_minus_nois(runs, best["swarm"], best["share"]) if best else None
    done = {(r["swarm"], r["loss"], r["share"], r["seed"]) for r in runs}
    planned = [(sw, "alone", 0.0, s) for s in settings.seeds for sw in settings.swarms] + [
        (sw, loss, share, s) for s in settings.seeds for sw, loss, share in settings.configurations()
    ]
    summary = {
        "model": settings.model,
        "command": command,
        "settings": settings.model_dump(mode="json"),
        "transport": "in-process exchange (node/experiment/exchange.py): the daemon's own admission, screen, "
        "mixing (peer_mix=replace) and F-TIS step; members trusted from round 0",
        "runs_done": len(done & set(planned)),
        "runs_planned": len(planned),
        "seconds_in_runs": round(sum(r.get("seconds", 0.0) for r in runs), 1),
        "cumulative_reward_ratio_vs_isolation": best["ratio_vs_isolation"] if best else None,
        "best_ftis_config": f"{best['swarm']} {best['name']}" if best else None,
        "ftis_minus_nois_cumulative_reward": diff["mean"] if diff else None,
        "ftis_minus_nois_weakest_node": diff["weakest"] if diff else None,
        "configs": configs,
    }
    summary["goals"] = _goals(summary, configs, best, diff)
    return summary


def _config_row(swarm: str, loss: str, share: float, chosen: list[dict], iso: dict) -> dict[str, Any]:
    """Means over seeds of means over nodes, and each node's comparison with its isolation run."""
    per_seed = []
    for run in chosen:
        base = iso.get((swarm, run["seed"]))
        nodes = []
        for n in run["nodes"]:
            b = base["nodes"][n["node"]] if base else None
            nodes.append(
                {
                    "cum": n["cumulative_reward"],
                    "ratio": n["cumulative_reward"] / b["cumulative_reward"] if b and b["cumulative_reward"] else None,
                    "heldout_after": n["heldout_after"],
                    "ood_after": n["ood_after"],
                    "heldout_vs_iso": n["heldout_after"] - b["heldout_after"] if b else None,
                    "ood_vs_iso": n["ood_after"] - b["ood_after"] if b else None,
                    "iso_cum": b["cumulative_reward"] if b else None,
                    **{k: n["offpolicy"].get(k) for k in ("peer_is_weight_mean", "peer_frac_capped", "frac_filtered")},
                    "peer_samples": n["peer_samples_used"],
                    "heldout_before": n["heldout_before"],
                    "ood_before": n["ood_before"],
                }
            )
        weakest = min(nodes, key=lambda x: x["iso_cum"] if x["iso_cum"] is not None else 0.0)
        per_seed.append(
            {
                "seed": run["seed"],
                "cum": _mean(x["cum"] for x in nodes),
                "ratio": _mean(x["ratio"] for x in nodes),
                "weakest_ratio": weakest["ratio"],
                "heldout_vs_iso": [x["heldout_vs_iso"] for x in nodes],
                "ood_vs_iso": [x["ood_vs_iso"] for x in nodes],
                "nodes": nodes,
            }
        )
    flat = [n for s in per_seed for n in s["nodes"]]
    return {
        "swarm": swarm,
        "loss": loss,
        "share": share,
        "name": _config_name(loss, share),
        "seeds": [s["seed"] for s in per_seed],
        "cumulative_reward": _mean(s["cum"] for s in per_seed),
        "ratio_vs_isolation": _mean(s["ratio"] for s in per_seed) if loss != "alone" else None,
        "ratio_by_seed": [s["ratio"] for s in per_seed],
        "weakest_node_ratio": _mean(s["weakest_ratio"] for s in per_seed) if loss != "alone" else None,
        "heldout_before": _mean(n["heldout_before"] for n in flat),
        "heldout_after": _mean(n["heldout_after"] for n in flat),
        "ood_before": _mean(n["ood_before"] for n in flat),
        "ood_after": _mean(n["ood_after"] for n in flat),
        "heldout_vs_isolation": _mean(n["heldout_vs_iso"] for n in flat) if loss != "alone" else None,
        "ood_vs_isolation": _mean(n["ood_vs_iso"] for n in flat) if loss != "alone" else None,
        "every_node_heldout_ge_isolation": all((n["heldout_vs_iso"] or 0) >= 0 for n in flat),
        "every_node_ood_ge_isolation": all((n["ood_vs_iso"] or 0) >= 0 for n in flat),
        "peer_is_weight_mean": _mean(n["peer_is_weight_mean"] for n in flat),
        "peer_frac_capped": _mean(n["peer_frac_capped"] for n in flat),
        "frac_filtered": _mean(n["frac_filtered"] for n in flat),
        "peer_samples_per_node": _mean(n["peer_samples"] for n in flat),
        "per_seed": per_seed,
    }


def _ftis_minus_nois(runs: list[dict], swarm: str, share: float) -> dict[str, float] | None:
    """F-TIS minus NoIS cumulative reward at one mix: mean over nodes and seeds, and on the weakest node."""
    by = {(r["loss"], r["seed"]): r for r in runs if r["swarm"] == swarm and r["share"] == share}
    iso = {r["seed"]: r for r in runs if r["swarm"] == swarm and r["loss"] == "alone"}
    diffs, weakest = [], []
    for (loss, seed), ftis in by.items():
        nois = by.get(("nois", seed))
        if loss != "f-tis" or nois is None:
            continue
        d = [f["cumulative_reward"] - n["cumulative_reward"] for f, n in zip(ftis["nodes"], nois["nodes"])]
        diffs.append(statistics.mean(d))
        if seed in iso:
            w = min(range(len(d)), key=lambda i: iso[seed]["nodes"][i]["cumulative_reward"])
            weakest.append(d[w])
    if not diffs:
        return None
    return {"mean": statistics.mean(diffs), "weakest": _mean(weakest)}


def _goals(summary: dict, configs: list[dict], best: dict | None, diff: dict | None) -> dict[str, Any]:
    if best is None:
        return {}
    signs = {(r or 1.0) > 1.0 for r in best["ratio_by_seed"]}
    return {
        "ratio_ge_sapo_1.94": best["ratio_vs_isolation"] >= SAPO_RATIO,
        "ratio_gt_1": best["ratio_vs_isolation"] > 1.0,
        "ftis_ge_nois_mean": diff is not None and diff["mean"] >= 0,
        "ftis_ge_nois_weakest": diff is not None and diff["weakest"] is not None and diff["weakest"] >= 0,
        "every_node_heldout_ge_isolation": best["every_node_heldout_ge_isolation"],
        "every_node_ood_ge_isolation": best["every_node_ood_ge_isolation"],
        "seeds_agree_in_sign": len(signs) == 1,
    }


# ---------------------------------------------------------------------------- the files


def _f(value, fmt: str = ".3f") -> str:
    return "—" if value is None else format(value, fmt)


def render_gain_markdown(summary: dict[str, Any]) -> str:
    s = summary["settings"]
    lines = [
        "# Swarm gain: does a node learn more in a swarm than alone?",
        "",
        f"Model `{summary['model']}`, {s['nodes']} nodes, {s['rounds']} rounds, each node answering "
        f"{s['prompts_per_round']} prompts x {s['group_size']} completions a round (up to {s['max_tokens']} tokens) "
        f"in every configuration; LoRA, lr {s['lr']}; seeds {s['seeds']}. Training tasks: `{s['task']}`; "
        f"OOD (no node trains on them): `{s['ood_task']}`. Held-out and OOD rewards: {s['eval_problems']} fixed "
        f"problems x {s['eval_samples']} samples at the node's temperature. Homogeneous swarm: T {s['temperature']} "
        f"on every node; heterogeneous: T from {s['hetero_temperatures'][0]} to {s['hetero_temperatures'][1]}.",
        "",
        f"Transport: {summary['transport']}. Runs done: {summary['runs_done']} of {summary['runs_planned']} "
        f"({summary['seconds_in_runs'] / 60:.0f} min in runs). Command: `{summary['command']}`.",
        "",
        "Mixes are SAPO's local/external rollouts at a fixed batch (4/4: half the batch's groups are peers'). "
        "Cumulative reward: the sum over rounds of the mean reward of a node's own samples (SAPO's figure), "
        "mean over nodes and seeds; ratio: each node against its own isolation run (same prompts), then the mean.",
        "",
        "| swarm | config | cum. reward | ratio vs isolation (per seed) | weakest node ratio "
        "| held-out before -> after (vs iso) | OOD before -> after (vs iso) | peer IS w | peer tokens capped "
        "| seqs filtered | peer samples/node |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in summary["configs"]:
        per_seed = ", ".join(_f(r, ".2f") for r in c["ratio_by_seed"]) if c["loss"] != "alone" else ""
        ratio = f"{_f(c['ratio_vs_isolation'], '.2f')} ({per_seed})" if c["loss"] != "alone" else "1"
        vs_h = f" ({_f(c['heldout_vs_isolation'], '+.3f')})" if c["loss"] != "alone" else ""
        vs_o = f" ({_f(c['ood_vs_isolation'], '+.3f')})" if c["loss"] != "alone" else ""
        lines.append(
            f"| {c['swarm']} | {c['name']} | {_f(c['cumulative_reward'], '.2f')} | {ratio} | "
            f"{_f(c['weakest_node_ratio'], '.2f')} | {_f(c['heldout_before'])} -> {_f(c['heldout_after'])}{vs_h} | "
            f"{_f(c['ood_before'])} -> {_f(c['ood_after'])}{vs_o} | {_f(c['peer_is_weight_mean'])} | "
            f"{_f(c['peer_frac_capped'])} | {_f(c['frac_filtered'])} | {_f(c['peer_samples_per_node'], '.0f')} |"
        )
    lines += [
        "",
        f"Headline: best F-TIS configuration **{summary['best_ftis_config']}**, cumulative reward "
        f"**{_f(summary['cumulative_reward_ratio_vs_isolation'], '.2f')}x** isolation (SAPO reports "
        f"{SAPO_RATIO}x at 4/4); F-TIS minus NoIS at that mix: "
        f"{_f(summary['ftis_minus_nois_cumulative_reward'], '+.2f')} "
        f"(weakest node {_f(summary['ftis_minus_nois_weakest_node'], '+.2f')}).",
        "",
        "Goals: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in summary.get("goals", {}).items()),
        "",
        "![cumulative reward](swarm-gain.png)",
    ]
    if summary.get("notes"):
        lines += ["", "## What a user should conclude", "", summary["notes"].strip()]
    return "\n".join(lines) + "\n"


def plot_gain(summary: dict[str, Any], runs_dir: Path, path: Path) -> Path | None:
    """Cumulative reward over rounds, mean over nodes and seeds, one panel per swarm."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = _load_runs(runs_dir)
    swarms, shares = summary["settings"]["swarms"], summary["settings"]["shares"]
    fig, axes = plt.subplots(1, len(swarms), figsize=(6 * len(swarms), 4), squeeze=False)
    for ax, swarm in zip(axes[0], swarms):
        keys = {(r["loss"], r["share"]) for r in runs if r["swarm"] == swarm}
        for loss, share in sorted(keys, key=lambda k: (k[0] != "alone", *k)):
            curves = []
            for r in runs:
                if (r["swarm"], r["loss"], r["share"]) == (swarm, loss, share):
                    for n in r["nodes"]:
                        total, acc = 0.0, []
                        for v in n["rewards"]:
                            total += v
                            acc.append(total)
                        curves.append(acc)
            if curves:
                length = min(len(c) for c in curves)
                mean = [statistics.mean(c[i] for c in curves) for i in range(length)]
                # One colour per mix, solid F-TIS, dashed NoIS, black isolation.
                color = "black" if loss == "alone" else f"C{sorted(shares, reverse=True).index(share)}"
                style = "--" if loss == "nois" else "-"
                ax.plot(range(1, length + 1), mean, style, color=color, label=_config_name(loss, share))
        ax.set_title(f"{swarm} swarm")
        ax.set_xlabel("round")
        ax.set_ylabel("cumulative reward (mean over nodes, seeds)")
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_gain_report(summary: dict[str, Any], out: Path, runs_dir: Path | None = None) -> dict[str, str]:
    """docs-style files: <out>/swarm-gain.json, .md and .png (the plot when matplotlib is there)."""
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "swarm-gain.json", "md": out / "swarm-gain.md"}
    notes = out / "swarm-gain-notes.md"  # a hand-written reading of the figures, kept across reruns
    if notes.exists():
        summary["notes"] = notes.read_text()
    if runs_dir is not None and plot_gain(summary, runs_dir, out / "swarm-gain.png") is not None:
        files["png"] = out / "swarm-gain.png"
    files["json"].write_text(json.dumps({k: v for k, v in summary.items() if k != "notes"}, indent=1) + "\n")
    files["md"].write_text(render_gain_markdown(summary))
    return {k: str(v) for k, v in files.items()}
