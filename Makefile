# hybrid — the commands the README names.
PYTHON ?= python3
NPROC ?= 2
# pytest-xdist processes for `make test` (each takes whole test files); 0 runs the suite in one process. 3 on the
# 2 cores measured no better: 544 against 638 s in one adjacent pair of runs, 667 against 615 s in another, and up
# to 14 % more CPU (docs/benchmarks/2026-11-29-suite-time.md)
TEST_WORKERS ?= 2
export OMP_NUM_THREADS ?= 1

.PHONY: setup ready run test test-slurm lint bench gpu-check gpu-check-dry clean

setup:            ## install torch (CPU or CUDA build) and hybrid with test extras, into $(PYTHON)
	PYTHON="$(PYTHON)" bash scripts/setup.sh

ready:            ## `make setup` only when $(PYTHON) lacks something (scripts/ready.py); run and test call it first
	@PYTHON="$(PYTHON)" bash scripts/setup.sh --if-needed

run: ready        ## the default job: gpt-tiny on the embedded corpus, data parallel over $(NPROC) ranks, with $(PYTHON)
	PYTHON="$(PYTHON)" bash launch/local.sh $(NPROC)

test: ready       ## the whole test suite (what .ci/run calls)
	$(PYTHON) -m ruff check hybrid tests
	$(PYTHON) -m pytest -q --durations=25 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

test-slurm: ready ## launch/slurm.sbatch under a real one-machine Slurm (Debian's slurm-wlm and munge; root to install)
	bash scripts/slurm_cluster.sh install
	bash scripts/slurm_cluster.sh start
	SLURM_CONF=$${SLURM_DIR:-/tmp/hybrid-slurm}/slurm.conf HYBRID_SLURM=1 $(PYTHON) -m pytest -q \
		tests/e2e/test_slurm_cluster.py; status=$$?; bash scripts/slurm_cluster.sh stop; exit $$status

lint:
	$(PYTHON) -m ruff check hybrid tests

bench:            ## hybrid's step vs a plain PyTorch loop on transformers' GPT2LMHeadModel
	$(PYTHON) -m hybrid.bench.step_vs_hf

gpu-check:        ## on a CUDA GPU: tests, CUDA vs CPU, tokens/s and MFU of gpt-125m/gpt-1b in bf16 (with/without compile), vs transformers
	$(PYTHON) -m hybrid.bench.gpucheck

gpu-check-dry:    ## the GPU check's code paths on CPU, tiny (what CI runs through tests/unit/test_gpucheck.py)
	$(PYTHON) -m hybrid.bench.gpucheck --dry-run

clean:
	rm -rf runs outputs .pytest_cache
