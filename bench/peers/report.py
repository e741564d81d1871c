"""The numbers of ``bench/peers/peer_trl.py`` from the two runs' own records (pure; no torch):

- a timeline per side: one entry per optimizer step, its end time (unix) and where its time
  went (ours: the trainer's ``metrics.jsonl``; TRL: ``peer_metrics.jsonl`` of
  bench/peers/run_trl.py);
- the steady-state rate: samples trained per minute over steps 2..N (step 1 holds the
  warm-up: ours waits for vLLM's first rollouts, TRL's first generate), with and without the
  checkpoint writes; model loading, vLLM's start and imports are before step 1 and excluded;
- paired comparisons of evaluations on the same rows (``env_server.eval_stats.paired_difference``);
- the markdown table.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

OURS_PARTS = {
    "wait_s": "wait for data",
    "step_s": "trainer compute",
    "checkpoint_s": "checkpoint",
    "sync_s": "weight sync",
}
TRL_PARTS = {
    "generate_s": "generate",
    "reward_s": "reward",
    "score_other_s": "other scoring",
    "loss_backward_s": "loss + backward",
    "optimizer_s": "optimizer",
    "checkpoint_s": "checkpoint",
}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def timeline(rows: Sequence[Mapping[str, Any]], parts: Mapping[str, str]) -> list[dict[str, Any]]:
    """``[{step, end, dur, parts}]`` from per-step rows (skipped updates left out); ``dur``
    is the sum of the parts, ``end`` the row's time (after the step's checkpoint)."""
    out = []
    for r in rows:
        if r.get("skipped_update"):
            continue
        p = {k: float(r.get(k) or 0.0) for k in parts}
        out.append(
            {"step": int(r["step"]), "end": float(r["time"]), "dur": sum(p.values()), "parts": p}
        )
    out.sort(key=lambda e: e["step"])
    return out


def start_time(tl: Sequence[Mapping[str, Any]]) -> float:
    """When step 1 began (its end minus its duration)."""
    return tl[0]["end"] - tl[0]["dur"]


def steady_rate(tl: Sequence[Mapping[str, Any]], samples_per_step: int) -> dict[str, float]:
    """Samples trained per minute over steps 2..N, wall clock, with and without checkpoints."""
    if len(tl) < 2:
        raise ValueError("need at least 2 steps for a steady-state rate")
    seconds = tl[-1]["end"] - tl[0]["end"]
    ckpt = sum(e["parts"].get("checkpoint_s", 0.0) for e in tl[1:])
    samples = (len(tl) - 1) * samples_per_step
    return {
        "steps": len(tl) - 1,
        "samples": samples,
        "seconds": seconds,
        "checkpoint_seconds": ckpt,
        "samples_per_min": 60 * samples / seconds,
        "samples_per_min_without_checkpoints": 60 * samples / (seconds - ckpt),
        "step_s_mean": seconds / (len(tl) - 1),
    }


def breakdown(tl: Sequence[Mapping[str, Any]], parts: Mapping[str, str]) -> dict[str, float]:
    """Mean seconds per step of each part over steps 2..N (1 if that is all there is)."""
    steady = tl[1:] or tl
    out = {parts[k]: sum(e["parts"][k] for e in steady) / len(steady) for k in parts}
    out["total"] = sum(e["dur"] for e in steady) / len(steady)
    return out


def elapsed(tl: Sequence[Mapping[str, Any]]) -> dict[int, float]:
    """Seconds from the start of step 1 to the end of each step (step 0: 0)."""
    t0 = start_time(tl)
    return {0: 0.0, **{e["step"]: e["end"] - t0 for e in tl}}


def at_wall_time(times: Mapping[int, float], saved: Sequence[int], wall: float) -> int:
    """The latest saved step (0: the start model) whose end came at or before ``wall``."""
    done = [s for s in saved if times.get(s, float("inf")) <= wall + 1e-6]
    return max(done, default=0)


def paired(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    """``b - a`` over the same rows: mean and paired standard error."""
    from env_server.eval_stats import paired_difference

    d, se = paired_difference(list(a), list(b))
    return {"diff": d, "se": se}


def per_sample(metrics: Mapping[str, Any], train_reward: Sequence[float]) -> dict[str, list]:
    """The vectors a comparison pairs: exact match, the paper's reward, the trained reward."""
    return {
        "exact": list(metrics["per_sample"]["exact"]),
        "reward": list(metrics["per_sample"]["reward"]),
        "train_reward": list(train_reward),
    }


def summary_of(vectors: Mapping[str, Sequence[float]]) -> dict[str, float]:
    n = len(vectors["exact"])
    return {k: sum(v) / n for k, v in vectors.items()} | {"n": n}


def compare(a: Mapping[str, Sequence[float]], b: Mapping[str, Sequence[float]]) -> dict:
    """``b - a`` for each vector (paired)."""
    return {k: paired(a[k], b[k]) for k in ("exact", "reward", "train_reward")}


def unpaired(a: Mapping[str, float], b: Mapping[str, Sequence[float]]) -> dict:
    """``b - a`` where ``a`` is known only by its means (a recorded evaluation of the same
    rows, ``--trl-result``): exact match with the standard error of two independent
    proportions (larger than the paired one when the two models agree on rows), the
    rewards with none (their spread over rows was not recorded)."""
    n = len(b["exact"])
    pa, pb = a["exact"], sum(b["exact"]) / n
    se = math.sqrt(pa * (1 - pa) / a["n"] + pb * (1 - pb) / n)
    out = {"exact": {"diff": pb - pa, "se": se, "paired": False}}
    for k in ("reward", "train_reward"):
        out[k] = {"diff": sum(b[k]) / n - a[k], "se": None, "paired": False}
    return out


