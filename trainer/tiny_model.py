"""Build the embedded default model from nothing, deterministically.

The project must run on a 2-core CPU machine with no model hub, so it makes its own model:
a byte-level BPE tokenizer trained on the Shop-R1 corpus (from the session simulator) and a
Qwen2-architecture causal LM with random weights. head_dim is 64 because vLLM's CPU attention
rejects smaller heads; embeddings are tied as in small Qwen/Llama models (which exercises the
bridge's tied-lm_head refresh on CPU). The same seed gives the same bytes: the tokenizer is
trained single-threaded on a fixed corpus and the weights come from a seeded CPU generator.

    python -m trainer.tiny_model [--out DIR] [--seed 0] [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, Field

BUILDER_VERSION = 1
TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "chat_template", "added_tokens")
"""Name prefixes of the files ``save_pretrained`` writes for the tokenizer."""
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, as Qwen2 models use: the SFT target ends with <|im_end|>, which is also the EOS.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class TinyModelSpec(BaseModel):
    """Shape of the embedded model; the defaults are what `make run` and the tests use."""

    vocab_size: int = Field(4096, description="Target BPE vocabulary (special tokens included).")
    hidden_size: int = Field(256, description="Residual width; 4 heads x head_dim 64.")
    intermediate_size: int = Field(768, description="MLP width (SwiGLU).")
    num_hidden_layers: int = Field(4, description="Decoder layers.")
    num_attention_heads: int = Field(4, description="Query heads (head_dim = hidden/heads = 64).")
    num_key_value_heads: int = Field(2, description="KV heads (grouped-query attention).")
    max_position_embeddings: int = Field(4096, description="Longest context the model accepts.")
    corpus_sessions: int = Field(400, description="Simulated sessions the tokenizer is trained on.")
    seed: int = Field(0, description="Seed for the corpus and the random weights.")


def corpus_texts(spec: TinyModelSpec) -> Iterable[str]:
    """The Shop-R1 text the tokenizer learns from (system prompt, pages, rationales, actions)."""
    from env_server.data.corpus import iter_corpus_texts

    return iter_corpus_texts(num_sessions=spec.corpus_sessions, seed=spec.seed)


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Train a byte-level BPE tokenizer and wrap it as a transformers fast tokenizer."""
    # Single-threaded training: the merge order must not depend on thread scheduling.
    os.environ["RAYON_NUM_THREADS"] = "1"
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(
    out_dir: Path | str, spec: TinyModelSpec | None = None, tokenizer_from: Path | None = None
) -> Path:
    """Build tokenizer + random-weight Qwen2 model into ``out_dir`` (atomically).

    ``tokenizer_from``: a folder built with the same vocabulary, corpus and seed whose
    tokenizer files are copied instead of trained again (the same bytes: training is
    deterministic); it spares the corpus, whose simulator needs the ``datasets`` package."""
    import torch
    from transformers import (
        GenerationConfig,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    spec = spec or TinyModelSpec()
    out_dir = Path(out_dir)
    if tokenizer_from is not None:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_from)
    else:
        tokenizer = train_tokenizer(corpus_texts(spec), spec.vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.hidden_size // spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id
    )

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer_from is not None:
            for f in Path(tokenizer_from).iterdir():
                if f.name.startswith(TOKENIZER_FILES):
                    shutil.copy2(f, tmp / f.name)
        else:
            tokenizer.save_pretrained(tmp)
            _portable_tokenizer_config(tmp)
        info = {"builder_version": BUILDER_VERSION, "spec": spec.model_dump()}
        (tmp / "build_info.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        # rename is atomic: a concurrent reader sees the old folder or the complete new one.
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the model folder is meant to be shared
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _portable_tokenizer_config(model_dir: Path) -> None:
    """Make the tokenizer loadable by transformers 4.x too (GPU users pin their own version).

    transformers 5 names the class ``TokenizersBackend`` and keeps the chat template in a
    separate file; 4.x knows neither, so name the fast-tokenizer alias and inline the template.
    """
    path = model_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def is_built(model_dir: Path | str) -> bool:
    """True when ``model_dir`` holds a complete model from this builder version."""
    d = Path(model_dir)
    info = d / "build_info.json"
    needed = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    if not info.exists() or not all((d / n).exists() for n in needed):
        return False
    try:
        return json.loads(info.read_text()).get("builder_version") == BUILDER_VERSION
    except json.JSONDecodeError:
        return False


def digest(model_dir: Path | str) -> dict[str, str]:
    """sha256 of every file in the model folder (for the determinism check)."""
    d = Path(model_dir)
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.iterdir())
        if p.is_file()
    }


def main(argv: list[str] | None = None) -> None:
    from settings.paths import TINY_MODEL_DIR

    ap = argparse.ArgumentParser(
        "python -m trainer.tiny_model",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--out", type=Path, default=TINY_MODEL_DIR, help="output folder")
    ap.add_argument("--seed", type=int, default=0, help="seed for corpus and weights")
    ap.add_argument("--force", action="store_true", help="rebuild even if already built")
    # Bigger shapes for the benchmarks' model-size sweeps (bench/common.py MODEL_SIZES).
    shape = (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
    )
    for name in shape:
        ap.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            default=None,
            help=TinyModelSpec.model_fields[name].description,
        )
    args = ap.parse_args(argv)
    if is_built(args.out) and not args.force:
        print(f"tiny model already built at {args.out} (use --force to rebuild)")
        return
    sizes = {k: getattr(args, k) for k in shape if getattr(args, k) is not None}
    path = build_tiny_model(args.out, TinyModelSpec(seed=args.seed, **sizes))
    for name, sha in digest(path).items():
        print(f"{sha[:16]}  {name}")
    print(f"built {path}")


if __name__ == "__main__":
    main()
