"""A multi-turn verifiers env, written as a user would: guess the secret number; the env
answers each guess with "higher" or "lower" (the game plays the user, as verifiers'
TextArena env does). Reward: 1 when solved, minus 0.1 per extra turn; 0 otherwise."""

import re

import verifiers.v1 as vf
from verifiers.v1.harnesses.null import NullHarness

NUMBER = re.compile(r"\d+")  # digits only: a negative secret cannot be guessed


class GuessData(vf.TaskData):
    secret: int


class GuessTask(vf.Task[GuessData]):
    pass


class GuessConfig(vf.TasksetConfig):
    secrets: list[int] = [3, 7, 12, 18]
    low: int = 1
    high: int = 20
    max_turns: int = 3


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self) -> list[GuessTask]:
        c = self.config
        prompt = f"Guess my number between {c.low} and {c.high}. Reply with one number."
        return [GuessTask(GuessData(prompt=prompt, secret=s), self.config.task) for s in c.secrets]


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


def feedback(reply: str, secret: int) -> str | None:
    """None when solved, else what the game says back."""
    m = NUMBER.search(reply or "")
    if m is None:
        return "Reply with a number."
    guess = int(m.group())
    if guess == secret:
        return None
    return "higher" if guess < secret else "lower"


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        max_turns = self.taskset.config.max_turns
        turns, solved = 0, False
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            while not segment.terminated:
                turns += 1
                answer = feedback(segment.last_reply, task.data.secret)
                if answer is None:
                    solved = True
                    break
                if turns >= max_turns:
                    break
                segment = await interaction.turn(answer)
        trace = interaction.trace
        trace.record_reward("solved", 1.0 - 0.1 * (turns - 1) if solved else 0.0)
        trace.record_metric("guesses", float(turns))


__all__ = ["GuessEnv", "GuessTaskset", "NullHarness"]
