"""atroposlib's example trainer's data loop, unchanged, against an Atropos-style API.

    python atropos_trainer.py URL BATCH_SIZE OUT_JSON STOP_FILE [TORCH_SITE_PACKAGES]

Runs in the atroposlib virtualenv. ``example_trainer`` needs torch, which that virtualenv
does not install (a second multi-GB torch for a data loop): the project's site-packages
directory is appended to ``sys.path`` (last, so every package atroposlib installed wins).
Registers with ``example_trainer.api.register_trainer`` and calls
``example_trainer.data.get_data`` (which calls ``get_batch`` and pads every batch into
tensors) until ``STOP_FILE`` exists and the API has nothing left; every raw ``/batch`` reply
is written to ``OUT_JSON``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


class Stop(Exception):
    pass


def main() -> None:
    url, batch_size, out, stop = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    if len(sys.argv) > 5:
        sys.path.append(sys.argv[5])
    import example_trainer.data as data
    from example_trainer.api import register_trainer
    from example_trainer.config import TrainingConfig

    cfg = TrainingConfig(
        model_name="toy",
        batch_size=batch_size,
        gradient_accumulation_steps=1,
        seq_len=256,
        training_steps=1000,
        atropos_url=url,
    )
    register_trainer(cfg)
    replies: list[dict] = []
    in_call = [0]  # batches get_data has taken in its current call (it returns them on None)
    original = data.get_batch

    def get_batch(url: str = url) -> dict:
        reply = original(url=url)
        if reply.get("batch") is not None:
            replies.append(json.loads(json.dumps(reply)))  # get_data rewrites it in place
            in_call[0] += 1
        elif Path(stop).exists() and not in_call[0]:  # nothing held back: stop
            raise Stop
        return reply

    data.get_batch = get_batch  # record every reply; get_data itself is atroposlib's
    steps = 0
    try:
        while True:
            batches, _ = data.get_data(batch_size, 256, atropos_url=url)
            steps += len(batches)
            in_call[0] = 0
    except Stop:
        pass
    out.write_text(json.dumps({"replies": replies, "padded_batches": steps}))


if __name__ == "__main__":
    main()
