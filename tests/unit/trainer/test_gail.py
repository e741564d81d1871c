"""The GAIL discriminator on CPU: it separates two text sets, eval mode freezes it, its
state round-trips through a checkpoint file, and its config reads GAIL_* variables."""

from __future__ import annotations

import random
import uuid
from pathlib import Path

import pytest
import torch

from api.protocol import ScoredGroup
from env_server.prompts import format_target
from trainer.batch import flatten_groups
from trainer.checkpoint import load_extra_state
from trainer.gail import Discriminator, GailConfig, GailReward, balanced_accuracy

pytestmark = pytest.mark.unit

ITEMS = ["laptop", "kettle", "running shoes", "desk lamp", "backpack", "headphones", "mug"]


def human(rng: random.Random) -> str:
    item = rng.choice(ITEMS)
    price = rng.randint(10, 300)
    return format_target(
        f"The {item} at ${price} fits what I need, so I'll open it.",
        {"type": "click", "name": f"product_{item.replace(' ', '_')}"},
    )


def policy(rng: random.Random) -> str:
    item = rng.choice(ITEMS)
    return format_target(
        f"click {item} click {item} button now now",
        {"type": "click", "name": rng.choice(["add_to_cart", "next_page"])},
    )


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_discriminator_learns_to_separate_two_sets(tokenizer) -> None:
    torch.manual_seed(0)
    rng = random.Random(0)
    disc = Discriminator(GailConfig(), tokenizer, "cpu")
    test_pos = [human(random.Random(1000 + i)) for i in range(64)]
    test_neg = [policy(random.Random(2000 + i)) for i in range(64)]
    before = balanced_accuracy(disc.score(test_pos), disc.score(test_neg))
    for _ in range(15):  # ~1 s on an idle 2-core CPU (docs/GAIL.md; timed in no test)
        disc.update([human(rng) for _ in range(8)], [policy(rng) for _ in range(16)])
    after = balanced_accuracy(disc.score(test_pos), disc.score(test_neg))
    assert after > 0.9, (before, after)


def _groups(tokenizer, n: int, with_gold: bool = True) -> list[ScoredGroup]:
    rng = random.Random(n)
    prompt = tokenizer.encode("<|im_start|>user\n<html/><|im_end|>\n<|im_start|>assistant\n")
    groups = []
    for _ in range(n):
        seqs = []
        for i in range(4):
            comp = tokenizer.encode(policy(rng) if i % 2 else "garbage {{{") + [
                tokenizer.eos_token_id
            ]
            seqs.append(
                {
                    "tokens": prompt + comp,
                    "mask": [0] * len(prompt) + [1] * len(comp),
                    "logprobs": [0.0] * (len(prompt) + len(comp)),
                    "score": 0.5 * (i % 2),
                    "spans": {},
                }
            )
        extras = {
            "gold": {
                "rationale": "I want the mug, so I'll open it.",
                "action": '{"name": "product_mug", "type": "click"}',
            }
        }
        group = {
            "group_id": str(uuid.uuid4()),
            "env": "shop_r1",
            "policy_version": 0,
            "sequences": seqs,
            "extras": extras if with_gold else {},
        }
        groups.append(ScoredGroup.model_validate(group))
    return groups


def _weights(reward: GailReward) -> list[torch.Tensor]:
    return [p.detach().clone() for p in reward.disc.net.parameters()]


