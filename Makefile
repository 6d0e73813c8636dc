PYTHON ?= python3
PIP ?= $(PYTHON) -m pip

.PHONY: install test demo

# torch first, alone: its CPU wheel (anything else resolves to a multi-GB CUDA build).
install:
	$(PIP) install --disable-pip-version-check -q torch==2.13.0
	$(PIP) install --disable-pip-version-check -q -r requirements.txt

# The README's test command: the whole suite on the embedded tiny model.
test: install
	$(PYTHON) -m pytest -q tests

# Answer a question about a generated picture with the embedded (random!) model.
demo: install
	$(PYTHON) -m service chat --image tests/data/demo.png "What is in this picture?"
