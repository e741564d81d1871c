"""Guess the number: a multi-turn atroposlib (0.4.0) environment, written as a user writes
one, with nothing of this project in it (docs/ATROPOS.md, "Multi-turn environments").

The model guesses a secret integer in ``[low, high]``; the env answers each guess with
"Higher" or "Lower" until the model finds it or ``max_turns`` guesses are spent -- the game
of ``examples/verifiers_envs/guess_number``, played in-process. Reward: 1.0 for a win at the
first guess, 0.1 less for every further guess (never below ``min_win``), 0.0 for a loss, plus
``format_weight`` x the share of replies that held a number.

Secrets that are multiples of ``holdout_every`` are held out: training draws only the others
(``get_next_item``), and ``evaluate`` plays every held-out secret ``eval_samples`` times at
the training temperature, writing one line per episode to ``samples.jsonl`` in
``data_dir_to_save_evals`` (atroposlib's ``evaluate_log``).

Every rollout is one conversation played through atroposlib's ``ManagedServer`` (its
recommended way): the tokens vLLM sampled in every turn, the prompt and the env's replies
between them masked. With a chat template that is not append-only, ManagedServer starts a
new node when a turn's prompt does not extend the last one; such an episode keeps only its
last node (its earlier turns untrained) and is counted in ``train/split_episodes``.

    python guess_number.py serve --config env.yaml      # rollouts to a trainer's API
    python guess_number.py evaluate --config env.yaml   # the held-out secrets, once
"""

import asyncio
import random
import re
import time
from typing import Any

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup
from pydantic import Field

NUMBER = re.compile(r"-?\d+")
SYSTEM = (
    "You are playing a number guessing game. Each reply must be a single integer: your "
    "guess. After each guess you are told whether the secret is higher or lower."
)


class GuessConfig(BaseEnvConfig):
    low: int = 1
    high: int = 20
    max_turns: int = 6
    holdout_every: int = Field(5, description="secrets that are multiples are held out")
    min_win: float = 0.3
    format_weight: float = 0.2
    temperature: float = 0.7
    eval_samples: int = Field(16, description="episodes per held-out secret in evaluate")
    seed: int = 0


def judge(reply: str, secret: int) -> tuple[str | None, bool]:
    """(the env's answer, None when solved; whether the reply held a number)."""
    m = NUMBER.search(reply or "")
    if m is None:
        return "Reply with a single integer.", False
    guess = int(m.group())
    if guess == secret:
        return None, True
    hint = "Higher" if guess < secret else "Lower"
    return f"{hint}. Your next guess? Reply with the number only.", True


class GuessNumberEnv(BaseEnv):
    name = "guess_number"
    env_config_cls = GuessConfig

    @classmethod
    def config_init(cls) -> tuple[GuessConfig, list[APIServerConfig]]:
        env = GuessConfig(group_size=8, use_wandb=False, max_token_length=8)
        server = APIServerConfig(
            model_name="model", base_url="http://localhost:9001/v1", server_type="vllm"
        )
        return env, [server]

    async def setup(self) -> None:
        c = self.config
        self.rng = random.Random(c.seed)
        self.held_out = [s for s in range(c.low, c.high + 1) if s % c.holdout_every == 0]
        self.train_secrets = [s for s in range(c.low, c.high + 1) if s not in self.held_out]
        self.split_episodes = 0
        self.episodes = 0

    async def get_next_item(self) -> int:
        return self.rng.choice(self.train_secrets)

    async def play(self, secret: int) -> dict[str, Any]:
        """One game: its ManagedServer node, reward, guesses and replies that held a number."""
        c = self.config
        prompt = (
            f"I am thinking of an integer between {c.low} and {c.high}. "
            f"You have {c.max_turns} guesses. Your first guess? Reply with the number only."
        )
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
        turns, valid, solved = 0, 0, False
        async with self.server.managed_server(tokenizer=self.tokenizer) as managed:
            while turns < c.max_turns:
                reply = await managed.chat_completion(
                    messages=messages,
                    n=1,
                    max_tokens=c.max_token_length,
                    temperature=c.temperature,
                )
                text = reply.choices[0].message.content or ""
                turns += 1
                answer, ok = judge(text, secret)
                valid += ok
                if answer is None:
                    solved = True
                    break
                messages += [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": answer},
                ]
            nodes = managed.get_state()["nodes"]
        win = max(c.min_win, 1.0 - 0.1 * (turns - 1)) if solved else 0.0
        return {
            "node": nodes[-1],
            "split": len(nodes) > 1,
            "reward": win + c.format_weight * valid / turns,
            "turns": turns,
            "solved": solved,
        }

    async def collect_trajectories(self, item: int) -> tuple[ScoredDataGroup, list]:
        games = await asyncio.gather(*(self.play(item) for _ in range(self.config.group_size)))
        self.episodes += len(games)
        self.split_episodes += sum(g["split"] for g in games)
        group = ScoredDataGroup(tokens=[], masks=[], scores=[], inference_logprobs=[])
        for g in games:
            group["tokens"].append(g["node"].tokens)
            group["masks"].append(g["node"].masked_tokens)
            group["inference_logprobs"].append(g["node"].logprobs)
            group["scores"].append(g["reward"])
        return group, []

    async def wandb_log(self, wandb_metrics: dict | None = None) -> None:
        wandb_metrics = dict(wandb_metrics or {})
        wandb_metrics["train/split_episodes"] = self.split_episodes / max(1, self.episodes)
        await super().wandb_log(wandb_metrics)

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        start = time.time()
        jobs = [(s, i) for s in self.held_out for i in range(self.config.eval_samples)]
        games = await asyncio.gather(*(self.play(s) for s, _ in jobs))
        samples = [
            {
                "kind": "episode",
                "task": secret,
                "sample": i,
                "reward": g["reward"],
                "turns": g["turns"],
                "solved": g["solved"],
                "split": g["split"],
                "error": None,
            }
            for (secret, i), g in zip(jobs, games, strict=True)
        ]
        n = len(samples)
        metrics = {
            "eval/reward_mean": sum(s["reward"] for s in samples) / n,
            "eval/solved": sum(s["solved"] for s in samples) / n,
            "eval/turns_mean": sum(s["turns"] for s in samples) / n,
        }
        await self.evaluate_log(
            metrics,
            start_time=start,
            end_time=time.time(),
            generation_parameters={
                "temperature": self.config.temperature,
                "max_tokens": self.config.max_token_length,
            },
            samples=samples,
        )


if __name__ == "__main__":
    GuessNumberEnv.cli()
