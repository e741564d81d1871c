"""A tool-calling verifiers env, written as a user would (public ``verifiers.v1`` API only):
the model is asked a sum and has a Python tool, ``calc_add(a, b)``, served by a
``vf.Toolset`` (an MCP server verifiers starts as a local subprocess, ``tools.py``);
verifiers' ``null`` harness runs the chat loop that executes the model's tool calls and
hands the results back as tool messages. Reward: the final reply holds the right sum."""

import verifiers.v1 as vf
from verifiers.v1.harnesses.null import NullHarness

from vf_tool.tools import Calc, CalcConfig


class SumData(vf.TaskData):
    a: int
    b: int


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(str(self.data.a + self.data.b) in (trace.last_reply or ""))

    @vf.metric
    async def called_tool(self, trace: vf.Trace) -> float:
        return float(trace.num_turns > 1)


class SumConfig(vf.TasksetConfig):
    pairs: list[tuple[int, int]] = [(2, 3)]
    tools: CalcConfig = CalcConfig()


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self) -> list[SumTask]:
        return [
            SumTask(SumData(prompt=f"What is {a} + {b}? Use the tool.", a=a, b=b), self.config.task)
            for a, b in self.config.pairs
        ]

    @classmethod
    def toolsets(cls, config: SumConfig) -> list[vf.Toolset]:
        return [Calc(config.tools)]


# verifiers' null harness: the chat loop, with MCP tools (the default would be `bash`).
__all__ = ["NullHarness", "SumTaskset"]
