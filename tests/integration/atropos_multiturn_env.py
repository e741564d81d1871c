"""A multi-turn Atropos environment as a user writes one (atroposlib 0.4.0, nothing of this
project): guess the number. The env picks a number from 1 to 9; the model guesses, the env
answers "higher" / "lower" / "correct", the model guesses again -- ``TURNS`` model turns in
one conversation. The reward is verifiable: how close the last guess is (1.0 when right, 0.0
without a digit), in steps of 0.1.

Each rollout is one conversation played through atroposlib's ``ManagedServer`` (its
recommended way): ``managed.chat_completion`` once per turn, the conversation extended with
the model's answer and the env's reply. ManagedServer keeps one node per conversation: the
tokens vLLM sampled in every turn (``masked_tokens`` = the token id, logprob = vLLM's) and the
prompt and env replies between them (``-100``, logprob 1.0), so a sequence has one trained run
per model turn. On a ``server_type: vllm`` server it samples through Atropos's ``/generate``
with the node's own tokens as the prompt. Run with atroposlib's CLI:

    python atropos_multiturn_env.py serve --config env.yaml

Ties are broken by rollout order (``+ 0.01 * i``, less than the 0.1 between two rewards):
atroposlib skips a group whose scores are all equal, and a small random model often guesses
nothing; this way every group carries a spread and is posted.
"""

import asyncio
import random
import re
from typing import Any

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup

TURNS = 3
LOW, HIGH = 1, 9
TIE_BREAK = 0.01
PROMPT = f"I picked a number from {LOW} to {HIGH}. Guess it: answer with one digit."


def guess_of(answer: str) -> int | None:
    """The first digit in the model's answer, or None."""
    found = re.search(r"[0-9]", answer)
    return int(found.group()) if found else None


def hint(guess: int | None, secret: int) -> str:
    if guess is None:
        return "That is not a digit. Guess again: answer with one digit."
    if guess == secret:
        return "Correct! Say it once more."
    return "Higher." if guess < secret else "Lower."


def reward(guess: int | None, secret: int) -> float:
    if guess is None:
        return 0.0
    return round(1.0 - abs(guess - secret) / 10, 1)


class GuessNumberEnv(BaseEnv):
    name = "guess_number"

    @classmethod
    def config_init(cls) -> tuple[BaseEnvConfig, list[APIServerConfig]]:
        env = BaseEnvConfig(group_size=4, use_wandb=False, max_token_length=4)
        server = APIServerConfig(
            model_name="model", base_url="http://localhost:9001/v1", server_type="vllm"
        )
        return env, [server]

    async def setup(self) -> None:
        self.rng = random.Random(0)

    async def get_next_item(self) -> int:
        return self.rng.randint(LOW, HIGH)

    async def play(self, secret: int) -> tuple[Any, float]:
        """One conversation of ``TURNS`` model turns: its ManagedServer node and reward."""
        messages = [{"role": "user", "content": PROMPT}]
        guess = None
        async with self.server.managed_server(tokenizer=self.tokenizer) as managed:
            for turn in range(TURNS):
                reply = await managed.chat_completion(
                    messages=messages,
                    n=1,
                    max_tokens=self.config.max_token_length,
                    temperature=1.0,
                )
                answer = reply.choices[0].message.content or ""
                guess = guess_of(answer)
                messages.append({"role": "assistant", "content": answer})
                if turn < TURNS - 1:
                    messages.append({"role": "user", "content": hint(guess, secret)})
            nodes = managed.get_state()["nodes"]
        if len(nodes) != 1:  # a turn did not extend the conversation's node (chat template)
            raise RuntimeError(
                f"expected one node per conversation, ManagedServer kept {len(nodes)}"
            )
        return nodes[0], reward(guess, secret)

    async def collect_trajectories(self, item: int) -> tuple[ScoredDataGroup, list]:
        played = await asyncio.gather(*(self.play(item) for _ in range(self.config.group_size)))
        group = ScoredDataGroup(
            tokens=[], masks=[], scores=[], inference_logprobs=[], overrides=None
        )
        for i, (node, score) in enumerate(played):
            group["tokens"].append(node.tokens)
            group["masks"].append(node.masked_tokens)
            group["inference_logprobs"].append(node.logprobs)
            group["scores"].append(score + TIE_BREAK * i)
        return group, []

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        return None


if __name__ == "__main__":
    GuessNumberEnv.cli()
