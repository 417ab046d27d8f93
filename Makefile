# Convenience targets; each is also a plain command in README.md.
VENV ?= .venv
PY := $(VENV)/bin/python
WORKDIR ?= runs/midas_cpu

.PHONY: setup demo test bench clean

$(VENV)/.installed: setup.py requirements/constraints.txt requirements/t5-reference.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c requirements/constraints.txt -e ".[data,convert,notebooks,test,wandb,eval]" -r requirements/t5-reference.txt
	$(PY) -m pip install -q --no-deps t5==0.9.4
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/midas compare --gin_file=gin/experiments/midas_cpu.gin --workdir=$(WORKDIR)

test: setup
	$(PY) -m pytest

bench: setup
	$(VENV)/bin/midas bench train --gin_file=gin/experiments/bench_cpu.gin

clean:
	rm -rf $(VENV) runs .pytest_cache
