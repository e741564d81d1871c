import os, subprocess, sys, time, json
from pathlib import Path
sys.path.insert(0, "/work/main")
from launch.vllm_server import server_env, start_bridge_server
from bench.rollout.eval_server import server_threads
from launch.threads import light_env
out_root = Path("/work/runs/bf16val")
models = {"sft": "/work/main/artifacts/models/smollm2-135m-instruct-sft",
          "step10": "/work/runs/val30/trainer/checkpoints/step_000010/model"}
tok = models["sft"]
for name, model in models.items():
    env = server_env(None, "cpu") | server_threads(2)
    t0 = time.time()
    server = start_bridge_server(model, "none", out_root / f"vllm_{name}.log", env=env, extra=["--dtype", "bfloat16", "--tokenizer", tok])
    try:
        argv = [sys.executable, "-m", "env_server.evaluate", "--split", "validation", "--limit", "256",
                "--inference-url", server.base_url, "--tokenizer", tok, "--out-dir", str(out_root / name),
                "--max-prompt-tokens", "896", "--max-tokens", "128"]
        t1 = time.time()
        with (out_root / f"{name}.log").open("w") as log:
            subprocess.run(argv, check=True, stdout=log, stderr=log, env={**os.environ, **light_env()}, cwd="/work/main")
        print(name, "start", round(t1 - t0, 1), "eval", round(time.time() - t1, 1), flush=True)
    finally:
        server.stop()
