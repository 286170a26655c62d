"""`ftis-node status URL`: a terminal view of a running node, read from its status API.

    view = fetch_view("http://127.0.0.1:8470", timeout=3)    # raises Unreachable (one line)
    console.print(render(view))

Peer ids, model names and rejection details come from the network: they are shown as
plain text (never as rich markup) with control characters removed, so a peer cannot
style, move or clear the operator's terminal.
"""

from __future__ import annotations

import time
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

SPARK = "▁▂▃▄▅▆▇█"
ROUND_STEPS = ("generating", "publishing", "gathering", "training", "checkpointing")


class Unreachable(Exception):
    """The node did not answer, or not like an ftis-node status API; the message is one line."""


def normalize_url(url: str) -> str:
    """`host:port`, `http://host:port/`, `.../status` and the dashboard's URL all name the same node."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    for suffix in ("/status", "/dashboard"):
        url = url.removesuffix(suffix)
    return url


def reward_faults_line(faults: dict[str, Any]) -> str:
    """`failed 3, none 1 (last: ...)`: the --reward values that scored 0 or were clamped."""
    counts = ", ".join(f"{safe(k)} {safe(v)}" for k, v in faults.items() if k != "last")
    return f"{counts} (last: {safe(faults.get('last'), 300)})"


def fetch_view(url: str, timeout: float = 3.0) -> dict[str, Any]:
    """{"url", "status", "history", "swarm"}; history and swarm are empty if the node has none.

    `url` may also be a node's data folder (or its status.json): the file the node last wrote,
    read as "stopped" if the node that wrote it no longer runs.
    """
    local = Path(url).expanduser()
    if local.is_dir() or local.name == "status.json":
        return file_view(local / "status.json" if local.is_dir() else local)
    base = normalize_url(url)
    try:
        with httpx.Client(base_url=base, timeout=httpx.Timeout(timeout), follow_redirects=False) as client:
            status = _get_json(client, "/status", base)
            if not isinstance(status, dict) or "phase" not in status:
                raise Unreachable(f"{base} answered /status, but not like an ftis-node")
            try:
                history = _get_json(client, "/history", base)
                swarm = _get_json(client, "/swarm", base)
            except Unreachable:  # an older node, or one that stopped between the calls
                history, swarm = [], {}
    except httpx.InvalidURL as e:
        raise Unreachable(f"{url!r} is not a URL ({e})") from None
    return {"url": base, "status": status, "history": history if isinstance(history, list) else [], "swarm": swarm}


def file_view(path: Path) -> dict[str, Any]:
    """The view of a node's status.json (see `node.serving.status.read_status_file`)."""
    from node.serving.status import read_status_file

    try:
        status = read_status_file(path)
    except FileNotFoundError:
        raise Unreachable(f"{path} does not exist; is that a node's --data-dir?") from None
    except (OSError, ValueError) as e:
        raise Unreachable(f"cannot read {path}: {_one_line(str(e))}") from None
    history = status.pop("history", None)
    status.setdefault("server_time", status.get("written_at"))
    return {"url": str(path), "status": status, "history": history if isinstance(history, list) else [], "swarm": {}}


def _get_json(client: httpx.Client, path: str, base: str) -> Any:
    try:
        response = client.get(path)
    except httpx.TimeoutException:
        raise Unreachable(f"{base} did not answer within {client.timeout.read} s") from None
    except httpx.HTTPError as e:
        raise Unreachable(f"cannot reach {base}: {_one_line(str(e)) or type(e).__name__}") from None
    if response.status_code != 200:
        raise Unreachable(f"{base}{path} answered HTTP {response.status_code}; is this an ftis-node status URL?")
    try:
        return response.json()
    except ValueError:
        raise Unreachable(f"{base}{path} did not answer JSON; is this an ftis-node status URL?") from None


def _one_line(text: str) -> str:
    return " ".join(text.split())


