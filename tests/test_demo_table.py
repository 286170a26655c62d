"""The demo's last live table agrees with its summary: both read the nodes' final status files."""

from __future__ import annotations

import json
import subprocess
import sys

from rich.console import Console

from node.console.demo import Demo, learning_line


def test_last_table_shows_the_final_state(tmp_path):
    demo = Demo(nodes=2, rounds=3, workdir=tmp_path, console=Console(width=200, record=True))
    history = [{"round": r, "reward_mean": 0.1 * r, "peer_samples": 48, "peers_answered": 1} for r in range(3)]
    for node in demo.roster:
        demo.procs[node.name] = subprocess.Popen([sys.executable, "-c", "pass"])  # a node that has finished
        demo.procs[node.name].wait()
        demo.api[node.name] = "http://127.0.0.1:9"  # nothing listens: polling finds nothing new
        # what a poll saw one round before the end
        demo.last[node.name] = {"rounds_done": 2, "phase": "training", "last_round": history[1] | {"own_samples": 4}}
        demo.history[node.name] = history[:2]
        (tmp_path / node.name).mkdir()
        final = {"rounds_done": 3, "phase": "stopped", "last_round": history[2] | {"own_samples": 4}}
        (tmp_path / node.name / "status.json").write_text(json.dumps(final | {"history": history}))
    demo.read_status_files()
    demo.console.print(demo.table())
    summary = demo.summary()
    demo.console.print(demo.summary_table(summary))
    demo.console.print(learning_line(summary))
    text = demo.console.export_text()
    table, summary_text = text.split("summary")
    for node in demo.roster:
        row = next(line for line in table.splitlines() if line.startswith(f"│ {node.name} "))
        cells = [c.strip() for c in row.split("│")[1:-1]]
        assert cells[3] == "3" and cells[6] == "144", cells  # rounds, peer samples used
        assert summary[node.name]["rounds"] == 3 and summary[node.name]["peer_samples_used"] == 144
        assert "exited (0)" in row
    # The control: each node's first rounds against its last (3 rounds: 1 and 1), and what rose.
    assert "reward rose on 2 of 2 nodes (first 5 rounds -> last 5)" in text.replace("\n", " ")
    assert all(s["reward_first"] == 0.0 and abs(s["reward_last"] - 0.2) < 1e-9 for s in summary.values())


def test_a_node_that_exits_before_its_first_round_stops_the_demo_with_its_last_log_line(tmp_path):
    import pytest

    from node.console.demo import NodeFailed

    demo = Demo(nodes=2, rounds=3, workdir=tmp_path, console=Console(width=200, record=True))
    first, second = demo.roster
    with open(tmp_path / f"{first.name}.log", "w") as log:  # a first node that fails at start-up
        script = "print('loading'); print('error: --port 31337: in use'); raise SystemExit(2)"
        demo.procs[first.name] = subprocess.Popen([sys.executable, "-c", script], stdout=log)
    demo.api[first.name] = "http://127.0.0.1:9"  # it never answers
    with pytest.raises(NodeFailed) as failed:
        demo._wait_joined(first.name, timeout=120)  # ends on the exit, not on the bound
    assert str(failed.value) == (
        f"{first.name} exited (code 2) before its first round; its last log line: error: --port 31337: in use"
    )
    # A node that played a round and then exited is not an early failure.
    (tmp_path / second.name).mkdir()
    (tmp_path / second.name / "status.json").write_text(json.dumps({"rounds_done": 1}))
    demo.procs = {second.name: subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])}
    demo.procs[second.name].wait()
    demo.check_early_exits()
