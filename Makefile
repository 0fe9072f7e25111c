# Two commands do all the set-up on a fresh machine:
#   make quickstart   install into .venv and train the digits job
#   make test         install with the test extra, lint, run the test suite

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# pytest-xdist workers for `make test`: the suite's tests wait on child processes much of the
# time, so two workers keep two cores busy. More than the cores makes timing-bound tests flaky.
TEST_WORKERS ?= 2

.PHONY: quickstart test lint venv clean sshd slurm gpu-check

quickstart: $(VENV)/.installed-base
	$(VENV)/bin/jabas run -c examples/quickstart.toml

test: $(VENV)/.installed-test sshd slurm
	$(VENV)/bin/ruff check src tests models benchmarks
	$(VENV)/bin/ruff format --check src tests models benchmarks
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --durations=25

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check src tests models benchmarks
	$(VENV)/bin/ruff format --check src tests models benchmarks

venv: $(VENV)/.installed-test

# On a machine with a GPU: the CUDA paths (tests marked gpu), the engine's overhead on CUDA, and
# ResNet-50's iteration beside the plain loop (issue #35).
gpu-check: $(VENV)/.installed-test
	$(PY) -m pytest -m gpu -v -rs
	$(PY) benchmarks/engine_overhead.py --device cuda
	$(PY) benchmarks/gpu_resnet50.py --run
	$(PY) benchmarks/gpu_resnet50.py --cudnn-benchmark

# The jabas sync tests start real OpenSSH servers on loopback ports. On a fresh
# Debian machine run as root (CI), install openssh-server for them; anywhere
# else do nothing, and those tests skip saying why.
sshd:
	@if [ ! -x /usr/sbin/sshd ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing openssh-server for the jabas sync tests"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get update -qq >/dev/null && \
		apt-get install -y -qq --no-install-recommends openssh-server >/dev/null; \
	fi

# The Slurm tests (tests/test_slurm.py) start a real slurmctld, one slurmd per emulated node and a
# munged. On a fresh Debian machine run as root (CI), install Slurm 22.05 and munge for them; anywhere
# else do nothing, and those tests skip saying why. The packages' services are not started here.
slurm:
	@if { [ ! -x /usr/sbin/slurmctld ] || [ ! -x /usr/sbin/slurmd ] || ! command -v sbatch >/dev/null || \
	      [ ! -x /usr/sbin/munged ]; } && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing slurmctld, slurmd, slurm-client and munge for the Slurm tests"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get update -qq >/dev/null && \
		apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null; \
	fi

# A torch already installed (a CUDA build, say) is used as it is: the venv then sees
# the system packages. Only where none is present is torch 2.13.0 installed.
$(PY):
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "using the installed torch $$($(PYTHON) -c 'import torch; print(torch.__version__)')"; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV); \
	fi

$(VENV)/.torch: | $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet "torch==2.13.0"
	@touch $@

$(VENV)/.installed-base: pyproject.toml $(VENV)/.torch
	$(PIP) install --quiet -e .
	@touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.torch
	$(PIP) install --quiet -e ".[test]"
	@touch $@ $(VENV)/.installed-base

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
