"""The user's ``CopyWordEnv`` (atropos_user_env.py) with a test-only recorder around
atroposlib's post: each group gets a ``group_overrides.group_id`` (the API's idempotency key,
so the test can follow it into the API's database) and is written to ``$ATROPOS_RECORD`` as
``intent`` before the post and ``acked`` once the API answered 2xx. The env's own code runs
unchanged; run with atroposlib's CLI: ``python atropos_recorded_env.py serve --config ...``."""

import json
import os
import uuid
from contextlib import asynccontextmanager
from typing import Any

from atropos_user_env import CopyWordEnv


class RecordedCopyWordEnv(CopyWordEnv):
    name = "copy_word"

    def _post_json_with_compression(self, session: Any, url: str, payload: Any, **kw: Any):
        record = open(os.environ["ATROPOS_RECORD"], "a", buffering=1)  # noqa: SIM115
        items = payload if isinstance(payload, list) else [payload]
        for g in items:
            overrides = g.get("group_overrides") or {}
            overrides.setdefault("group_id", f"copy-{uuid.uuid4().hex}")
            g["group_overrides"] = overrides
            record.write(json.dumps({"event": "intent", "group_id": overrides["group_id"]}) + "\n")
        posted = super()._post_json_with_compression(session, url, payload, **kw)

        @asynccontextmanager
        async def recorded():
            async with posted as resp:
                yield resp
                ok = resp.status < 300
            for g in items if ok else []:
                gid = g["group_overrides"]["group_id"]
                record.write(json.dumps({"event": "acked", "group_id": gid}) + "\n")
            record.close()

        return recorded()


if __name__ == "__main__":
    RecordedCopyWordEnv.cli()
