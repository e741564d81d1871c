"""SFT cold start: next-token loss on the rationale + action JSON, prompt masked out."""

from __future__ import annotations

import logging
import math
import time
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from env_server.sessions import as_episodes
from procutil.faults import fault_point
from trainer.checkpoint import save_final_model
from trainer.config import SftConfig
from trainer.dist_checkpoint import unsharded_copy
from trainer.distributed import Work
from trainer.evaluate import format_valid_rate
from trainer.forward import target_nll
from trainer.model import LoadedModel, autocast
from trainer.optim import clip_and_step
from trainer.run import Run, release_freed_memory, start_run
from trainer.sft_data import (
    LazySplit,
    SftExample,
    load_or_build_dataset,
)

log = logging.getLogger(__name__)


def train(cfg: SftConfig) -> Run:
    run = start_run(cfg)
    lm, state = run.loaded, run.state
    work = Work.of(run.dist)
    data = load_or_build_dataset(cfg.data_dir, cfg.num_sessions)
    split = partial(
        LazySplit,
        tokenizer=lm.tokenizer,
        max_seq_len=cfg.max_seq_len,
        latest_only=cfg.latest_only,
        episode=cfg.episode,
    )
    train_set = split(data["train"], stratify=cfg.stratify)
    val_set = split(data["validation"])
    held_out = val_set.first(cfg.eval_examples)
    log.info("SFT: %d train / %d validation rows", len(train_set), len(val_set))
    bar = tqdm(
        total=cfg.training_steps,
        initial=state.step,
        desc="sft",
        dynamic_ncols=True,
        disable=not run.is_main,
    )
    try:
        while state.step < cfg.training_steps:
            t0 = time.monotonic()
            batch = _next_batch(train_set, cfg, state)
            loss, grad_norm = _step(run, batch, work)
            release_freed_memory()
            state.step += 1
            row = {
                "loss": loss,
                "grad_norm": grad_norm,
                "lr": run.scheduler.get_last_lr()[0],
                "epoch": state.data_epoch,
                "step_s": time.monotonic() - t0,
            }
            last = state.step == cfg.training_steps
            if state.step % cfg.eval_every == 0 or last:
                row["val_loss"] = validation_loss(lm, held_out, cfg, work)
            if state.step % cfg.save_every == 0 or last:
                run.checkpoint()
                fault_point("checkpointed")  # test-only (procutil/faults.py): unset, nothing
            run.metrics.log(state.step, row)
            bar.set_postfix(loss=f"{loss:.3f}")
            bar.update(1)
        bar.close()
        if run.dist is not None:  # rank 0 gathers an unsharded copy; the others are done
            lm = unsharded_copy(cfg, lm.model, run.dist)
            if lm is None:
                return run
        save_final_model(cfg.save_path, lm.model, lm.tokenizer)
        if cfg.eval_generate > 0:
            rows = list(data["validation"])
            rows = (as_episodes(rows) if cfg.episode == "session" else rows)[: cfg.eval_generate]
            result = format_valid_rate(
                lm, rows, cfg.max_seq_len, cfg.max_new_tokens, cfg.latest_only
            )
            run.metrics.log(state.step, {f"eval/{k}": v for k, v in result.items()})
            log.info("greedy generations on %d validation prompts: %s", len(rows), result)
    finally:
        run.metrics.close()
    log.info("SFT model saved to %s", Path(cfg.save_path))
    return run


def _next_batch(rows: LazySplit, cfg: SftConfig, state) -> list[SftExample]:
    """The next ``batch_size`` examples of the shuffled rows (a row that does not fit is
    skipped); the cursor (epoch, index) lives in the checkpoint."""
    batch: list[SftExample] = []
    order = rows.order(cfg.seed, state.data_epoch)
    drawn = 0
    while len(batch) < cfg.batch_size:
        if drawn > len(rows):
            raise ValueError(f"no example fits max_seq_len={cfg.max_seq_len}")
        want = []
        while len(want) < cfg.batch_size - len(batch):
            if state.data_index >= len(order):
                state.data_epoch, state.data_index = state.data_epoch + 1, 0
                order = rows.order(cfg.seed, state.data_epoch)
            want.append(order[state.data_index])
            state.data_index += 1
        drawn += len(want)
        batch += rows.take(want)
    return batch


def _step(run: Run, batch: list[SftExample], work: Work) -> tuple[float, float]:
    """Accumulate micro-batches into one optimizer step, normalised by the step's token count
    (under torchrun each rank takes its share of the micro-batches, trainer/distributed.py)."""
    lm, cfg = run.loaded, run.cfg
    n_target = float(sum(sum(e.loss_mask[1:]) for e in batch))
    total = 0.0
    starts = list(range(0, len(batch), cfg.micro_batch_size))
    for i, real in work.split(starts):
        with autocast(lm.device, lm.compute_dtype):
            nll = _nll(lm, batch[i : i + cfg.micro_batch_size], cfg)
        loss = nll / n_target
        (loss if real else loss * 0.0).backward()
        total += float(loss.detach()) if real else 0.0
    grad_norm = clip_and_step(lm.model, run.optimizer, run.scheduler, cfg.max_grad_norm)
    return work.sum({"loss": total})["loss"], grad_norm


def _nll(lm: LoadedModel, examples: list[SftExample], cfg: SftConfig) -> torch.Tensor:
    """Summed target NLL of ``examples`` in one forward (packed or padded, as the model runs)."""
    return target_nll(
        lm.model,
        [e.tokens for e in examples],
        [e.loss_mask for e in examples],
        lm.device,
        lm.tree_attention,
        cfg.min_shared_prefix,
        lm.tokenizer.pad_token_id,
    )


@torch.no_grad()
def validation_loss(
    lm: LoadedModel, examples: list[SftExample], cfg: SftConfig, work: Work | None = None
) -> float:
    """Mean next-token loss per target token on held-out examples."""
    work = work or Work()
    lm.model.eval()
    nll = count = 0.0
    starts = list(range(0, len(examples), cfg.micro_batch_size))
    for i, real in work.split(starts) if examples else []:
        chunk = examples[i : i + cfg.micro_batch_size]
        with autocast(lm.device, lm.compute_dtype):
            s = float(_nll(lm, chunk, cfg))
        if not real:
            continue
        nll += s
        count += float(sum(sum(e.loss_mask[1:]) for e in chunk))
    lm.model.train()
    sums = work.sum({"nll": nll, "count": count})
    return sums["nll"] / sums["count"] if sums["count"] else math.nan
