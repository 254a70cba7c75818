# `make test` and `make book` both create .venv from requirements.txt first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test book exercises bench clean

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -r requirements.txt
	touch $(STAMP)

## every test: the package, the grader, nbval over book/, exercises/, solutions/, the built book
test: $(STAMP)
	$(PY) -m pytest tests book exercises solutions --nbval-lax --nbval-current-env

## the Jupyter Book, every notebook executed, warnings as errors
book: $(STAMP)
	$(VENV)/bin/jupyter-book build . -W -n --keep-going
	@echo "The book is at $(CURDIR)/_build/html/index.html"

## regenerate exercises/ from solutions/
exercises: $(STAMP)
	$(PY) -m course_attn.grading.generate

## time and peak memory of every backend, as ratios to PyTorch's SDPA
bench: $(STAMP)
	$(PY) -m course_attn.bench

clean:
	rm -rf _build .pytest_cache .hypothesis