def plus_minus(c: Mapping[str, Any], scale: float = 1.0, digits: int = 2) -> str:
    """``diff ± se`` (scaled); an unknown SE says so."""
    if c.get("se") is None:
        return f"{scale * c['diff']:+.{digits}f} (unpaired, SE unknown)"
    return f"{scale * c['diff']:+.{digits}f} ± {scale * c['se']:.{digits}f}"


def markdown(res: Mapping[str, Any]) -> str:
    """The result as a markdown table (what docs/results/peer_trl.md holds)."""
    m, s = res["machine"], res["settings"]
    ours, trl = res["ours"], res["trl"]
    lines = [
        f"# GRPO: this stack vs TRL {res['trl_version']} GRPOTrainer ({res['preset']}"
        f"{', TRL generating with ' + res['trl_generation'] if 'trl_generation' in res else ''})",
        "",
        f"{'SMOKE TEST, not a measurement. ' if res.get('smoke') else ''}"
        f"Model {Path(s['model']).name}; {s['prompts_per_step']} prompts x {s['group_size']} "
        f"completions a step, {res['steps']} steps ({res['steps'] * s['samples_per_step']} "
        f"samples); lr {s['lr']}, {s['advantages']}, KL {s['kl_beta']}, temperature "
        f"{s['temperature']}, max_tokens {s['max_tokens']}, reward {s['reward']}. "
        f"{m.get('cpu', '?')}, {m['cpus']} cores, load {m['loadavg']} at the start, "
        f"{m['time_utc']}. Command: `{res['command']}`.",
        "",
        "| | this stack | TRL | this stack / TRL |",
        "|---|---|---|---|",
    ]
    ro, rt = ours["rate"], trl["rate"]
    for key, name in (
        ("samples_per_min", "samples trained / min (steady: steps 2..N)"),
        ("samples_per_min_without_checkpoints", "the same without checkpoint writes"),
    ):
        lines.append(f"| {name} | {ro[key]:.2f} | {rt[key]:.2f} | {ro[key] / rt[key]:.2f}x |")
    lines.append(
        f"| seconds per step | {ro['step_s_mean']:.1f} | {rt['step_s_mean']:.1f} | "
        f"{rt['step_s_mean'] / ro['step_s_mean']:.2f}x faster |"
    )
    lines.append(
        f"| samples generated per sample trained | {ours.get('generated_per_trained', '?')} | 1 "
        "(constant groups trained at advantage 0) | |"
    )
    lines.append(
        f"| completion tokens (mean) | {ours.get('completion_tokens', '?')} | "
        f"{trl.get('completion_tokens', '?')} | |"
    )
    lines.append(f"| precision | {ours.get('precision', '?')} | {trl.get('precision', '?')} | |")
    lines.append(f"| threads | {ours.get('threads', '?')} | {trl.get('threads', '?')} | |")
    lines += ["", "Where a step's time goes (mean seconds per step, steps 2..N):", ""]
    for side, bd in (("this stack", ours["breakdown"]), ("TRL", trl["breakdown"])):
        lines.append(f"- {side}: " + ", ".join(f"{k} {v:.2f}" for k, v in bd.items()))
    ev = res.get("eval")
    if ev:
        how = (
            "paired over the same rows; differences are this stack minus TRL, ± paired SE"
            if not any(c["diff"]["exact"].get("paired") is False for c in ev["comparisons"])
            else f"the same rows; TRL's side is the recorded run of `{res.get('trl_result')}`, "
            "whose per-row results were not kept, so differences are this stack minus TRL "
            "unpaired: exact match ± the SE of two independent proportions, rewards without one"
        )
        lines += [
            "",
            f"Validation, {ev['rows']} rows, greedy (vLLM), {how}; reward = the paper's "
            "(DARS 1000), trained reward = the preset's variant:",
            "",
            "| point | samples (ours / TRL) | exact match % (ours / TRL) | diff (points) | "
            "reward (ours / TRL) | diff | trained reward (ours / TRL) | diff |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in ev["comparisons"]:
            o, t, c = row["ours"], row["trl"], row["diff"]
            lines.append(
                f"| {row['point']} | {row['samples_ours']} / {row['samples_trl']} | "
                f"{100 * o['exact']:.1f} / {100 * t['exact']:.1f} | {plus_minus(c['exact'], 100, 1)} | "
                f"{o['reward']:.2f} / {t['reward']:.2f} | {plus_minus(c['reward'])} | "
                f"{o['train_reward']:.3f} / {t['train_reward']:.3f} | "
                f"{plus_minus(c['train_reward'], 1, 3)} |"
            )
        sft = ev["sft"]
        lines.append(
            f"\nStart model (SFT): exact match {100 * sft['exact']:.1f}%, reward "
            f"{sft['reward']:.2f}, trained reward {sft['train_reward']:.3f}."
        )
    lines += ["", "Not held equal (and why):", ""]
    lines += [f"- {k}: {v}" for k, v in res["not_matched"].items()]
    return "\n".join(lines) + "\n"


def train_rewards(predictions: Path, rows: Sequence[Mapping[str, Any]], reward: Any) -> list[float]:
    """Each row's completion in ``predictions.jsonl`` scored with the reward the runs trained
    on (``reward``: the env's ``reward_config()``), in the order of ``rows``."""
    from env_server.reward import score

    by_key = {(p["session_id"], p["step"]): p["completion"] for p in read_jsonl(predictions)}
    return [
        score(by_key[(r["session_id"], r["step"])], json.loads(r["action"]), reward).total
        for r in rows
    ]