def safe(value: Any, limit: int = 120) -> str:
    """A network string made harmless for a terminal: no control or format characters, bounded length."""
    text = "" if value is None else str(value)
    text = "".join(ch if unicodedata.category(ch)[0] != "C" else "?" for ch in text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def short_id(peer_id: Any) -> str:
    text = safe(peer_id)
    return "…" + text[-6:] if len(text) > 14 else text


NAME_CELLS = 12  # a peer's name in a table, at most


def peer_label(peer_id: Any, name: Any = None, limit: int = NAME_CELLS) -> str:
    """A peer's --name (its own claim, capped) beside its id suffix, which tells apart two that chose the same name."""
    label = safe(name, limit) if limit >= 2 else ""
    return f"{label} {short_id(peer_id)}" if label else short_id(peer_id)


def sparkline(values: Sequence[object], width: int = 40) -> str:
    """One bar for each of the last `width` numbers in `values`; anything else (a missing reward) is left out."""
    nums = [v for v in values if isinstance(v, (int, float))][-width:]
    if not nums:
        return ""
    lo, hi = min(min(nums), 0.0), max(max(nums), 1.0)  # rewards live in [0, 1]; wider data widens it
    span = (hi - lo) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * (len(SPARK) - 1) + 0.5))] for v in nums)


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return safe(value)
    return str(value) if isinstance(value, int) else f"{value:.{digits}f}"


