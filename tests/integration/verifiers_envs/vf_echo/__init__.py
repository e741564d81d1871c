"""A single-turn verifiers env, written as a user would (public ``verifiers.v1`` API only):
the model answers once; the reward is the share of the prompt's words its reply repeats."""

import verifiers.v1 as vf
from verifiers.v1.harnesses.null import NullHarness

WORDS = ["apple", "river", "stone", "cloud", "green", "seven", "light", "table"]


class EchoData(vf.TaskData):
    word: str


class EchoTask(vf.Task[EchoData]):
    @vf.stop
    async def single_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def echoed(self, trace: vf.Trace) -> float:
        return float(self.data.word in (trace.last_reply or ""))

    @vf.reward(weight=0.1)
    async def short(self, trace: vf.Trace) -> float:
        return 1.0 / (1.0 + len(trace.last_reply or ""))


class EchoConfig(vf.TasksetConfig):
    num_tasks: int = 8


class EchoTaskset(vf.Taskset[EchoTask, EchoConfig]):
    def load(self) -> list[EchoTask]:
        return [
            EchoTask(
                EchoData(prompt=f"Repeat the word: {w}", word=w, system_prompt="Be brief."),
                self.config.task,
            )
            for w in WORDS[: self.config.num_tasks]
        ]


# The tool-less chat loop as this taskset's harness (verifiers' default is `bash`).
__all__ = ["EchoTaskset", "NullHarness"]
