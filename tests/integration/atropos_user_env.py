"""An Atropos environment as a user writes one (atroposlib 0.4.0, nothing of this project):
copy a word. The prompt asks the model to repeat a word; the reward is verifiable, the
similarity of the completion's first word to it (``difflib``), 1.0 for an exact copy.

It samples through atroposlib's ``ManagedServer`` on a ``server_type: vllm`` server (Atropos's
``/generate``), so every completion comes with its token ids and logprobs, and posts its groups
with atroposlib's own code. Run with atroposlib's CLI:

    python atropos_user_env.py serve --config env.yaml

docs/ATROPOS.md shows the YAML that points it at this stack.
"""

import difflib
import random
from typing import Any

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup

WORDS = "shoes cart search checkout jacket price laptop coffee garden window orange basket".split()


class CopyWordEnv(BaseEnv):
    name = "copy_word"

    @classmethod
    def config_init(cls) -> tuple[BaseEnvConfig, list[APIServerConfig]]:
        env = BaseEnvConfig(group_size=4, use_wandb=False, max_token_length=8)
        server = APIServerConfig(
            model_name="model", base_url="http://localhost:9001/v1", server_type="vllm"
        )
        return env, [server]

    async def setup(self) -> None:
        self.rng = random.Random(0)

    async def get_next_item(self) -> str:
        return self.rng.choice(WORDS)

    async def collect_trajectories(self, item: str) -> tuple[ScoredDataGroup, list]:
        prompt = f"Repeat the word: {item}\nAnswer:"
        async with self.server.managed_server(tokenizer=self.tokenizer) as managed:
            await managed.completion(
                prompt=prompt,
                n=self.config.group_size,
                max_tokens=self.config.max_token_length,
                temperature=1.0,
            )
            nodes = managed.get_state()["nodes"]
        group = ScoredDataGroup(
            tokens=[], masks=[], scores=[], inference_logprobs=[], overrides=None
        )
        for node in nodes:
            completion = [t for t in node.masked_tokens if t != -100]
            words = self.tokenizer.decode(completion).split()
            answer = words[0] if words else ""
            group["tokens"].append(node.tokens)
            group["masks"].append(node.masked_tokens)
            group["inference_logprobs"].append(node.logprobs)
            group["scores"].append(difflib.SequenceMatcher(None, answer, item).ratio())
        return group, []

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        return None


if __name__ == "__main__":
    CopyWordEnv.cli()
