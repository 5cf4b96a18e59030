# The two commands in the README are `make demo` and `make test`; both set up
# everything they need on a fresh machine with Python 3.11 and pip.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Pinned torch wheels: these exact versions are the ones optkit is tested on.
TORCH_PINS := torch==2.14.1 torchvision==0.29.1
FMNIST_DIR := /usr/share/datasets/fashion-mnist

.PHONY: setup dev demo test test-all data bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# setuptools prints an informational banner on every editable install of a flat
# layout ("Editable installation ... folders with the same name as your package");
# only that message is silenced, so deprecation warnings still show.
EDITABLE := PYTHONWARNINGS="ignore:Editable installation:UserWarning" $(BIN)/pip install -q -e

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH_PINS)
	$(EDITABLE) .
	touch $@

# The example plugin package registers a pass by entry point; the tests use it.
PLUGIN := tests/plugins/example_plugin
$(VENV)/.dev-installed: $(VENV)/.installed $(PLUGIN)/pyproject.toml
	$(EDITABLE) '.[dev]'
	$(EDITABLE) $(PLUGIN)
	touch $@

setup: $(VENV)/.installed

dev: $(VENV)/.dev-installed

# Real data comes from Debian's packages: Fashion-MNIST for images and the
# Python 3.11 documentation sources for text (the `text` dataset spec). Both are
# optional for the demo and installed for the tests that use real data (as root,
# or with passwordless sudo); without apt those tests are skipped.
FMNIST_FILE := $(FMNIST_DIR)/train-images-idx3-ubyte.gz
TEXT_DIR := /usr/share/doc/python3.11/html/_sources
data:
	@missing=""; \
	[ -f $(FMNIST_FILE) ] || missing="$$missing dataset-fashion-mnist"; \
	[ -d $(TEXT_DIR) ] || missing="$$missing python3.11-doc"; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ]; then sudo=""; \
		elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo="sudo -n"; \
		else sudo=none; fi; \
		if command -v apt-get >/dev/null && [ "$$sudo" != none ]; then \
			echo "installing$$missing with apt-get"; \
			($$sudo apt-get update -qq && $$sudo env DEBIAN_FRONTEND=noninteractive \
				apt-get install -y -qq $$missing) >/dev/null \
				|| echo "warning: could not install$$missing; real-data tests will be skipped"; \
		else \
			echo "note: run 'sudo apt-get install$$missing' for the real-data tests"; \
		fi; \
	fi
	@if [ -d $(TEXT_DIR) ]; then echo "Python documentation text: $(TEXT_DIR)"; fi
	@if [ -f $(FMNIST_FILE) ]; then echo "Fashion-MNIST: $(FMNIST_DIR)"; fi

# The demo prunes the trained Fashion-MNIST model that ships with optkit to half its MACs,
# recalibrates and fine-tunes it for one epoch, and scores it on the test split before and
# after; without the dataset it prunes a random-weight ResNet-18 instead and says why.
DEMO_MODEL := optkit/demo/fashion_resnet.pt
DEMO_TRAINED := $(BIN)/optkit optimize $(DEMO_MODEL) --target-macs 0.5 \
	--recalibrate-bn 20 --calib-data fashion-mnist --finetune fashion-mnist --epochs 1 --train-amp bf16 \
	--eval fashion-mnist --export onnx --latency --out runs/demo --force
DEMO_RANDOM := $(BIN)/optkit optimize torchvision:resnet18 --prune 0.3 --export onnx --latency --out runs/demo --force
demo: setup data
	@if [ -f $(FMNIST_FILE) ]; then \
		echo "$(DEMO_TRAINED)"; $(DEMO_TRAINED); \
	else \
		echo "note: Fashion-MNIST is not installed (it needs apt-get, as root): pruning a random-weight ResNet-18, where accuracy means nothing"; \
		echo "$(DEMO_RANDOM)"; $(DEMO_RANDOM); \
	fi

test: dev data
	$(BIN)/python -m pytest

test-all: dev data
	$(BIN)/python -m pytest -m ''

clean:
	rm -rf $(VENV) runs .pytest_cache
