"""What differs between this stack and TRL's GRPOTrainer in a ``bench/peers/peer_trl.py``
comparison, each with why (``not_matched``, written into every result): the texts, by how TRL
generates and by which of TRL's ways ours takes (``--reproducible``, ``--trl-normaliser``,
``--trl-importance``, ``--keep-constant-groups``, ``--ours-vllm-dtype``). What both hold equal
is ``bench.peers.settings.matched``."""

from __future__ import annotations

from bench.peers.settings import TRL_GENERATION

OURS_IMPORTANCE_RATIO = {
    False: "ours: pi_trainer / pi_vLLM of the sampled tokens (rollouts up to the API's "
    "staleness bound behind, PPO-clipped)",
    True: "ours (--reproducible): every batch sampled by the weights that train on it (the env "
    "samples a batch only once its version is live: on-policy, as TRL), pi_trainer / pi_vLLM "
    "of the sampled tokens PPO-clipped",
}
"""Our half of the importance-ratio difference, by whether ours runs ``--reproducible``."""
TRL_IMPORTANCE_RATIO = {
    "transformers": "TRL without vLLM and num_iterations=1: the ratio is exactly 1 (on-policy, "
    "the clip never binds)",
    "vllm-colocate": "TRL with vLLM: the same ratio, on-policy (num_iterations=1, weights "
    "pushed into vLLM before each step's generation), with TRL's default truncated "
    "importance-sampling correction (vllm_importance_sampling_correction)",
}
"""TRL's half, by how it generates (``TRL_GENERATION``)."""

NOT_MATCHED = {
    "importance_ratio": f"{OURS_IMPORTANCE_RATIO[False]}; {TRL_IMPORTANCE_RATIO['transformers']}",
    "loss_normaliser": "ours: the step's trained tokens (`loss_aggregation: token`); TRL "
    "`dr_grpo`: sequences x max_completion_length, a constant; on one identical batch they "
    "change only the gradient's length, not its direction (docs/results/peer_same_batch.md), "
    "but at one max_grad_norm the longer gradient is clipped more often "
    "(--trl-normaliser runs ours with TRL's)",
    "advantage_std": "where the advantages are scaled (the presets), ours divides by the "
    "group's population std, TRL by its sample std: a constant factor sqrt(G / (G - 1)) in "
    "the gradient's length on one batch (1.069 at G = 8), none in its direction",
    "constant_groups": "ours (preset default): groups whose rewards are all equal are dropped "
    "before training, so every trained sequence has signal; TRL trains them at advantage 0 "
    "(--keep-constant-groups runs ours TRL's way)",
    "generation": "ours: vLLM (fp32, continuous batching, its own core(s)) while the trainer "
    "trains; TRL: transformers `generate` in the trainer's process, then training, in turn",
    "prompt_order": "both walk the train rows in the env's seeded order (cycle_rows), but "
    "ours has several prompts in flight and drops constant groups, so its steps do not "
    "hold the same prompts as TRL's",
    "self_certainty": "ours adds 0.005 x self-certainty of the rationale to every score by "
    "default; TRL cannot (it needs the trainer's logits), so the bench turns it off in ours "
    "(--self-certainty-alpha 0) to keep one reward",
}
"""Differences the bench cannot remove, each with why (written into the result file), when
TRL generates with transformers ``generate`` (``--trl-generation transformers``)."""


VLLM_COLOCATE_NOT_MATCHED = {
    "importance_ratio": f"{OURS_IMPORTANCE_RATIO[False]}; {TRL_IMPORTANCE_RATIO['vllm-colocate']}",
    "generation": "ours: vLLM (fp32, eager, continuous batching, its own core(s)) while the "
    "trainer trains; TRL: vLLM in the trainer's process (colocate, external_launcher), then "
    "training, in turn; TRL builds its LLM without a dtype or enforce_eager, so vLLM's CPU "
    "default applies: the fp32 checkpoint downcast to bf16, compiled (no setting changes it)",
}
"""What differs instead when TRL generates with vLLM in its process (``vllm-colocate``)."""


TRL_IMPORTANCE = (
    "matched: ours takes TRL's vLLM correction (--trl-importance: `tis_cap 3, tis_level "
    "sequence, mismatch_mask_high 3, mismatch_mask_level sequence`, TRL 1.16's default "
    "`sequence_mask` at clip_max 3): the ratio is pi_trainer / pi_old = 1 (one update per batch), "
    "each sequence weighed by pi_old / pi_vLLM over its tokens, 0 above 3"
)
"""The importance ratio's line when ours takes TRL's correction (``Plan.trl_importance``)."""

KEPT_CONSTANT_GROUPS = (
    "matched: ours trains constant groups at advantage 0 as TRL does (--keep-constant-groups)"
)
"""The constant groups' line when ours keeps them (``Plan.keeps_constant_groups``)."""

TRL_NORMALISER = (
    "matched: ours takes TRL dr_grpo's normaliser (--trl-normaliser: `loss_aggregation: "
    "constant`, `constant_length` = max_tokens = TRL's max_completion_length)"
)
"""The normaliser's line instead when ours runs with TRL's (``Plan.trl_normaliser``)."""


def not_matched(
    generation: str = "transformers",
    reproducible: bool = False,
    trl_normaliser: bool = False,
    trl_importance: bool = False,
    keep_constant_groups: bool = False,
    sampling_dtype: str | None = None,
) -> dict[str, str]:
    """The differences of a comparison whose TRL side generates by ``generation``, ours
    ``reproducible`` (on-policy lockstep) or not, with TRL's loss normaliser or ours, with
    TRL's vLLM importance correction (``trl_importance``) or ours' PPO ratio, training its
    constant groups as TRL (``keep_constant_groups``) or dropping them, its vLLM sampling in
    ``sampling_dtype`` (None: the run's fp32)."""
    if generation not in TRL_GENERATION:
        raise ValueError(f"TRL generation {generation!r}: one of {TRL_GENERATION}")
    out = dict(NOT_MATCHED)
    if trl_normaliser:
        out["loss_normaliser"] = TRL_NORMALISER
    if generation == "vllm-colocate":
        out |= VLLM_COLOCATE_NOT_MATCHED
    if reproducible:
        ours, trl = OURS_IMPORTANCE_RATIO[True], TRL_IMPORTANCE_RATIO[generation]
        out["importance_ratio"] = f"{ours}; {trl}"
    if sampling_dtype is not None:
        out["generation"] = out["generation"].replace(
            "ours: vLLM (fp32,", f"ours: vLLM ({sampling_dtype} by --ours-vllm-dtype,", 1
        )
    if keep_constant_groups:
        out["constant_groups"] = KEPT_CONSTANT_GROUPS
        if reproducible:  # one batch in flight, nothing dropped: TRL's prompts, in its order
            out.pop("prompt_order")
    if trl_importance:
        if generation != "vllm-colocate":
            raise ValueError(
                "--trl-importance is TRL's vLLM correction: TRL must generate with vLLM"
            )
        out["importance_ratio"] = TRL_IMPORTANCE + (
            "; on-policy (--reproducible)"
            if reproducible
            else "; ours' rollouts up to the API's staleness bound behind"
        )
    return out
