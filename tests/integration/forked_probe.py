"""Run by tests/integration/launch/test_forked.py as ``python -m tests.integration.forked_probe``
(forked, ``launch.forked``): prints what a ``python -m`` process would see, then sleeps
``argv[1]`` seconds and exits with ``argv[2]``."""

import gc
import json
import os
import sys
import time

if __name__ == "__main__":
    seen = {
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "probe": os.environ.get("PROBE"),
        "own_session": os.getsid(0) == os.getpid(),
        "vllm_imported": "vllm.entrypoints.openai.api_server" in sys.modules,
        "torch_threads": sys.modules["torch"].get_num_threads(),
        "frozen_objects": gc.get_freeze_count(),
    }
    print(json.dumps(seen), flush=True)
    time.sleep(float(sys.argv[1]))
    raise SystemExit(int(sys.argv[2]))
