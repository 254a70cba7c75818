# The course's commands, in the order a student meets them (README.md):
#   make test · make book · make work CH=03 · make lab · make grade
# `make` alone, or `make help`, lists them: each target's description is the `## ` comment
# above it.
# Each one creates .venv from requirements.txt first (and again when requirements.txt changes).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# A student's own folder: git ignores it, and no command below writes to it but `make work`,
# which only adds a notebook that is not there yet.
WORK   := work
# JupyterLab refuses to run as root (a container, a CI machine) unless told it may.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)
# More options for `make lab`, e.g. LAB_ARGS="--no-browser --port=8899".
LAB_ARGS ?=
# `make test`'s workers: one more than the cores, so that a test waiting out a watchdog (the
# batch grader's, about 100 s) leaves its core to the others. TEST_JOBS=2 to choose.
TEST_JOBS ?= $(shell echo $$(( $$(nproc 2>/dev/null || echo 1) + 1 )))
# `make gpu-check` installs nothing: a lent GPU machine has its own torch and no internet.
GPU_PY := $(if $(wildcard $(PY)),$(PY),$(PYTHON))

.PHONY: help test book book-under-load work lab grade exercises mutants bench gpu-check clean
.DEFAULT_GOAL := help

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -r requirements.txt
	touch $(STAMP)

## this list: every command with what it does
help:
	@awk '/^## / { text = text (text ? " " : "") substr($$0, 4); next } \
	  /^[a-z][a-z-]*:/ && text { \
	    sub(/:.*/, ""); line = sprintf("make %-16s", $$0); n = split(text, words, " "); \
	    for (i = 1; i <= n; i++) { \
	      if (length(line) + 1 + length(words[i]) > 100) { print line; line = sprintf("%21s", "") } \
	      line = line " " words[i] } \
	    print line } \
	  { text = "" }' $(firstword $(MAKEFILE_LIST))

## every test: the package, the grader, nbval over book/, exercises/, solutions/, and the built
## book in a browser -- so the book is built first (after one build, only changed notebooks run);
## it ends with the ten slowest tests and the fifteen slowest files
test: book
	$(PY) -m pytest -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder \
	  tests book exercises solutions --nbval-lax --nbval-current-env --durations=10

## the Jupyter Book in _build/html, every notebook executed, warnings as errors
book: $(STAMP)
	$(VENV)/bin/jupyter-book build . -W -n --keep-going
	@echo "The book is at $(CURDIR)/_build/html/index.html"

## every notebook of the book executed beside two busy processes, each cell timed against the
## timeout (a cell over a third of it fails: a machine three times slower would time out)
book-under-load: $(STAMP)
	$(PY) .ci/book_under_load.py

## copy a chapter's exercises into work/ (CH=03), or any notebook (NB=path); never overwrites
work: $(STAMP)
	@if [ -z "$(CH)$(NB)" ]; then \
	  echo "say which exercise: make work CH=03 (or NB=path/to/notebook.ipynb)" >&2; exit 2; fi
	$(PY) -m course_attn.workspace $(or $(CH),$(NB)) --work $(WORK)

## JupyterLab on the whole repository, opened in work/ (so an exercise's links to book/ open);
## it prints the address to open, with its token; LAB_ARGS adds options
lab: $(STAMP)
	mkdir -p $(WORK)
	$(VENV)/bin/jupyter lab --ServerApp.root_dir=. --ContentsManager.preferred_dir=$(WORK) \
	  $(ALLOW_ROOT) $(LAB_ARGS)

## grade every notebook in work/, or NB=path (a notebook or a folder); JSON=file also writes a report
grade: $(STAMP)
	@if [ -z "$(NB)" ] && ! ls $(WORK)/*.ipynb >/dev/null 2>&1; then \
	  echo "$(WORK)/ has no notebook to grade yet: start one with make work CH=03" >&2; exit 2; fi
	$(PY) -m course_attn.grade $(or $(NB),$(WORK)) $(if $(JSON),--json $(JSON))

## regenerate exercises/ from solutions/ (refuses to overwrite a student's work unless FORCE=1)
exercises: $(STAMP)
	$(PY) -m course_attn.grading.generate $(if $(FORCE),--force)

## the mutants of every exercise's reference (an operator flipped, a constant or slice bound
## moved by one, two arguments swapped, a term dropped), each run on the hidden cases of 20
## seeds: each must lose points on every seed, or be listed as equivalent with its reason
mutants: $(STAMP)
	$(PY) -m course_attn.grading.mutants --seeds 20

## time and peak memory of every backend, as ratios to PyTorch's SDPA
bench: $(STAMP)
	$(PY) -m course_attn.bench

## on a machine with a CUDA GPU: the package's tests, the Triton kernel, the grader's sandbox,
## chapters 8-11 and the bench, each within its time budget, into one report (OUT=folder, default
## gpu-report/); it uses .venv where there is one, else the machine's own python3 and torch
gpu-check:
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m course_attn.gpu_check $(if $(OUT),--out $(OUT))

## what the build and the tests leave behind (never work/)
clean:
	rm -rf _build .pytest_cache .hypothesis artifacts gpu-report
