# lora-bench: `make install` then `make test`. See README.md.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# CPU-only machines get the CPU wheel of torch (seconds, not a multi-GB CUDA download);
# on a machine with an NVIDIA GPU the project's torch range is resolved normally.
TORCH_CPU ?= torch==2.13.0

.PHONY: install test test-gpu smoke clean

install:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "NVIDIA GPU found: keeping pip's choice of torch"; \
	else \
		echo "No GPU: installing the CPU build $(TORCH_CPU)"; \
		$(BIN)/python -m pip install --quiet "$(TORCH_CPU)" || \
		$(BIN)/python -m pip install --quiet --index-url https://download.pytorch.org/whl/cpu "torch>=2.4,<3"; \
	fi
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	$(BIN)/lora-bench --version

test:
	$(BIN)/python -m pytest -q

test-gpu:
	$(BIN)/python -m pytest -q -m gpu

smoke:
	$(BIN)/lora-bench sweep configs/smoke.yaml
	$(BIN)/lora-bench report results/smoke --plot results/smoke/report.png

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
