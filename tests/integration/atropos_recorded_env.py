"""The user's ``CopyWordEnv`` (atropos_user_env.py) with a test-only recorder around
atroposlib's post: each group gets a ``group_overrides.group_id`` (the API's idempotency key,
so the test can follow it into the API's database) and is written to ``$ATROPOS_RECORD`` as
``intent`` before the post and ``acked`` once the API answered 2xx (atropos_post_recorder.py).
The env's own code runs unchanged; run with atroposlib's CLI:
``python atropos_recorded_env.py serve --config ...``."""

import os
import uuid
from typing import Any

from atropos_post_recorder import PostRecorder
from atropos_user_env import CopyWordEnv


class RecordedCopyWordEnv(PostRecorder, CopyWordEnv):
    name = "copy_word"

    def record_path(self) -> str:
        return os.environ["ATROPOS_RECORD"]

    def record_entry(self, group: dict[str, Any]) -> dict[str, Any]:
        overrides = group.get("group_overrides") or {}
        overrides.setdefault("group_id", f"copy-{uuid.uuid4().hex}")
        group["group_overrides"] = overrides
        return {"group_id": overrides["group_id"]}


if __name__ == "__main__":
    RecordedCopyWordEnv.cli()
