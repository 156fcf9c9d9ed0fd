"""Launch scripts (torchrun multi-node, SLURM, NGC container) and the Dockerfile."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _sh(script, *args, env=None, cwd=None):
    """Run a launch script; its Python (which reads the config) is this test's, on this checkout."""
    import os
    import subprocess
    import sys

    full_env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "NPROC_PER_NODE")}
    full_env.update({"PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}, **(env or {}))
    return subprocess.run(["bash", str(ROOT / "launch" / script), *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd or ROOT, timeout=60)


@pytest.mark.parametrize("script", ["torchrun_multinode.sh", "slurm.sbatch", "ngc_run.sh", "gpu_selftest.sh"])
def test_launch_scripts_parse(script):
    import subprocess

    path = ROOT / "launch" / script
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    assert path.read_text().startswith("#!/usr/bin/env bash\n")


def test_torchrun_multinode_command():
    cfg = "configs/qwen2.5-32b_seq_alp.yaml"
    res = _sh("torchrun_multinode.sh", cfg, "trainer.iterations=3",
              env={"DRY_RUN": "1", "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "node0", "GPUS_PER_NODE": "8"})
    assert res.returncode == 0, res.stderr
    cmd = res.stdout.split()
    for flag, value in [("--nnodes", "2"), ("--node_rank", "1"), ("--nproc_per_node", "8"), ("--master_addr", "node0")]:
        assert cmd[cmd.index(flag) + 1] == value
    assert cmd[cmd.index("-m", cmd.index("--master_port")) + 1:] == ["megatron_alp.cli", "train", cfg, "trainer.iterations=3"]


def test_torchrun_multinode_leaves_the_engine_gpus_to_the_engines():
    """With rollout.placement: separate the node's rollout.gpus run the engines: torchrun starts a
    trainer rank on each other GPU, read from the config and its overrides; NPROC_PER_NODE overrides."""
    cfg = "configs/qwen2.5-math-1.5b_token_alp_async.yaml"  # rollout.gpus: [4, 5, 6, 7]

    def nproc(*args, **env):
        res = _sh("torchrun_multinode.sh", cfg, *args, env={"DRY_RUN": "1", "GPUS_PER_NODE": "8", **env})
        assert res.returncode == 0, res.stderr
        cmd = res.stdout.split()
        return int(cmd[cmd.index("--nproc_per_node") + 1]), cmd

    ranks, cmd = nproc("trainer.iterations=3")
    assert ranks == 4 and cmd[-2:] == [cfg, "trainer.iterations=3"]
    assert nproc("rollout.gpus=[6,7]")[0] == 6
    assert nproc("rollout.placement=colocated", "rollout.gpus=[]", "trainer.max_staleness=0")[0] == 8
    assert nproc(NPROC_PER_NODE="2")[0] == 2
    res = _sh("torchrun_multinode.sh", cfg, env={"DRY_RUN": "1", "GPUS_PER_NODE": "4"})
    assert res.returncode == 2 and "GPUS_PER_NODE=4 leaves none for the trainer" in res.stderr
    res = _sh("torchrun_multinode.sh", cfg, env={"DRY_RUN": "1", "GPUS_PER_NODE": "8", "NPROC_PER_NODE": "9"})
    assert res.returncode == 2 and "NPROC_PER_NODE must be" in res.stderr
    res = _sh("torchrun_multinode.sh", cfg, "rollout.gpus=[6,6]", env={"DRY_RUN": "1", "GPUS_PER_NODE": "8"})
    assert res.returncode == 2 and "rollout: gpus [6, 6] must be distinct" in res.stderr


@pytest.mark.parametrize("env,message", [
    ({"NNODES": "2", "GPUS_PER_NODE": "8"}, "MASTER_ADDR"),
    ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "node0", "GPUS_PER_NODE": "8"}, "NODE_RANK=2 must be below"),
    ({"GPUS_PER_NODE": "eight"}, "GPUS_PER_NODE must be"),
])
def test_torchrun_multinode_bad_input(env, message):
    res = _sh("torchrun_multinode.sh", "configs/qwen2.5-32b_seq_alp.yaml", env={"DRY_RUN": "1", **env})
    assert res.returncode == 2 and message in res.stderr
    res = _sh("torchrun_multinode.sh", "configs/nope.yaml", env={"DRY_RUN": "1", "GPUS_PER_NODE": "1"})
    assert res.returncode == 2 and "configs/nope.yaml does not exist" in res.stderr


def test_slurm_wrapper_gives_each_node_its_rank(tmp_path):
    """Stand-in srun/scontrol (SLURM is not installed here): srun runs the task once per node with
    SLURM_NODEID set, as SLURM does; every node must get its own NODE_RANK and the first host as master."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\nprintf 'gpu-a\\ngpu-b\\n'\n")
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift; done\n"
        "for n in $(seq 0 $((SLURM_JOB_NUM_NODES - 1))); do SLURM_NODEID=$n \"$@\" || exit $?; done\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    import os

    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu-[a-b]",
           "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_GPUS_ON_NODE": "8", "DRY_RUN": "1"}
    res = _sh("slurm.sbatch", "configs/qwen2.5-32b_seq_alp.yaml", "loss.kl_coef=0", env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    lines = [line.split() for line in res.stdout.strip().splitlines()]
    assert len(lines) == 2
    for rank, cmd in enumerate(lines):
        assert cmd[cmd.index("--node_rank") + 1] == str(rank)
        assert cmd[cmd.index("--master_addr") + 1] == "gpu-a" and cmd[cmd.index("--nnodes") + 1] == "2"
        assert cmd[-1] == "loss.kl_coef=0"
    res = _sh("slurm.sbatch", "configs/qwen2.5-32b_seq_alp.yaml", env={"DRY_RUN": "1", "SLURM_JOB_NUM_NODES": ""})
    assert res.returncode != 0 and "SLURM" in res.stderr


def test_ngc_run_command(tmp_path):
    res = _sh("ngc_run.sh", "megatron-alp", "train", "configs/x.yaml",
              env={"DRY_RUN": "1", "IMAGE": "img:tag", "MODELS_DIR": str(tmp_path), "DATA_DIR": str(tmp_path / "no"),
                   "NNODES": "2", "NCCL_DEBUG": "INFO"})
    assert res.returncode == 0, res.stderr
    cmd = res.stdout.split()
    assert cmd[:2] == ["docker", "run"] and "--gpus" in cmd and "--ipc=host" in cmd
    assert f"{tmp_path}:/models" in cmd and "not mounting it at /data" in res.stderr
    assert cmd[cmd.index("img:tag") + 1:] == ["megatron-alp", "train", "configs/x.yaml"]
    assert {"NNODES", "NCCL_DEBUG"} <= {cmd[i + 1] for i, c in enumerate(cmd) if c == "-e"}
    res = _sh("ngc_run.sh", "configs/qwen3-4b_seq_alp.yaml", "loss.kl_coef=0", env={"DRY_RUN": "1"})
    assert res.returncode == 0, res.stderr
    cmd = res.stdout.split()
    assert cmd[-4:] == ["bash", str(ROOT / "launch" / "torchrun_multinode.sh"), "configs/qwen3-4b_seq_alp.yaml",
                        "loss.kl_coef=0"]
    assert cmd[cmd.index("-w") + 1] == str(ROOT)


def test_dockerfile_lint():
    """The image cannot be built here (no Docker daemon): check its structure instead."""
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    instructions = []
    for line in lines:
        if line.strip() and not line.startswith("#") and not line.startswith((" ", "\t")):
            instructions.append(line.split()[0])
    assert instructions[0] in ("ARG", "FROM") and "FROM" in instructions
    text = "\n".join(lines)
    assert re.search(r"^FROM nvcr\.io/nvidia/pytorch:\$\{NGC_TAG\}-py3$", text, re.M)
    assert re.search(r"^ARG NGC_TAG=\d\d\.\d\d$", text, re.M)
    for needed in ["vllm==", "sglang", "megatron-core==", "transformer_engine[pytorch]", "apex",
                   "math-verify==", "nvidia-modelopt", 'pip install -e ".[gpu]"', "PIP_CONSTRAINT"]:
        assert needed in text, needed
    for arg in set(re.findall(r"\$\{(\w+)\}", text)):
        assert re.search(rf"^ARG {arg}=", text, re.M), f"${{{arg}}} used but no ARG {arg}"
    for src in re.findall(r"^COPY (\S+)", text, re.M):
        assert (ROOT / src).exists(), f"COPY {src}: no such path in the repository"
    continued = [i for i, line in enumerate(lines) if line.rstrip().endswith("\\")]
    assert all(lines[i + 1].strip() for i in continued), "a line continuation runs into a blank line"


def test_dockerfile_pins_agree_with_megatron_core():
    """TE inside the range the installed megatron-core declares; apex built for explicit GPU archs;
    no extras a pinned package does not have; the SGLang environment gets pip without ensurepip."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement
    from packaging.version import Version

    text = (ROOT / "Dockerfile").read_text()
    te = Version(re.search(r"^ARG TE_VERSION=(\S+)$", text, re.M).group(1))
    te_reqs = [Requirement(r) for r in requires("megatron-core") if r.startswith("transformer-engine")]
    assert te_reqs and all(te in r.specifier for r in te_reqs), (te, [str(r) for r in te_reqs])
    assert re.search(r'TORCH_CUDA_ARCH_LIST="\$\{TORCH_CUDA_ARCH_LIST\}".*\n?.*pip install --no-build-isolation', text)
    assert re.search(r'^ARG TORCH_CUDA_ARCH_LIST="[0-9.;]+"$', text, re.M)
    assert "nvidia-modelopt[" not in text  # 0.47 has no [torch] extra
    assert not re.search(r"^RUN .*python -m venv", text, re.M) and "python -m virtualenv /opt/sglang" in text

