"""guess-number: a multi-turn verifiers (v1) env for a learning run (docs/VERIFIERS.md).

The model guesses a secret integer in ``[low, high]``; the game answers each guess with
"higher" or "lower" (the env plays the user, as verifiers' TextArena env does) until the
model finds it or ``max_turns`` guesses are spent. Reward ``solved``: 1.0 for a win at the
first guess, 0.1 less for every further guess (never below ``min_win``), 0.0 for a loss,
so a policy learns to win and to win in fewer turns (binary search); plus ``format``:
``format_weight`` times the share of replies that held a number (a small instruct model at
first often answers in prose). Metrics: ``guesses``, ``won``, ``valid``.

Splits of secrets: ``test`` holds every ``holdout_every``-th number of the range (held out),
``train`` the rest; each secret is repeated ``repeats`` times per epoch. Evaluate a trained
policy on ``--env-args '{"split": "test"}'``.
"""

from __future__ import annotations

import re

import verifiers.v1 as vf
from verifiers.v1.harnesses.null import NullHarness

NUMBER = re.compile(r"-?\d+")
SYSTEM = (
    "You are playing a number guessing game. Each reply must be a single integer: your "
    "guess. After each guess you are told whether the secret is higher or lower."
)


class GuessData(vf.TaskData):
    secret: int


class GuessTask(vf.Task[GuessData]):
    pass


class GuessConfig(vf.TasksetConfig):
    low: int = 1
    high: int = 20
    max_turns: int = 6
    split: str = "train"
    """``train`` or ``test`` (every ``holdout_every``-th secret, never trained on)."""
    holdout_every: int = 5
    repeats: int = 1
    min_win: float = 0.3
    format_weight: float = 0.2
    """Credit for replying with a number at all: this times the share of replies that held
    one (a small model must first learn to answer in the game's form)."""


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self) -> list[GuessTask]:
        c = self.config
        if c.split not in ("train", "test"):
            raise ValueError(f"split must be train or test, got {c.split!r}")
        held_out = {s for s in range(c.low, c.high + 1) if s % c.holdout_every == 0}
        secrets = [s for s in range(c.low, c.high + 1) if (s in held_out) == (c.split == "test")]
        prompt = (
            f"I am thinking of an integer between {c.low} and {c.high}. "
            f"You have {c.max_turns} guesses. Your first guess? Reply with the number only."
        )
        return [
            GuessTask(
                GuessData(prompt=prompt, system_prompt=SYSTEM, secret=s, name=f"secret-{s}"),
                self.config.task,
            )
            for _ in range(c.repeats)
            for s in secrets
        ]


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


def judge(reply: str, secret: int) -> tuple[str | None, bool]:
    """(the game's answer, None when solved; whether the reply held a number)."""
    m = NUMBER.search(reply or "")
    if m is None:
        return "Reply with a single integer.", False
    guess = int(m.group())
    if guess == secret:
        return None, True
    hint = "Higher" if guess < secret else "Lower"
    return f"{hint}. Your next guess? Reply with the number only.", True


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        c = self.taskset.config
        turns, valid, solved = 0, 0, False
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            while not segment.terminated:
                turns += 1
                answer, ok = judge(segment.last_reply, task.data.secret)
                valid += ok
                if answer is None:
                    solved = True
                    break
                if turns >= c.max_turns:
                    break
                segment = await interaction.turn(answer)
        trace = interaction.trace
        reward = max(c.min_win, 1.0 - 0.1 * (turns - 1)) if solved else 0.0
        trace.record_reward("solved", reward)
        trace.record_reward("format", c.format_weight * valid / max(1, turns))
        trace.record_metric("guesses", float(turns))
        trace.record_metric("won", float(solved))
        trace.record_metric("valid", valid / max(1, turns))


# The tool-less chat loop as this taskset's harness (verifiers' default is `bash`).
__all__ = ["GuessEnv", "GuessTaskset", "NullHarness"]
