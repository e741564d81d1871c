"""The text the embedded model's tokenizer is trained on.

Everything the model will read or write: the system prompt, the rendered whole-session user
prompts (which contain every page's HTML and the earlier actions), the assistant targets
(rationale + action JSON) and the chat roles. Deterministic: the same arguments give the same
texts in the same order on every call (``trainer.tiny_model`` relies on it for a
byte-identical tokenizer).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from env_server.data.dataset import rows_from_session
from env_server.data.simulator import generate_sessions
from env_server.prompts import SYSTEM_PROMPT, build_messages, format_target


def iter_corpus_texts(num_sessions: int = 400, seed: int = 0) -> Iterator[str]:
    """Yield the corpus texts, session by session."""
    yield "system user assistant"
    for session in generate_sessions(num_sessions, seed):
        yield SYSTEM_PROMPT
        rows = rows_from_session(session)
        # The last step's prompt holds every page of the session once; earlier steps' prompts
        # would repeat the same pages (quadratic size, same merges).
        yield build_messages(rows[-1])[1]["content"]
        yield build_messages(rows[-1], latest_only=True)[1]["content"]
        for row in rows:
            yield format_target(row["rationale"], json.loads(row["action"]))