def test_reward_trains_unless_eval_mode(tokenizer) -> None:
    groups = _groups(tokenizer, 3)
    items, _ = flatten_groups(groups, 4096)
    reward = GailReward(GailConfig(use=True, weight=0.5), tokenizer, "cpu")
    w0 = _weights(reward)
    bonus, m = reward(groups, items)
    assert bonus.shape == (len(items),) and bool(((bonus >= 0) & (bonus <= 0.5)).all())
    assert {"gail_loss", "gail_acc", "gail_reward_mean", "gail_d_human"} <= set(m)
    assert m["gail_positives"] == 1 and m["gail_updates"] == 1
    assert any(not torch.equal(a, b) for a, b in zip(w0, _weights(reward), strict=True))

    frozen = GailReward(GailConfig(use=True, eval_mode=True), tokenizer, "cpu")
    w0 = _weights(frozen)
    for _ in range(2):
        bonus, m = frozen(groups, items)
    assert all(torch.equal(a, b) for a, b in zip(w0, _weights(frozen), strict=True))
    assert m["gail_updates"] == 0 and m["gail_loss"] > 0 and len(bonus) == len(items)

    no_gold = _groups(tokenizer, 2, with_gold=False)
    items2, _ = flatten_groups(no_gold, 4096)
    w0 = _weights(reward)
    _, m = reward(no_gold, items2)  # nothing to learn from: rewards, no update
    assert m["gail_positives"] == 0 and m["gail_updates"] == 1
    assert all(torch.equal(a, b) for a, b in zip(w0, _weights(reward), strict=True))


def test_alpha_is_a_temperature_on_the_logit(tokenizer) -> None:
    groups = _groups(tokenizer, 2)
    items, _ = flatten_groups(groups, 4096)
    flat = GailReward(GailConfig(use=True, alpha=0.0, weight=0.8, eval_mode=True), tokenizer, "cpu")
    bonus, _ = flat(groups, items)
    assert torch.allclose(bonus, torch.full_like(bonus, 0.4))  # sigmoid(0) * weight


def test_state_round_trip(tokenizer, tmp_path: Path) -> None:
    groups = _groups(tokenizer, 2)
    items, _ = flatten_groups(groups, 4096)
    a = GailReward(GailConfig(use=True, seed=1), tokenizer, "cpu")
    a(groups, items)
    torch.save(a.state_dict(), tmp_path / "gail.pt")
    b = GailReward(GailConfig(use=True, seed=2), tokenizer, "cpu")
    state = load_extra_state(tmp_path, "gail")
    assert state is not None and load_extra_state(tmp_path, "other") is None
    b.load_state_dict(state)
    texts = a.texts(items)
    assert torch.equal(a.disc.score(texts), b.disc.score(texts))
    assert b.disc.updates_done == 1
    assert (
        b.disc.optimizer.state_dict()["state"].keys()
        == a.disc.optimizer.state_dict()["state"].keys()
    )
    with pytest.raises(ValueError, match="discriminator"):
        b.load_state_dict({**state, "disc_model": "another-encoder"})


def test_hugging_face_encoder(tiny_model_dir: Path) -> None:
    """Any other GAIL_DISC_MODEL is loaded with AutoModel (here the tiny model's folder: no hub
    here; on GPU e.g. a MiniLM/DistilBERT id), mean-pooled, with a trained linear head."""
    rng = random.Random(3)
    disc = Discriminator(GailConfig(disc_model=str(tiny_model_dir)), None, "cpu")
    assert disc.encoder is not None and disc.cfg.learning_rate() == 2e-5
    pos, neg = [human(rng) for _ in range(4)], [policy(rng) for _ in range(4)]
    before = disc.score(pos + neg)
    assert before.shape == (8,) and disc.update(pos, neg) > 0
    assert not torch.equal(before, disc.score(pos + neg))


def test_config_reads_gail_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.config import GrpoConfig

    monkeypatch.setenv("GAIL_USE", "1")
    monkeypatch.setenv("GAIL_WEIGHT", "0.25")
    monkeypatch.setenv("GAIL_EVAL_MODE", "1")
    cfg = GrpoConfig().gail
    assert cfg.use and cfg.weight == 0.25 and cfg.eval_mode and cfg.learning_rate() == 1e-3
    monkeypatch.setenv("GAIL_ALPHA", "warm")
    with pytest.raises(ValueError, match="alpha"):  # a default read from $GAIL_ALPHA
        GrpoConfig()
