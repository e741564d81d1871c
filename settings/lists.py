"""List fields of the configs: a YAML list, repeated flags, or the old comma-joined string
(``--inference-url A,B``, ``SHOP_R1_...=A,B``), split here and nowhere else."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator
from pydantic_settings import NoDecode


def split_commas(value: Any) -> Any:
    """``"a, b,"`` -> ``["a", "b"]``; each string of a list split the same way; anything
    else is left to the field's type to refuse."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        return value
    return [p.strip() for v in value for p in v.split(",") if p.strip()]


CommaList = Annotated[list[str], NoDecode, BeforeValidator(split_commas)]
"""``list[str]`` that also takes one comma-separated string (environment variables are not
read as JSON: ``NoDecode``)."""
