"""The user's ``GuessNumberEnv`` (atropos_multiturn_env.py) with the test-only post recorder
(atropos_post_recorder.py): each group gets a ``group_overrides.group_id`` (the API's
idempotency key, so the test can follow it into the API's database) and is written whole --
tokens, masks, inference logprobs, scores -- to ``$ATROPOS_RECORD`` before the post
(``intent``) and once the API answered 2xx (``acked``). The env's own code runs unchanged;
run with atroposlib's CLI: ``python atropos_multiturn_recorded_env.py serve --config ...``."""

import os
import uuid
from typing import Any

from atropos_multiturn_env import GuessNumberEnv
from atropos_post_recorder import PostRecorder


class RecordedGuessNumberEnv(PostRecorder, GuessNumberEnv):
    name = "guess_number"

    def record_path(self) -> str:
        return os.environ["ATROPOS_RECORD"]

    def record_entry(self, group: dict[str, Any]) -> dict[str, Any]:
        overrides = group.get("group_overrides") or {}
        overrides.setdefault("group_id", f"guess-{uuid.uuid4().hex}")
        group["group_overrides"] = overrides
        fields = ("tokens", "masks", "inference_logprobs", "scores")
        return {"group_id": overrides["group_id"], **{k: group[k] for k in fields}}


if __name__ == "__main__":
    RecordedGuessNumberEnv.cli()
