"""The prefix tree (trainer/prefix_tree/) and its contract: a packed micro-batch gives the
same per-token logprobs, loss and gradients as padded rows (trainer/forward.py).

Structure: every sequence is rebuilt from the packed row (tokens and positions), a shared run
of at least ``min_shared`` tokens is computed once, nothing is assumed about where a prompt
ends. Equality, on a 2-layer Qwen2 (fp32, CPU): groups that share their prompt, groups that
share nothing, sequences over ``max_seq_len``, a mix of both; multi-turn episodes
(interleaved masks) whose members share a sampled first turn -- each shared trained token then
weighs every episode through it with that episode's own advantage and ratio -- or only the
prompt, with the environment's own per-token advantages, and over ``max_seq_len``; full
weights and LoRA, with the KL reference and the self-certainty pass; and the SFT target loss.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from api.protocol import ScoredGroup
from tests.unit.trainer.test_trainer_core import VOCAB, build_micro_model
from trainer.batch import SeqItem, flatten_groups, tree_micro_batches
from trainer.config import GrpoConfig, SftConfig
from trainer.forward import prepare, stats_of, target_nll
from trainer.grpo_step import StepContext, accumulate
from trainer.model import Reference, autocast, load_model
from trainer.optim import build_optimizer, build_scheduler
from trainer.prefix_tree.build import build_tree, pack

pytestmark = pytest.mark.unit
TOL = 1e-5  # fp32, sums in another order


@pytest.fixture(scope="module")
def micro_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_micro_model(tmp_path_factory.mktemp("micro"))


def assert_rebuilds(seqs: list[list[int]], min_shared: int = 4) -> None:
    tree = pack(seqs, min_shared)
    ids, pos = tree.input_ids[0], tree.position_ids[0]
    covered = torch.zeros(tree.packed_tokens, dtype=torch.bool)
    for s, index in zip(seqs, tree.token_index, strict=True):
        assert ids[index].tolist() == s
        assert pos[index].tolist() == list(range(len(s)))
        covered[index] = True
    assert covered.all()  # every packed token belongs to some sequence
    # the sets' calls produce a row for every packed position once; ``order`` puts them back
    rows = []
    for st in tree.sets:
        rows.append(st.queries.reshape(-1)[st.valid])
        for a in st.alone:
            assert a[: len(st.ancestors)].tolist() == st.ancestors.tolist()
            rows.append(a[len(st.ancestors) :])
    assert torch.cat(rows)[tree.order].tolist() == list(range(tree.packed_tokens))


def test_a_child_longer_than_its_ancestors_attends_alone() -> None:
    """Short completions of a long prompt share one masked call; a long continuation of a
    short prefix is one causal call over prefix + itself (no padding, half the scores)."""
    prompt = list(range(100, 140))
    seqs = [prompt + [1, 2], prompt + [3] * 50, prompt + [4, 5, 6]]
    tree = pack(seqs, min_shared=16)
    root, kids = tree.sets
    assert [len(a) for a in root.alone] == [
        40
    ] and root.queries.numel() == 0  # a root: causal alone
    assert [len(a) - 40 for a in kids.alone] == [50] and kids.queries.shape == (2, 3)
    assert kids.mask is not None and kids.mask.shape == (2, 1, 3, 43)
    assert_rebuilds(seqs)


def test_a_group_computes_its_prompt_once() -> None:
    prompt = list(range(100, 140))
    comps = [[1, 2, 3], [1, 2, 4, 5], [7], [8, 9, 9, 9, 9]]
    seqs = [prompt + c for c in comps]
    tree = pack(seqs, min_shared=16)
    assert tree.packed_tokens == 40 + sum(map(len, comps))
    assert len(tree.sets) == 2  # the prompt (a root), then its 4 children in one set
    assert tree.sequence_tokens == sum(map(len, seqs))
    assert_rebuilds(seqs)


def test_what_is_shared_comes_from_the_tokens() -> None:
    rng = random.Random(0)
    nothing = [[rng.randrange(50) + 50 * i for _ in range(rng.randint(1, 30))] for i in range(5)]
    assert pack(nothing).packed_tokens == sum(map(len, nothing))  # one root each
    same = [[5, 6, 7, 8, 9]] * 3  # identical rollouts: computed once, whatever their length
    assert pack(same, min_shared=16).packed_tokens == 5
    short = [[1, 2, 3, 4, 10], [1, 2, 3, 4, 11]]  # 4 shared tokens < min_shared: not split out
    assert pack(short, min_shared=16).packed_tokens == 10
    assert pack(short, min_shared=4).packed_tokens == 6
    system = list(range(20))  # two groups share a system prompt, each its own prompt
    seqs = [system + [30 + g] * 20 + [c, c + 1] for g in range(2) for c in (40, 42, 44)]
    assert pack(seqs, min_shared=16).packed_tokens == 20 + 2 * 20 + 6 * 2
    assert len(build_tree(seqs, 16)) == 1 + 2 + 6
    with pytest.raises(ValueError, match="at least one token"):
        pack([[1], []])


@pytest.mark.parametrize("seed", range(40))
def test_random_forests_rebuild_every_sequence(seed: int) -> None:
    rng = random.Random(seed)
    stems = [[rng.randrange(6) for _ in range(rng.randint(0, 12))] for _ in range(3)]
    seqs = []
    for _ in range(rng.randint(1, 9)):
        stem = rng.choice(stems)
        seqs.append(
            stem[: rng.randint(0, len(stem))] + [rng.randrange(6) for _ in range(rng.randint(1, 6))]
        )
    assert_rebuilds(seqs, min_shared=rng.randint(1, 5))


def _items(seqs: list[list[int]], prompt: int) -> list[SeqItem]:
    return [
        SeqItem(
            s,
            [0] * prompt + [1] * (len(s) - prompt),
            [0.0] * len(s),
            [0] * len(s),
            0.0,
            0,
            i,
            0,
            True,
        )
        for i, s in enumerate(seqs)
    ]


def test_tree_micro_batches_keep_groups_together() -> None:
    rng = random.Random(1)
    seqs = []
    for g in range(4):
        prompt = [g] + [rng.randrange(40) for _ in range(29)]
        seqs += [prompt + [rng.randrange(40) for _ in range(rng.randint(3, 8))] for _ in range(4)]
    items = _items(seqs, 30)
    rng.shuffle(items)
    mbs = tree_micro_batches(items, max_tokens=90, min_shared=16)
    assert sorted(i.index for mb in mbs for i in mb) == list(range(16))
    for mb in mbs:
        assert len({i.tokens[0] for i in mb}) == 1  # a group is cut only when over budget
        assert pack([i.tokens for i in mb]).packed_tokens <= 90
    assert len(tree_micro_batches(items, 10_000, 16)) == 1
    assert len(tree_micro_batches(items, 10_000, 16, parts=3)) >= 3  # work for every rank
    assert len(tree_micro_batches(items[:2], 10_000, 16, parts=3)) == 2


def make_groups(shared: bool, seed: int, n_groups: int = 3, size: int = 4) -> list[ScoredGroup]:
    """Groups whose members share a prompt (``shared``) or share nothing; completions of
    different lengths, two members identical, real-looking logprobs and rationale spans."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for gi in range(n_groups):
        prompt = torch.randint(0, VOCAB - 2, (6 + 2 * gi,), generator=g).tolist()
        seqs = []
        for si in range(size):
            if not shared:
                prompt = torch.randint(0, VOCAB - 2, (6 + 2 * gi,), generator=g).tolist()
            comp = torch.randint(0, VOCAB - 2, (3 + 2 * si,), generator=g).tolist()
            if si == size - 1 and shared:
                comp = list(seqs[0]["tokens"][len(prompt) :])  # a duplicate rollout
            n = len(comp)
            seqs.append(
                {
                    "tokens": prompt + comp,
                    "mask": [0] * len(prompt) + [1] * n,
                    "logprobs": [0.0] * len(prompt) + (-torch.rand(n, generator=g) * 4).tolist(),
                    "score": float((si * 7 + gi) % 4),
                    "spans": {"rationale": [0] * len(prompt) + [1] * (n - 1) + [0]},
                }
            )
        group = {"group_id": f"g{seed}-{gi}", "env": "toy", "policy_version": 0, "sequences": seqs}
        groups.append(ScoredGroup.model_validate(group))
    return groups


