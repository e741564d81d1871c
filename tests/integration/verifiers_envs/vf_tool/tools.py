"""The env's tool server: a ``vf.Toolset`` whose ``@vf.tool`` methods verifiers serves over
MCP. verifiers starts it as ``python -m vf_tool.tools`` in the toolset's runtime (a local
subprocess here); the model sees the tool as ``calc_add``."""

import verifiers.v1 as vf


class CalcConfig(vf.ToolsetConfig):
    pass


class Calc(vf.Toolset[CalcConfig, vf.State]):
    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


if __name__ == "__main__":
    Calc.run()
