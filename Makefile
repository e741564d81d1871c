# Two commands do all set-up on a fresh machine:
#   make run    -> installs (if needed), builds the tiny model, starts the four services
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

$(STAMP): $(REQS) requirements-nodeps.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -r $(REQS)
	$(PY) -m pip install --no-deps -r requirements-nodeps.txt
	@if [ "$(GPU)" != "1" ]; then \
	  echo "removing torchvision/torchaudio/torchcodec (they break imports beside the CPU torch)"; \
	  $(PY) -m pip uninstall -y torchvision torchaudio torchcodec || true; \
	fi
	$(PY) -m pip install --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-*
	touch $@

# Chromium for the screenshot test of the run's page (tests/integration/test_report_page.py);
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

run: setup
	bash launch/run_all.sh $(RUN_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
