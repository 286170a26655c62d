#!/usr/bin/env python3
"""Container healthcheck: exit 0 when this node's API answers GET /healthz.

The port and interface are the node's own settings (FTIS_API_PORT, FTIS_API_HOST), or the
first argument as the port. The API starts once the model is loaded, so a node that is
still building or loading its model is "starting", not "unhealthy" (see start_period).
"""

import os
import sys
import urllib.request

port = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("FTIS_API_PORT", "8470")
host = os.environ.get("FTIS_API_HOST", "127.0.0.1")
host = "127.0.0.1" if host in ("", "0.0.0.0") else host
try:
    with urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=4) as reply:
        sys.exit(0 if reply.status == 200 else 1)
except OSError as err:
    print(f"no answer from http://{host}:{port}/healthz: {err}")
    sys.exit(1)