def _bytes(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "–"
    if n < 1024:
        return f"{int(n)} B"
    return f"{n / 1024:.1f} kB" if n < 1 << 20 else f"{n / (1 << 20):.2f} MB"


def _ago(ts: Any, now: float) -> str:
    if not isinstance(ts, (int, float)):
        return "–"
    s = max(0.0, now - ts)
    return f"{s:.0f} s ago" if s < 90 else (f"{s / 60:.0f} min ago" if s < 5400 else f"{s / 3600:.1f} h ago")


def round_in_run(s: dict[str, Any]) -> int:
    if isinstance(s.get("round_in_run"), int):
        return s["round_in_run"]
    return int(s.get("rounds_done") or 0) + (1 if s.get("phase") in ROUND_STEPS else 0)


def progress_line(s: dict[str, Any]) -> str:
    """What the round loop is doing now, with a countdown where the node says when it ends."""
    phase, detail, now = safe(s.get("phase")), s.get("phase_detail") or {}, s.get("server_time") or time.time()
    rs, r = s.get("round_seconds"), s.get("round")
    if isinstance(detail.get("total"), int) and detail.get("total") and isinstance(detail.get("done"), int):
        return f"{phase}: {detail['done']} of {detail['total']}"
    if phase == "gathering" and isinstance(detail.get("deadline"), (int, float)):
        k = detail.get("peers")
        peers = f"{k} peer{'' if k == 1 else 's'} answered, " if isinstance(k, int) else ""
        return f"gathering: {peers}{max(0.0, detail['deadline'] - now):.1f} s left"
    if phase == "waiting for round" and isinstance(rs, (int, float)) and isinstance(r, int):
        return f"waiting: the next round starts in {max(0.0, r * rs - now):.1f} s"
    if phase in ROUND_STEPS and isinstance(rs, (int, float)) and isinstance(r, int) and s.get("peer_id"):
        into = now - r * rs
        left = f"{rs - into:.1f} s left in" if into <= rs else f"{into - rs:.1f} s past"
        return f"{phase} · {left} this round's time bucket"
    return phase


def render(view: dict[str, Any], error: str | None = None, width: int = 120) -> Group:
    """The whole view; below `width` 110 columns it stacks the summary; the peers table gives up
    detail columns until it fits `width` (`PEER_DROP_ORDER`), so no header is ever cut short."""
    s, history = view["status"], view["history"]
    wide = width >= 110
    now = s.get("server_time") or time.time()
    parts: list[Any] = []
    title = Text()
    title.append(f"ftis-node · {safe(s.get('name'))}", style="bold")
    title.append(f"   {safe(s.get('model'))} · {safe(s.get('loss'))} · {safe(s.get('task'))}   ")
    title.append(f" {safe(s.get('phase'))} ", style="reverse")
    n = round_in_run(s)
    bucket = f" (DHT bucket {s['round']})" if s.get("round") is not None and s.get("peer_id") else ""
    title.append(f"   round {n} of this run{bucket}" if n else "   no round yet")
    parts.append(title)
    if s.get("running") is False:  # read from a status file whose node is gone
        was = f"; it was {safe(s['phase_at_exit'])} when it stopped" if s.get("phase_at_exit") else ""
        written = _ago(s.get("written_at"), time.time())
        parts.append(Text(f"not running: process {safe(s.get('pid'))} is gone{was} (file written {written})"))
    else:
        parts.append(Text(progress_line(s), style="dim"))
    for notice in s.get("notices") or []:
        parts.append(Text(f"warning: {safe(notice, 400)}", style="yellow"))
    if isinstance(faults := s.get("reward_faults"), dict):  # kept for the whole run, unlike a round's notices
        parts.append(Text(f"reward faults: {reward_faults_line(faults)}", style="yellow"))
    if error:
        parts.append(Text(f"unreachable: {safe(error, 300)} (showing the last answer; retrying)", style="bold red"))
    parts.append(_summary(s, history, wide))
    if s.get("peers"):
        parts.append(_peers_table(s, now, width))
    swarm = (view.get("swarm") or {}).get("peers") or []
    if swarm:
        parts.append(_swarm_table(s, swarm, view.get("swarm", {}).get("source"), now))
    if s.get("rejected"):
        parts.append(_rejections(s))
    if view["url"].startswith(("http://", "https://")):
        parts.append(Text(f"{view['url']}  ·  dashboard {view['url']}/  ·  metrics {view['url']}/metrics", style="dim"))
    else:
        parts.append(Text(f"read from {view['url']}", style="dim"))
    return Group(*parts)


def _summary(s: dict[str, Any], history: list[dict[str, Any]], wide: bool) -> Table:
    last = s.get("last_round") or {}
    m = last.get("metrics") or {}
    rewards = [r.get("reward_mean") for r in history]
    best = max((r for r in rewards if isinstance(r, (int, float))), default=None)
    failures = s.get("failures") or {"content": s.get("rejected") or {}, "network": s.get("swarm_errors") or {}}
    rejected = sum((failures.get("content") or {}).values())
    rounds = max(int(s.get("rounds_done") or 0), 1)
    network = ", ".join(
        f"{safe(k)} {v} ({v / rounds:.2g}/round)" for k, v in sorted((failures.get("network") or {}).items())
    )
    cells: list[tuple[str, Any]] = [
        (
            "reward",
            Text(f"{_num(last.get('reward_mean'))}  best {_num(best)}  ") + Text(sparkline(rewards), style="cyan"),
        ),
        ("rounds done", f"{s.get('rounds_done', 0)}  (up {_num(s.get('uptime_s'), 0)} s)"),
        ("samples", f"{last.get('own_samples', '–')} own + {last.get('peer_samples', '–')} from peers"),
        ("peers", f"{last.get('peers_answered', '–')} answered · {len(s.get('peers') or {})} heard from"),
        ("rejected", Text(str(rejected), style="red" if rejected else "")),
        ("packets", f"↑ {_bytes(last.get('bytes_published'))}  ↓ {_bytes(last.get('bytes_read'))}"),
        (
            "round time",
            f"{_num(last.get('seconds'), 1)} s (gather {_num(last.get('gather_seconds'), 1)} s, "
            f"step {_num(m.get('seconds'), 2)} s)",
        ),
        ("adapter", safe(s.get("adapter_version"))[:12] or "–"),
        (
            "off-policy",
            f"IS w {_num(m.get('is_weight_mean'))} · capped {_num(m.get('frac_capped'))} · "
            f"ESS {_num(m.get('ess'))} · filtered {_num(m.get('frac_filtered'))}",
        ),
        ("network failures", Text(network or "none", style="yellow" if network else "")),
    ]
    per_row = 2 if wide else 1
    grid = Table.grid(padding=(0, 2))
    for _ in range(per_row):
        grid.add_column(style="dim", justify="right", no_wrap=True)
        grid.add_column()
    for i in range(0, len(cells), per_row):
        grid.add_row(*[part for label, value in cells[i : i + per_row] for part in (label, value)])
    return grid


# Columns of the peers table; those marked False are left out on a narrow terminal.
PEER_COLUMNS = (
    ("peer", "left"),
    ("model", "left"),
    ("adapter", "left"),
    ("trust", "left"),
    ("last round", "right"),
    ("last seen", "right"),
    ("admitted", "right"),
    ("used", "right"),
    ("reward", "right"),
    ("IS w", "right"),
    ("capped", "right"),
    ("ESS", "right"),
    ("filtered", "right"),
    ("rejected / screened", "left"),
)
#: Columns given up, first to last, until the table fits the terminal: never a header cut short.
PEER_DROP_ORDER = ("adapter", "filtered", "ESS", "capped", "last round", "IS w", "used", "last seen")
_WRAPPING = ("trust", "rejected / screened")  # columns whose cells wrap at spaces (never their header)


def _fit_columns(
    rows: Sequence[tuple[Text, ...]], width: int, keep: list[bool]
) -> tuple[list[bool], dict[int, int], int]:
    """Drop columns in PEER_DROP_ORDER until each shown one fits its header and its cells (a
    wrapping column its longest word) in `width`, three cells of padding and border a column.

    Returns what to show, the width of each wrapping column (they share what is left, so rich
    never has to squeeze a column below its header) and by how much the table is still too wide."""
    names = [name for name, _ in PEER_COLUMNS]

    def need(i: int) -> int:
        if names[i] in _WRAPPING:
            cells = [Text(word).cell_len for r in rows for word in r[i].plain.split()]
        else:
            cells = [r[i].cell_len for r in rows]
        return max([Text(names[i]).cell_len, *cells]) + 3

    def total(shown: list[bool]) -> int:
        return sum(need(i) for i, k in enumerate(shown) if k) + 1

    keep = list(keep)
    for name in PEER_DROP_ORDER:
        if total(keep) <= width:
            break
        keep[names.index(name)] = False
    slack = width - total(keep)
    widths = {}
    for i, name in enumerate(names):
        if keep[i] and name in _WRAPPING:
            natural = max([Text(name).cell_len, *(r[i].cell_len for r in rows)]) + 3
            widths[i] = min(natural, need(i) + max(slack, 0))
            slack -= widths[i] - need(i)
    return keep, widths, max(0, -slack)


def _peers_table(s: dict[str, Any], now: float, width: int) -> Table:
    any_trust = any(p.get("trust") for p in (s.get("peers") or {}).values())
    peers = sorted((s.get("peers") or {}).values(), key=lambda p: (-(p.get("samples_admitted") or 0), p["peer_id"]))
    rows = []
    for p in peers:
        o = p.get("offpolicy") or {}
        reasons = [f"{safe(k)}×{v}" for k, v in (p.get("rejected") or {}).items()]
        reasons += [f"screened {safe(k)}×{v}" for k, v in (p.get("screened") or {}).items()]
        trust = safe(p.get("trust")) or "–"
        until = p.get("quarantined_until")
        if isinstance(until, (int, float)) and not isinstance(until, bool):
            trust += time.strftime(" until %H:%M:%S", time.localtime(until)) if until > 1e9 else f" until round {until}"
        rows.append(
            (
                Text(peer_label(p["peer_id"], p.get("name"))),
                Text(safe(p.get("model"), 40) or "–"),
                Text(safe(p.get("adapter_version"))[:10] or "–"),
                Text(trust, style="red" if trust.startswith("quarantined") else ""),
                Text(_behind(p.get("last_round"), s.get("round"))),
                Text(_ago(p.get("last_seen"), now)),
                Text(str(p.get("samples_admitted", 0))),
                Text(str(p.get("samples_used", 0))),
                Text(_num(p.get("reward_mean"))),
                Text(_num(o.get("is_weight_mean"))),
                Text(_num(o.get("frac_capped"))),
                Text(_num(o.get("ess"))),
                Text(_num(o.get("frac_filtered"))),
                Text(", ".join(reasons) or "–", style="red" if reasons else ""),
            )
        )
    keep, widths, over = _fit_columns(rows, width, [name != "trust" or any_trust for name, _ in PEER_COLUMNS])
    if over:  # still too wide with every optional column gone: the peers' names give way first
        short = [peer_label(p["peer_id"], p.get("name"), limit=NAME_CELLS - over) for p in peers]
        rows = [(Text(label), *row[1:]) for label, row in zip(short, rows)]
        keep, widths, _ = _fit_columns(rows, width, keep)
    table = Table(title="peers", title_justify="left", expand=False, header_style="dim", box=box.SIMPLE)
    for i, ((name, justify), shown) in enumerate(zip(PEER_COLUMNS, keep)):
        if shown:
            wraps = name in _WRAPPING
            table.add_column(
                name,
                justify=justify,  # type: ignore[arg-type]
                width=widths[i] - 3 if i in widths else None,
                min_width=len(name),
                no_wrap=not wraps,
                overflow="fold" if wraps else "ellipsis",
            )
    for row in rows:
        table.add_row(*[cell for cell, shown in zip(row, keep) if shown])
    return table


def _behind(r: Any, current: Any) -> str:
    if not isinstance(r, int):
        return "–"
    if not isinstance(current, int):
        return str(r)
    return "this round" if current - r <= 0 else f"{current - r} behind"


def _swarm_table(s: dict[str, Any], peers: list[dict[str, Any]], source: Any, now: float) -> Table:
    title = "swarm (DHT records)" if source == "dht" else "swarm (peers heard from)"
    table = Table(title=title, title_justify="left", header_style="dim")
    for name in ("peer", "model", "adapter", "last round", "packet", "last seen"):
        table.add_column(name, min_width=len(name), no_wrap=name != "model")
    names = {pid: q.get("name") for pid, q in (s.get("peers") or {}).items()}
    for p in sorted(peers, key=lambda q: str(q.get("peer_id"))):
        pid = p.get("peer_id")
        mark = " (this node)" if pid == s.get("peer_id") else ""
        table.add_row(
            Text(peer_label(pid, p.get("name") or names.get(pid)) + mark),
            Text(safe(p.get("model"), 40) or "–"),
            Text(safe(p.get("adapter_version"))[:10] or "–"),
            _behind(p.get("round"), s.get("round")),
            _bytes(p.get("size")),
            _ago(p.get("last_seen"), now),
        )
    return table


def _rejections(s: dict[str, Any]) -> Table:
    table = Table(title="rejected, by reason", title_justify="left", header_style="dim")
    table.add_column("reason", style="red")
    table.add_column("count", justify="right")
    table.add_column("example", overflow="fold")
    examples = s.get("rejected_examples") or {}
    for reason, count in sorted((s.get("rejected") or {}).items(), key=lambda kv: -kv[1]):
        table.add_row(Text(safe(reason)), str(count), Text(safe(examples.get(reason), 300)))
    return table


def watch(url: str, *, interval: float, timeout: float, console: Console) -> None:
    """Redraw until Ctrl-C; a node that stops answering is shown as such and retried."""
    view = fetch_view(url, timeout)  # the first answer must come, or the caller reports it
    with Live(render(view, width=console.width), console=console, refresh_per_second=4, transient=False) as live:
        while True:
            time.sleep(interval)
            try:
                view = fetch_view(url, timeout)
                live.update(render(view, width=console.width))
            except Unreachable as e:
                live.update(render(view, error=str(e), width=console.width))
