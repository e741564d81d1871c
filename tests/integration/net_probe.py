"""What a client at another address gets from a server (stdlib only: runs in any network
namespace and any Python, the atroposlib virtualenv's included).

    python net_probe.py WAIT_URL [URL ...]

Waits (up to 120 s) until ``WAIT_URL`` answers at all (any HTTP status), then GETs each URL
once and prints one JSON line: ``{url: status}``.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def main() -> None:
    wait, urls = sys.argv[1], sys.argv[2:]
    deadline = time.monotonic() + 120
    while True:
        try:
            status(wait)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    print(json.dumps({u: status(u) for u in urls}), flush=True)


if __name__ == "__main__":
    main()
