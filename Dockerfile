# megatron-alp GPU image: NGC PyTorch + vLLM + Megatron-Core, Transformer Engine, apex +
# SGLang (own virtual environment) + math-verify + nvidia-modelopt + this package.
#
#   docker build -t megatron-alp:gpu .
#   docker build -t megatron-alp:gpu --build-arg NGC_TAG=25.12 --build-arg VLLM_VERSION=0.33.0 .
#   bash launch/ngc_run.sh megatron-alp train configs/qwen2.5-math-1.5b_token_alp.yaml
#
# Why this layout (the version pins below are the ones it was written for; bump them together):
# * The trainer drives vLLM from its own Python processes (colocated rollouts, in-place weight updates), so
#   vLLM, Megatron-Core and Transformer Engine share one torch. vLLM pins an exact torch
#   (0.33.0: torch==2.14.0) that differs from the NGC image's own build, so vLLM's torch replaces
#   it, and TE and apex are rebuilt against that torch: the image's prebuilt TE/apex are compiled
#   for its torch and would fail to load. The NGC image still provides CUDA, cuDNN, NCCL and the
#   compilers for those builds.
# * SGLang pins a different torch (0.5.23: torch==2.14.1) and runs as a separate server process
#   anyway, so it gets its own virtual environment, /opt/sglang; the sglang rollout engine starts
#   `python -m sglang.launch_server` with the interpreter named by MEGATRON_ALP_SGLANG_PYTHON.
# * NGC images pin their packages through PIP_CONSTRAINT=/etc/pip/constraint.txt; the pins above
#   must win, so the constraint is cleared.
# * Transformer Engine stays inside the range megatron-core 0.16.1 declares (>=2.9, <2.12): a newer
#   TE changes layer internals Megatron-Core 0.16 calls into. apex compiles for the GPU generations
#   the configs target (A100 8.0, H100/H200 9.0): without TORCH_CUDA_ARCH_LIST its build would
#   probe a GPU, and there is none while building.
# * The SGLang environment is made by virtualenv, which brings its own pip: the image's python may
#   lack ensurepip, which `python -m venv` needs.
ARG NGC_TAG=25.12
FROM nvcr.io/nvidia/pytorch:${NGC_TAG}-py3

ARG VLLM_VERSION=0.33.0
ARG SGLANG_VERSION=0.5.23
ARG MCORE_VERSION=0.16.1
ARG TE_VERSION=2.11.0
ARG APEX_REF=master
ARG MODELOPT_VERSION=0.47.0
ARG MATH_VERIFY_VERSION=0.9.0
ARG MAX_JOBS=16
ARG TORCH_CUDA_ARCH_LIST="8.0;9.0"

ENV PIP_CONSTRAINT="" \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1 \
    TOKENIZERS_PARALLELISM=false \
    MEGATRON_ALP_SGLANG_PYTHON=/opt/sglang/bin/python

# 1. vLLM with the torch it pins (replaces the image's torch and torchvision).
RUN pip uninstall -y transformer-engine transformer-engine-cu12 transformer-engine-torch apex || true \
 && pip install "vllm==${VLLM_VERSION}"

# 2. Transformer Engine and apex compiled against that torch (fused kernels, FP8, TE layer spec).
RUN NVTE_FRAMEWORK=pytorch MAX_JOBS=${MAX_JOBS} NVTE_CUDA_ARCHS="80;90" \
    pip install --no-build-isolation "transformer_engine[pytorch]==${TE_VERSION}"
RUN git clone https://github.com/NVIDIA/apex /tmp/apex \
 && git -C /tmp/apex checkout "${APEX_REF}" \
 && cd /tmp/apex && TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" APEX_CPP_EXT=1 APEX_CUDA_EXT=1 MAX_JOBS=${MAX_JOBS} \
    pip install --no-build-isolation . \
 && rm -rf /tmp/apex

# 3. Megatron-Core, rule-based math rewards, FP8 quantization of rollout checkpoints.
RUN pip install "megatron-core==${MCORE_VERSION}" "math-verify==${MATH_VERIFY_VERSION}" \
    "nvidia-modelopt==${MODELOPT_VERSION}"

# 4. SGLang in its own environment (its torch pin conflicts with vLLM's).
RUN pip install virtualenv \
 && python -m virtualenv /opt/sglang \
 && /opt/sglang/bin/pip install "sglang[all]==${SGLANG_VERSION}"

# 5. megatron-alp itself (editable, so a mounted checkout at the same path can replace it).
WORKDIR /workspace/megatron-alp
COPY pyproject.toml README.md ./
COPY megatron_alp ./megatron_alp
COPY checkpoint_tools ./checkpoint_tools
COPY configs ./configs
COPY launch ./launch
COPY data ./data
RUN pip install -e ".[gpu]"

# Every component imports as the trainer imports it (no GPU is needed to import; a build against the
# wrong torch fails here, not in the first run): Transformer Engine's PyTorch modules through the
# trainer's own startup check (`import transformer_engine` alone swallows their ImportError).
RUN python -c "import torch, vllm, megatron.core, apex, math_verify, modelopt.torch.quantization, megatron_alp.cli; \
from megatron_alp.models.layer_spec import te_import_error; error = te_import_error(); \
assert error is None, f'Transformer Engine: {error}'" \
 && /opt/sglang/bin/python -c "import sglang" \
 && megatron-alp --help > /dev/null

CMD ["bash"]
