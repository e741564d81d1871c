# Two commands do all set-up on a fresh machine:
#   make run    -> installs (if needed), builds the model, SFT, then the four services (GRPO)
#   make test   -> installs (if needed), runs the test suite
# GPU machines get requirements-gpu.txt automatically (nvidia-smi works) or with GPU=1.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
GPU    ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)
REQS   := $(if $(filter 1,$(GPU)),requirements-gpu.txt,requirements.txt)
STAMP  := $(VENV)/.installed-$(shell cat $(REQS) requirements-nodeps.txt pyproject.toml | sha1sum | cut -c1-12)
PYTEST_ARGS ?=

.PHONY: setup browser test test-unit test-integration test-gpu run model lint format clean

setup: $(STAMP)

# The install runs with uv (https://docs.astral.sh/uv/), which installs the same set as pip
# faster (measured in docs/results/suite_timings.md); pip does it where uv cannot be
# installed. uv reads no pip configuration: procutil/pip_install.py prints pip's settings
# (pip.conf and PIP_* variables) as uv's flags, and says how they are ranked and ordered.
# No bytecode is compiled at install (pip's default, uv's --compile-bytecode): that compiled
# all ~25,800 modules of the venv (65 CPU-seconds) where a run or the suite imports a part of
# them. tests/run.sh and the launcher (launch/run_all.py) let the first process that imports
# a module write its .pyc instead (they drop PYTHONDONTWRITEBYTECODE), so what runs is
# compiled once (docs/TESTING.md, "Bytecode").

$(STAMP): $(REQS) requirements-nodeps.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip uv || $(PY) -m pip install --upgrade pip
	@set -ef; \
	if [ -x $(VENV)/bin/uv ]; then \
	  install="$(VENV)/bin/uv pip install --python $(PY) --index-strategy unsafe-best-match $$($(PY) procutil/pip_install.py)"; \
	  uninstall="$(VENV)/bin/uv pip uninstall --python $(PY)"; \
	else \
	  echo "uv is not installable here: installing with pip"; \
	  install="$(PY) -m pip install --no-compile"; \
	  uninstall="$(PY) -m pip uninstall -y"; \
	fi; \
	run() { echo "$$*"; "$$@"; }; \
	run $$install -r $(REQS); \
	run $$install --no-deps -r requirements-nodeps.txt; \
	if [ "$(GPU)" != "1" ]; then \
	  echo "removing torchvision/torchaudio/torchcodec (they break imports beside the CPU torch)"; \
	  run $$uninstall torchvision torchaudio torchcodec || true; \
	fi; \
	run $$install --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-*
	touch $@

# Chromium for the screenshot test of the run's page (tests/integration/launch/test_report_page.py);
# a no-op when it is installed, apt-get (as root or with sudo) otherwise.
browser:
	bash tests/install_chromium.sh

model: setup
	$(PY) -m trainer.tiny_model

test: setup browser
	bash tests/run.sh $(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest -m unit $(PYTEST_ARGS)

test-integration: setup browser
	$(PY) -m pytest -m integration $(PYTEST_ARGS)

test-gpu: setup
	$(PY) -m pytest -m gpu $(PYTEST_ARGS)

# make run trains the real model (SmolLM2-135M-Instruct, preset cpu-smol) where the cost probe
# measures it at ~90 min or less on this CPU, else the tiny one (--long-run tiny, docs/RUNNING.md).
run: setup
	bash launch/run_all.sh --preset cpu-smol --long-run tiny $(RUN_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
