"""The GAIL discriminator D (docs/GAIL.md): text -> logit of "human", trained with a balanced
binary cross-entropy. ``tiny`` is a 2-layer Transformer encoder over the policy's tokenizer;
any other ``disc_model`` is a Hugging Face encoder with mean pooling and a linear head. Torch
is imported inside the functions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from trainer.gail.config import TINY, GailConfig


def _tiny_encoder(vocab_size: int, cfg: GailConfig):
    """Embeddings (token + learned position) -> pre-norm Transformer encoder -> linear head."""
    from torch import nn

    d = cfg.hidden_size
    layer = nn.TransformerEncoderLayer(
        d, nhead=4, dim_feedforward=2 * d, dropout=0.1, batch_first=True, norm_first=True
    )
    return nn.ModuleDict(
        {
            "embed": nn.Embedding(vocab_size, d),
            "pos": nn.Embedding(cfg.max_length, d),
            "encoder": nn.TransformerEncoder(layer, cfg.num_layers, enable_nested_tensor=False),
            "norm": nn.LayerNorm(d),
            "head": nn.Linear(d, 1),
        }
    )


class Discriminator:
    """Text -> logit of "human". ``update`` trains it; ``state_dict`` saves it (with its
    optimizer) for the trainer's checkpoints."""

    def __init__(self, cfg: GailConfig, tokenizer: Any = None, device: Any = "cpu") -> None:
        import torch

        self.cfg = cfg
        self.device = torch.device(device)
        self.updates_done = 0
        with torch.random.fork_rng(devices=[]):  # seeded init without moving the trainer's RNG
            torch.manual_seed(cfg.seed)
            if cfg.disc_model == TINY:
                if tokenizer is None:
                    raise ValueError("the `tiny` discriminator needs the policy's tokenizer")
                self.tokenizer = tokenizer
                self.net = _tiny_encoder(len(tokenizer), cfg)
                self.encoder = None
            else:
                from torch import nn
                from transformers import AutoModel, AutoTokenizer

                self.tokenizer = AutoTokenizer.from_pretrained(cfg.disc_model)
                self.encoder = AutoModel.from_pretrained(cfg.disc_model).float()
                self.net = nn.ModuleDict(
                    {"encoder": self.encoder, "head": nn.Linear(self.encoder.config.hidden_size, 1)}
                )
        if self.tokenizer.pad_token_id is None:  # decoder tokenizers often have none
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.net.to(self.device)
        self.optimizer = torch.optim.AdamW(
            self.net.parameters(), lr=cfg.learning_rate(), weight_decay=0.01
        )

    def _encode(self, texts: Sequence[str]):
        enc = self.tokenizer(
            list(texts),
            truncation=True,
            max_length=self.cfg.max_length,
            padding=True,
            return_tensors="pt",
            add_special_tokens=self.encoder is not None,
        )
        return enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)

    def logits(self, texts: Sequence[str]):
        """``[len(texts)]`` logits (with autograd; the caller picks train/eval mode)."""
        import torch

        ids, attn = self._encode(texts)
        if self.encoder is None:
            pos = torch.arange(ids.shape[1], device=self.device)
            h = self.net["embed"](ids) + self.net["pos"](pos)[None]
            h = self.net["encoder"](h, src_key_padding_mask=attn == 0)
            h = self.net["norm"](h)
        else:
            h = self.encoder(input_ids=ids, attention_mask=attn).last_hidden_state
        m = attn.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1).clamp(min=1.0)  # mean over real tokens
        return self.net["head"](pooled).squeeze(-1).float()

    def score(self, texts: Sequence[str]):
        """Logits without gradients, in eval mode (no dropout)."""
        import torch

        self.net.eval()
        with torch.no_grad():
            return self.logits(texts).cpu() if texts else torch.zeros(0)

    def update(self, positives: Sequence[str], negatives: Sequence[str]) -> float:
        """One gradient step on the balanced BCE; returns its loss."""
        import torch
        import torch.nn.functional as F

        self.net.train()
        lp = self.logits(positives)
        ln = self.logits(negatives)
        loss = 0.5 * F.binary_cross_entropy_with_logits(lp, torch.ones_like(lp)) + (
            0.5 * F.binary_cross_entropy_with_logits(ln, torch.zeros_like(ln))
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.cfg.max_grad_norm)
        self.optimizer.step()
        self.updates_done += 1
        return float(loss.detach())

    def state_dict(self) -> dict[str, Any]:
        return {
            "net": self.net.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "updates_done": self.updates_done,
            "disc_model": self.cfg.disc_model,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("disc_model") != self.cfg.disc_model:
            raise ValueError(
                f"checkpointed discriminator is {state.get('disc_model')!r}, "
                f"the config asks for {self.cfg.disc_model!r}"
            )
        self.net.load_state_dict(state["net"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates_done = int(state.get("updates_done", 0))


def balanced_accuracy(pos_logits, neg_logits) -> float:
    """Mean of the accuracies on each class (threshold: logit 0, i.e. D = 0.5)."""
    parts = [float((x > 0).float().mean()) for x in (pos_logits,) if len(x)]
    parts += [float((x <= 0).float().mean()) for x in (neg_logits,) if len(x)]
    return sum(parts) / len(parts) if parts else math.nan


def balanced_bce(pos_logits, neg_logits) -> float:
    """The update's loss, 1/2 mean_pos[-log D] + 1/2 mean_neg[-log(1 - D)], without a step."""
    import torch
    import torch.nn.functional as F

    lp = F.binary_cross_entropy_with_logits(pos_logits, torch.ones_like(pos_logits))
    ln = F.binary_cross_entropy_with_logits(neg_logits, torch.zeros_like(neg_logits))
    return float(0.5 * lp + 0.5 * ln)
