"""SFT examples (trainer/sft_data.py): encoded on several threads, the examples and their
order are those of one thread, and rows that cannot fit are left out of both alike; encoded
lazily (``LazySplit``, what ``trainer.sft`` reads), the batches are those of the whole split
encoded first when every row fits, and a row that does not fit is skipped where it is drawn."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from env_server.data.dataset import build_dataset
from trainer.config import SftConfig
from trainer.sft import _next_batch
from trainer.sft_data import (
    LazySplit,
    encode_example,
    encode_split,
    epoch_order,
    stratified_order,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("max_seq_len", [1024, 400])
def test_threaded_encoding_equals_one_thread(tiny_model_dir: Path, max_seq_len: int) -> None:
    rows = build_dataset(num_sessions=60, seed=0)["train"].to_list()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    one = [encode_example(r, tok, max_seq_len) for r in rows]
    kept = [e for e in one if e is not None]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        many = encode_split(rows, tok, max_seq_len, latest_only=False)
    finally:
        torch.set_num_threads(threads)
    assert len(kept) > 100
    if max_seq_len == 400:
        assert len(kept) < len(rows)  # some rows cannot fit: left out, the order kept
    assert [(e.tokens, e.loss_mask, e.prompt_len) for e in many] == [
        (e.tokens, e.loss_mask, e.prompt_len) for e in kept
    ]


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class _Cursor:
    data_epoch = 0
    data_index = 0


def _batches(rows: LazySplit, n: int, batch_size: int) -> list[list[list[int]]]:
    cfg = SftConfig(
        batch_size=batch_size, micro_batch_size=batch_size, max_seq_len=rows.max_seq_len
    )
    cursor = _Cursor()
    return [[e.tokens for e in _next_batch(rows, cfg, cursor)] for _ in range(n)]


def test_lazy_batches_equal_the_encoded_split_when_every_row_fits(tiny_model_dir: Path) -> None:
    rows = build_dataset(num_sessions=30, seed=0)["train"].to_list()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    eager = encode_split(rows, tok, 1024, latest_only=False)
    assert len(eager) == len(rows)
    lazy = LazySplit(rows, tok, 1024, latest_only=False)
    # what trainer.sft drew before: epoch orders over the encoded split, 8 at a time
    n = 2 * len(rows) // 8 + 3  # into the third epoch
    order = [i for epoch in range(3) for i in epoch_order(len(eager), 0, epoch)]
    want = [[eager[i].tokens for i in order[b * 8 : b * 8 + 8]] for b in range(n)]
    assert _batches(lazy, n, 8) == want
    assert [e.tokens for e in lazy.first(5)] == [e.tokens for e in eager[:5]]


def test_lazy_split_skips_rows_that_do_not_fit(tiny_model_dir: Path) -> None:
    rows = build_dataset(num_sessions=30, seed=0)["train"].to_list()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    fits = {i for i, r in enumerate(rows) if encode_example(r, tok, 400) is not None}
    assert 0 < len(fits) < len(rows)
    lazy = LazySplit(rows, tok, 400, latest_only=False)
    # a handler on the module's own logger, enabled here whatever an earlier test in this
    # worker did to logging: pytest's caplog handler sits on the root logger, which a library
    # can take away (basicConfig(force=True)), and a library's dictConfig can disable existing
    # loggers, raise the root level or call logging.disable
    warned = _Collect()
    logger = logging.getLogger("trainer.sft_data")
    saved = (logger.disabled, logger.level, logging.root.manager.disable)
    logger.disabled = False
    logger.setLevel(logging.WARNING)
    logging.disable(logging.NOTSET)
    logger.addHandler(warned)
    try:
        batches = _batches(lazy, 6, 8)
    finally:
        logger.removeHandler(warned)
        logger.disabled, _, _ = saved
        logger.setLevel(saved[1])
        logging.disable(saved[2])
    assert all(len(b) == 8 for b in batches)
    kept = {tuple(encode_example(rows[i], tok, 400).tokens) for i in fits}
    assert all(tuple(t) in kept for b in batches for t in b)
    assert lazy.skipped and set(lazy.skipped) <= set(range(len(rows))) - fits
    assert [f"row {i} does not fit max_seq_len=400; skipped" for i in lazy.skipped] == warned.lines
    assert len(lazy.first(10)) == 10


def test_no_row_fits_is_an_error(tiny_model_dir: Path) -> None:
    rows = build_dataset(num_sessions=30, seed=0)["train"].to_list()[:20]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match="no example fits max_seq_len=20"):
        _batches(LazySplit(rows, tok, 20, latest_only=False), 1, 4)


def test_stratified_order_deals_every_batch_the_splits_type_mix() -> None:
    labels = ["click"] * 40 + ["type_and_submit"] * 32 + ["terminate"] * 24  # 5 : 4 : 3
    orders = {seed: stratified_order(labels, seed, 0) for seed in (0, 1)}
    for order in orders.values():
        assert sorted(order) == list(range(len(labels)))  # a permutation of the rows
        for end in range(1, len(labels) + 1):  # every prefix within one of each type's share
            for kind, share in (
                ("click", 5 / 12),
                ("type_and_submit", 4 / 12),
                ("terminate", 3 / 12),
            ):
                assert abs(sum(labels[i] == kind for i in order[:end]) - end * share) < 1
        assert [labels[i] for i in order[:12]].count("terminate") == 3
    assert orders[0] != orders[1]  # the seed still draws which rows
    assert stratified_order(labels, 0, 0) == orders[0]  # and is all it depends on
    assert stratified_order(labels, 0, 1) != orders[0]


def test_lazy_split_stratifies_by_the_gold_action_type(tiny_model_dir: Path) -> None:
    rows = build_dataset(num_sessions=30, seed=0)["train"].to_list()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    types = [json.loads(r["action"])["type"] for r in rows]
    split = LazySplit(rows, tok, 1024, latest_only=False, stratify="action_type")
    assert split.order(3, 0) == stratified_order(types, 3, 0)
    plain = LazySplit(rows, tok, 1024, latest_only=False)
    assert plain.order(3, 0) == epoch_order(len(rows), 3, 0)
    with pytest.raises(ValueError, match="does not apply to episode: session"):
        LazySplit(rows, tok, 1024, latest_only=False, episode="session", stratify="action_type")
    with pytest.raises(ValueError, match="does not apply to episode: session"):
        SftConfig(episode="session", stratify="action_type")
