"""The demo's last live table agrees with its summary: both read the nodes' final status files."""

from __future__ import annotations

import json
import subprocess
import sys

from rich.console import Console

from node.demo import Demo


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
    text = demo.console.export_text()
    table, summary_text = text.split("summary")
    for node in demo.roster:
        row = next(line for line in table.splitlines() if line.startswith(f"│ {node.name} "))
        cells = [c.strip() for c in row.split("│")[1:-1]]
        assert cells[3] == "3" and cells[6] == "144", cells  # rounds, peer samples used
        assert summary[node.name]["rounds"] == 3 and summary[node.name]["peer_samples_used"] == 144
        assert "exited (0)" in row
