"""The status API serves what the round loop records, over real HTTP."""

import httpx
import pytest

from node.serving.api import ApiServer
from node.serving.status import NodeStatus, RoundRecord


@pytest.fixture()
def served():
    status = NodeStatus(name="n1", model="tiny-s", task="toy", loss="f-tis")
    server = ApiServer(status, host="127.0.0.1", port=0).start()
    yield status, server
    server.stop()


def test_status_history_and_peers_reflect_the_loop(served):
    status, server = served
    status.set(peer_id="12D3KooWtest", join_addrs=["/ip4/127.0.0.1/tcp/1/p2p/12D3KooWtest"])
    status.set_phase("training", round_=7)
    status.reject("peerA", "bad_magic", "packet does not start with the magic")
    status.peer_update("peerA", packets=1, samples_admitted=12, last_round=7, offpolicy={"ess": 0.9})
    status.peer_update("peerA", packets=1, samples_admitted=12, last_round=8)
    status.record_round(
        RoundRecord(
            round=7,
            started_at=0.0,
            seconds=1.5,
            reward_mean=0.25,
            own_samples=96,
            peer_samples=24,
            peers_answered=1,
            metrics={"loss": -0.1},
        ),
        adapter_version="abc123",
    )
    with httpx.Client(base_url=server.url, timeout=5) as client:
        s = client.get("/status").json()
        assert s["phase"] == "training" and s["round"] == 7 and s["adapter_version"] == "abc123"
        assert s["rejected"] == {"bad_magic": 1}
        assert "magic" in s["rejected_examples"]["bad_magic"]
        assert s["last_round"]["reward_mean"] == 0.25
        peer = client.get("/peers").json()["peerA"]
        assert peer["packets"] == 2 and peer["samples_admitted"] == 24 and peer["last_round"] == 8
        assert peer["rejected"] == {"bad_magic": 1} and peer["offpolicy"]["ess"] == 0.9
        assert [r["round"] for r in client.get("/history").json()] == [7]
        assert client.get("/healthz").json()["ok"] is True
        page = client.get("/")
        assert page.status_code == 200 and "ftis-node" in page.text
        assert "script-src 'self'" in page.headers["content-security-policy"]
        script = client.get("/dashboard.js")
        assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
        assert 'getJSON("status")' in script.text and "innerHTML" not in script.text
        assert "innerHTML" not in client.get("/charts.js").text
        assert client.get("/dashboard.css").headers["content-type"].startswith("text/css")
        for src in ("charts.js", "dashboard.js", "dashboard.css"):  # relative: nothing from another origin
            assert f'"{src}"' in page.text
        assert "http://" not in page.text and "https://" not in page.text


def test_port_in_use_gives_a_clear_error(served):
    _, server = served
    with pytest.raises(OSError, match="--api-port"):
        ApiServer(NodeStatus(name="x", model="m", task="t", loss="f-tis"), host="127.0.0.1", port=server.port)
