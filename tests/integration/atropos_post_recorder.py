"""A test-only recorder around atroposlib's post, shared by the Atropos test envs
(atropos_recorded_env.py, atropos_toy_env.py): every group an env posts is written as an
``intent`` line just before the post and an ``acked`` line once the API answered 2xx, so a
test can check what the trainer was served against what was posted and acknowledged.

Runs in the atroposlib virtualenv, imported by a script in this folder (which is then on
``sys.path``); it imports nothing from atroposlib itself. Put ``PostRecorder`` before the
env's base in its bases, so that its ``_post_json_with_compression`` wraps atroposlib's.
"""

import json
from contextlib import asynccontextmanager
from typing import Any


class PostRecorder:
    """Wraps ``BaseEnv._post_json_with_compression`` (which returns an async context manager
    around the response). A subclass says where the lines go (``record_path``) and what a
    group's line holds (``record_entry``)."""

    def record_path(self) -> str:
        """The JSONL file the lines are appended to (opened for each post)."""
        raise NotImplementedError

    def record_entry(self, group: dict[str, Any]) -> dict[str, Any]:
        """The fields of ``group``'s lines; called before the post, so it may set fields of
        the group itself (an idempotency key)."""
        raise NotImplementedError

    def _post_json_with_compression(self, session: Any, url: str, payload: Any, **kw: Any):
        record = open(self.record_path(), "a", buffering=1)  # noqa: SIM115 (closed below)
        items = payload if isinstance(payload, list) else [payload]
        entries = [self.record_entry(g) for g in items]
        for entry in entries:
            record.write(json.dumps({"event": "intent", **entry}) + "\n")
        try:
            posted = super()._post_json_with_compression(session, url, payload, **kw)  # type: ignore[misc]
        except BaseException:
            record.close()
            raise

        @asynccontextmanager
        async def recorded():
            try:
                async with posted as resp:
                    yield resp
                    ok = resp.status < 300
                for entry in entries if ok else []:
                    record.write(json.dumps({"event": "acked", **entry}) + "\n")
            finally:
                record.close()

        return recorded()
