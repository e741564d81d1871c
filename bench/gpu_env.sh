# Sourced from the repository root by bench/gpu_check.sh and bench/cuda_rows.sh on a lent GPU
# machine, whose image lacks some of what the trainer imports (docs/MULTINODE.md, "GPU check").
#
# The carried wheels (.whl/: pydantic, pydantic-settings, tenacity, ...) go to /tmp/site where
# the trainer's config cannot be imported.
if [ -d .whl ] && ! python3 -c "import pydantic_settings" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { echo "wheel install failed" >&2; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

# Building the embedded tiny model trains its tokenizer on the simulator's corpus, which needs
# the `datasets` package (not in the image): a copy built on the CPU box travels in
# .whl/models/, and the bench models reuse its tokenizer (bench/common.py).
if [ -d .whl/models/tiny-qwen2 ] && ! python3 -c "import datasets" 2>/dev/null; then
    export SHOP_R1_ARTIFACTS=/tmp/gpu_check_artifacts
    mkdir -p "$SHOP_R1_ARTIFACTS/models"
    cp -r .whl/models/tiny-qwen2 "$SHOP_R1_ARTIFACTS/models/"
fi