def make_episodes(
    share_first_turn: bool, seed: int, env_advantages: bool = False, n_groups: int = 2
) -> list[ScoredGroup]:
    """Multi-turn episodes: prompt, then model turn / environment reply / model turn ...
    (mask 1 / 0 / 1 ...), with the logprobs vLLM would return for the sampled tokens and 0.0
    under the replies. ``share_first_turn``: every member of a group samples the same first
    turn and gets the same reply (a shared run of *trained* tokens, with its logprobs), then
    they diverge; two of them also share the second turn and diverge in the third. Otherwise
    the members share only the prompt. ``env_advantages``: the environment sends per-token
    advantages (per-turn credit) for half of the members."""
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(0, VOCAB - 2, (n,), generator=g).tolist()

    def lps(n: int) -> list[float]:
        return (-torch.rand(n, generator=g) * 4).tolist()

    groups = []
    for gi in range(n_groups):
        prompt = rand(6 + gi)
        first, reply = (rand(5), rand(4)) if share_first_turn else (None, None)
        first_lp = lps(5)
        second_shared, second_lp = rand(4), lps(4)
        seqs = []
        for si in range(4):
            turns = [(first or rand(3 + si), first_lp if first else None)]
            if share_first_turn and si in (2, 3):
                turns.append((second_shared, second_lp))  # members 2 and 3 share turn two
            else:
                turns.append((rand(2 + si), None))
            if si >= 2:
                turns.append((rand(1 + si), None))
            tokens, mask, logprobs = list(prompt), [0] * len(prompt), [0.0] * len(prompt)
            for t, (sampled, lp) in enumerate(turns):
                if t:  # the environment's reply before every turn but the first
                    env = reply if (share_first_turn and t == 1) else rand(3)
                    tokens, mask = tokens + env, mask + [0] * len(env)
                    logprobs += [0.0] * len(env)
                tokens += sampled
                mask += [1] * len(sampled)
                logprobs += list(lp or lps(len(sampled)))
            seq = {
                "tokens": tokens,
                "mask": mask,
                "logprobs": logprobs,
                "score": float((si * 5 + gi) % 3),
            }
            if env_advantages and si % 2:
                seq["advantages"] = [m * (0.5 - 0.25 * ((j // 4) % 3)) for j, m in enumerate(mask)]
            seqs.append(seq)
        group = {"group_id": f"e{seed}-{gi}", "env": "game", "policy_version": 0, "sequences": seqs}
        groups.append(ScoredGroup.model_validate(group))
    return groups


CASES = {
    "shared": lambda: make_groups(True, 1),
    "no_shared_prefix": lambda: make_groups(False, 2),
    "over_max_seq_len": lambda: make_groups(True, 3, size=6),  # the longest are left out
    "mixed": lambda: make_groups(True, 4) + make_groups(False, 5, n_groups=2),
    "multi_turn_shared_first_turn": lambda: make_episodes(True, 6),
    "multi_turn_shared_prompt": lambda: make_episodes(False, 7),
    "multi_turn_env_advantages": lambda: make_episodes(True, 8, env_advantages=True),
    "multi_turn_over_max_seq_len": lambda: make_episodes(True, 9),
}
CASE_CONFIG = {  # what a case changes in _cfg
    "multi_turn_shared_first_turn": {"max_seq_len": 64},
    "multi_turn_shared_prompt": {"max_seq_len": 64},
    "multi_turn_env_advantages": {"max_seq_len": 64},
    "multi_turn_over_max_seq_len": {"max_seq_len": 24},  # the three-turn episodes are left out
}


def _cfg(model_dir: Path, tmp: Path, packing: str, **kw) -> GrpoConfig:
    base = dict(
        model_name=str(model_dir),
        save_path=str(tmp / packing),
        lr=1e-3,
        micro_batch_tokens=40,
        tensorboard=False,
        kl_beta=0.1,
        self_certainty_alpha=0.5,
        precision="fp32",
        packing=packing,
        min_shared_prefix=4,
        max_seq_len=20,
    )
    return GrpoConfig(**(base | kw))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _run(cfg: GrpoConfig, groups: list[dict]):
    lm = load_model(cfg)
    opt = build_optimizer(lm.model, cfg)
    ctx = StepContext(lm, Reference(lm), opt, build_scheduler(opt, cfg), cfg)
    items = flatten_groups(groups, cfg.max_seq_len)[0]
    for p in lm.model.parameters():  # a reference that differs from the policy
        if p.requires_grad:
            with torch.no_grad():
                p.add_(torch.randn_like(p) * 0.02)
    mbs = [prepare(items, lm.tokenizer.pad_token_id, lm.device, lm.tree_attention, 4)]
    token = stats_of(lm.model, mbs[0], cfg.temperature)
    stats = accumulate(ctx, items)
    return lm, items, token, stats, _grads(lm.model)


@pytest.mark.parametrize("lora_r", [0, 4], ids=["full", "lora"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_step_equals_padded(
    micro_model_dir: Path, tmp_path: Path, case: str, lora_r: int
) -> None:
    check_packed_step_equals_padded(micro_model_dir, tmp_path, case, lora_r, "cpu")


def check_packed_step_equals_padded(
    model_dir: Path, tmp_path: Path, case: str, lora_r: int, device: str
) -> None:
    """The contract on ``device`` (tests/gpu runs it on CUDA)."""
    groups = CASES[case]()
    kw = {"lora_r": lora_r, "lora_alpha": 8, "device": device, **CASE_CONFIG.get(case, {})}
    torch.manual_seed(0)
    lm_p, items, tok_p, st_p, g_p = _run(_cfg(model_dir, tmp_path, "padded", **kw), groups)
    torch.manual_seed(0)
    lm_t, _, tok_t, st_t, g_t = _run(_cfg(model_dir, tmp_path, "prefix_tree", **kw), groups)
    assert not lm_p.tree_attention and lm_t.tree_attention
    if case.endswith("over_max_seq_len"):
        assert not all(i.trainable for i in items)
        assert st_t["over_max_seq_len"] == st_p["over_max_seq_len"] > 0
    if case.startswith("multi_turn"):
        assert st_t["turns_mean"] > 2  # interleaved masks: several model turns per episode
    if case in ("multi_turn_shared_first_turn", "multi_turn_env_advantages"):
        # the shared first turn is sampled (mask 1) and computed once for every member
        trained = [i for i in items if i.trainable]
        tree = pack([i.tokens for i in trained], 4)
        assert any(
            len(n.members) > 1 and any(trained[n.seq].mask[n.start : n.end]) for n in tree.nodes
        )
    if case == "multi_turn_env_advantages":
        assert st_t["env_advantage_sequences"] == st_p["env_advantage_sequences"] > 0
    assert st_t["forward_tokens"] <= st_p["forward_tokens"]
    if case in ("shared", "mixed"):
        assert st_t["forward_tokens"] < st_t["sequence_tokens"]  # the prompts counted once
    # per-token logprobs and entropies where anything reads them
    wanted = torch.tensor(
        [
            [m or r for m, r in zip(i.mask[1:], i.rationale[1:], strict=True)]
            + [0] * (tok_p.logprobs.shape[1] - len(i.tokens) + 1)
            for i in items
        ],
        device=tok_p.logprobs.device,
    ).bool()
    for a, b in ((tok_p.logprobs, tok_t.logprobs), (tok_p.entropy, tok_t.entropy)):
        assert (a - b)[wanted].abs().max() < TOL
    for key in (
        "loss",
        "kl",
        "self_certainty",
        "entropy",
        "logprob_mismatch",
        "ratio_mean",
        "tokens",
    ):
        assert st_t[key] == pytest.approx(st_p[key], rel=1e-5, abs=TOL), key
    assert g_p.keys() == g_t.keys() and g_p
    for name in g_p:
        assert g_p[name].abs().max() > 0, name  # every trainable parameter gets a gradient
        assert (g_p[name] - g_t[name]).abs().max() < TOL, name


def test_bf16_packed_step_is_close_to_padded(micro_model_dir: Path, tmp_path: Path) -> None:
    check_bf16_packed_step_is_close(micro_model_dir, tmp_path, "cpu")


def check_bf16_packed_step_is_close(model_dir: Path, tmp_path: Path, device: str) -> None:
    groups = CASES["mixed"]()
    out = []
    for packing in ("padded", "prefix_tree"):
        torch.manual_seed(0)
        cfg = _cfg(model_dir, tmp_path, packing, precision="bf16", device=device)
        out.append(_run(cfg, groups))
    (_, items, tok_p, st_p, g_p), (_, _, tok_t, st_t, g_t) = out
    assert st_t["loss"] == pytest.approx(st_p["loss"], rel=0.05, abs=1e-3)
    mask = torch.zeros_like(tok_p.logprobs, dtype=torch.bool)
    for r, i in enumerate(items):
        mask[r, : len(i.tokens) - 1] = torch.tensor(i.mask[1:], device=mask.device).bool()
    assert (tok_p.logprobs - tok_t.logprobs)[mask].abs().max() < 0.1  # bf16 rounding
    for name in g_p:
        assert torch.isfinite(g_t[name]).all()


@pytest.mark.parametrize("lora_r", [0, 4], ids=["full", "lora"])
def test_packed_sft_loss_equals_padded(micro_model_dir: Path, lora_r: int) -> None:
    check_packed_sft_loss_equals_padded(micro_model_dir, lora_r, "cpu")


def check_packed_sft_loss_equals_padded(model_dir: Path, lora_r: int, device: str) -> None:
    g = torch.Generator().manual_seed(7)
    system = torch.randint(0, VOCAB - 2, (10,), generator=g).tolist()
    seqs, masks = [], []
    for k in range(5):
        prompt = system + torch.randint(0, VOCAB - 2, (3 + k,), generator=g).tolist()
        target = torch.randint(0, VOCAB - 2, (2 + k,), generator=g).tolist()
        seqs.append(prompt + target)
        masks.append([0] * len(prompt) + [1] * len(target))
    out = []
    for packing in ("padded", "prefix_tree"):
        cfg = SftConfig(
            model_name=str(model_dir),
            device=device,
            packing=packing,
            precision="fp32",
            lora_r=lora_r,
            lora_alpha=8,
            min_shared_prefix=4,
        )
        lm = load_model(cfg)
        with autocast(lm.device, lm.compute_dtype):
            nll = target_nll(lm.model, seqs, masks, lm.device, lm.tree_attention, 4, 0)
        nll.backward()
        out.append((float(nll.detach()), _grads(lm.model)))
    (nll_p, g_p), (nll_t, g_t) = out
    assert nll_t == pytest.approx(nll_p, rel=1e-6)
    for name in g_p:
        assert (g_p[name] - g_t[name]).abs().max() < TOL, name


@pytest.mark.parametrize("loss", ["gspo", "cispo"])
def test_multi_turn_packed_step_equals_padded_for_each_loss(
    micro_model_dir: Path, tmp_path: Path, loss: str
) -> None:
    """The sequence-level (GSPO) and clipped-weight (CISPO) losses on episodes that share a
    sampled first turn: the packed step's loss and every gradient are the padded step's."""
    groups = make_episodes(True, 10)
    out = []
    for packing in ("padded", "prefix_tree"):
        torch.manual_seed(0)
        cfg = _cfg(micro_model_dir, tmp_path, packing, max_seq_len=64, policy_loss=loss)
        out.append(_run(cfg, groups))
    (_, _, _, st_p, g_p), (_, _, _, st_t, g_t) = out
    assert st_t["loss"] == pytest.approx(st_p["loss"], rel=1e-5, abs=TOL)
    assert st_t["forward_tokens"] < st_p["sequence_tokens"]
    for name in g_p:
        assert g_p[name].abs().max() > 0, name
        assert (g_p[name] - g_t[name]).abs().max() < TOL, name
