# lora-bench on a fresh machine, two commands; each installs what it needs first (once: a stamp in
# the virtual environment makes a second call quick).
#   make run    the main job: LoRA fine-tuning of GPT-2 on the SMS Spam Collection, sized to the machine
#   make test   the test suite (GPU tests skip without CUDA); it names its slowest tests at the end
#   (make test-fast leaves out the ones marked slow, for a quick check while working)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# A machine without an NVIDIA GPU gets torch's CPU build (not a multi-GB CUDA download), and Triton
# so that the kernel tests run under Triton's CPU interpreter (>= 3.7: older interpreters fail with
# NumPy >= 2.4). A GPU machine keeps pip's choice of torch and the Triton that comes with it.
TORCH_CPU  ?= torch==2.13.0
TRITON_CPU ?= triton>=3.7
GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)

# -- the main job --------------------------------------------------------------------------------
# LoRA r16 on every linear layer, as the book's row 11. The data: lora-bench's own copy of the SMS
# Spam Collection, or the one beside this checkout when there. The weights: GPT-2's pretrained ones
# when a checkpoint is at hand (lora-bench's cache, or WEIGHTS_DIR), else random (no download).
DATA_FILE   ?= $(firstword $(wildcard ../shared/data/SMSSpamCollection.tsv))
CACHE       ?= $(or $(LORA_BENCH_CACHE),$(HOME)/.cache/lora-bench)
WEIGHTS_DIR ?= $(if $(wildcard $(CACHE)/gpt2/124M/hparams.json),$(CACHE)/gpt2/124M)
RESULTS     ?= results/runs
# On a GPU the book's run: GPT-2 124M, 5 epochs with its evaluations (under a minute on an H200).
# On a CPU a full 124M run takes hours (a step is about 20 CPU-seconds), so the same model trains
# for CPU_STEPS steps with two small periodic evaluations and no final full-loader accuracies: a
# few minutes on two cores, every phase of the real model timed (the CLI's defaults stay the book's).
CPU_STEPS ?= 10
SIZE_ARGS := $(if $(GPU),,--max-steps $(CPU_STEPS) --warmup-steps 2 --eval-freq 5 --eval-iter 1 --skip-final-eval)
RUN_ARGS  ?= --trainable-layers lora --rank 16 --alpha 16 \
	$(if $(WEIGHTS_DIR),--weights-dir $(WEIGHTS_DIR),--weights random) \
	$(if $(DATA_FILE),--data-file $(DATA_FILE)) $(SIZE_ARGS) --results-dir $(RESULTS)

.PHONY: run test test-fast install install-test test-gpu smoke clean

run: install
	@$(if $(WEIGHTS_DIR),,echo "No GPT-2 checkpoint at hand ($(CACHE)/gpt2/124M): training from random weights.")
	@$(if $(GPU),,echo "No GPU: GPT-2 124M for $(CPU_STEPS) steps on the CPU (make run CPU_STEPS=N to change).")
	$(BIN)/lora-bench train $(RUN_ARGS)

test: install-test
	$(BIN)/python -m pytest -q --durations=15

test-fast: install-test
	$(BIN)/python -m pytest -q -m "not slow"

test-gpu: install-test
	$(BIN)/python -m pytest -q -m gpu

smoke: install
	$(BIN)/lora-bench sweep configs/smoke.yaml
	$(BIN)/lora-bench report results/smoke --plot results/smoke/report.png

# -- installation (stamps: done once, redone when pyproject.toml changes) -----------------------
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@if [ -n "$(GPU)" ]; then echo "NVIDIA GPU found: keeping pip's choice of torch"; \
	else echo "No GPU: installing the CPU build $(TORCH_CPU)"; \
		$(BIN)/python -m pip install --quiet "$(TORCH_CPU)" || \
		$(BIN)/python -m pip install --quiet --index-url https://download.pytorch.org/whl/cpu "$(TORCH_CPU)"; \
	fi
	$(BIN)/python -m pip install --quiet -e .
	$(BIN)/lora-bench --version
	touch $@

install-test: $(VENV)/.installed-test

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	@if [ -z "$(GPU)" ]; then $(BIN)/python -m pip install --quiet "$(TRITON_CPU)"; fi
	touch $@

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
