"""Every shipped config validates, the paper's experiments carry the paper's settings, each
parallel layout fits its nodes and model, and docs/configuration.md matches config.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_alp.cli import main as cli_main
from megatron_alp.config import (TIR_SYSTEM_PROMPT, ConfigError, DataConfig, config_docs, config_from_dict,
                                 load_config, parse_layer_selection)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
PAPER = [p for p in CONFIGS if not p.name.startswith("quickstart")]

# Published architecture facts of the models the configs name (config.json of each checkpoint):
# layers, attention heads, KV heads.
MODELS = {
    "Qwen2.5-Math-1.5B": (28, 12, 2),
    "Qwen3-4B": (36, 32, 8),
    "Qwen2.5-7B": (28, 28, 4),
    "Qwen3-30B-A3B-Base": (48, 32, 4),
    "Qwen2.5-32B": (64, 40, 8),
}
TOKEN_LOSSES = {"alp_token", "grpo", "token_mis", "token_tis"}
EXPECTED = {  # the paper's experiments, each a ready config
    "qwen2.5-math-1.5b_token_alp": "alp_token", "qwen2.5-math-1.5b_seq_alp": "alp_seq",
    "qwen2.5-math-1.5b_grpo": "grpo", "qwen2.5-math-1.5b_token_mis": "token_mis",
    "qwen2.5-math-1.5b_seq_mis": "seq_mis", "qwen2.5-math-1.5b_seq_bypass": "seq_bypass",
    "qwen3-4b_seq_alp": "alp_seq", "qwen2.5-7b_tir_seq_alp": "alp_seq",
    "qwen2.5-math-1.5b_ablation_layers_0-4": "alp_token", "qwen2.5-math-1.5b_ablation_layers_12-16": "alp_token",
    "qwen2.5-math-1.5b_ablation_layers_19-23": "alp_token", "qwen2.5-math-1.5b_ablation_logits_only": "alp_token",
    "qwen3-30b-a3b_seq_alp": "alp_seq", "qwen2.5-32b_seq_alp": "alp_seq",
}


def test_all_experiments_present():
    assert {p.stem for p in PAPER} >= set(EXPECTED)
    for stem, loss in EXPECTED.items():
        assert load_config(ROOT / "configs" / f"{stem}.yaml").loss.name == loss, stem


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads(path):
    cfg = load_config(path)
    assert cfg.trainer.output_dir


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.name)
def test_paper_settings(path):
    cfg = load_config(path)
    assert cfg.optimizer.lr == 1e-6 and cfg.optimizer.weight_decay == 0.01
    assert cfg.trainer.prompts_per_iteration == 512 and cfg.trainer.updates_per_iteration == 16
    s = cfg.rollout.sampling
    assert s.n == 8 and s.temperature == 1.0 and s.max_prompt_length == 2048
    assert s.max_response_length == (16384 if cfg.tir.enabled else 2048)
    loss = cfg.loss
    assert loss.dual_clip_c == 10.0 and loss.kl_coef == 0.001 and loss.entropy_coef == 0.001
    expected_clip = (0.2, 0.28) if loss.name in TOKEN_LOSSES else (0.5, 3.0)
    assert (loss.clip_low, loss.clip_high) == expected_clip
    if loss.name.endswith("_mis"):
        assert loss.mis_threshold == 2.0
    alp = loss.name.startswith("alp_")
    assert cfg.perturbation.enabled == alp, "ALP configs perturb, baselines do not"
    if alp:
        assert cfg.perturbation.init_std == 1e-4 and cfg.perturbation.lr == 5e-4
    assert (cfg.eval.k, cfg.eval.temperature, cfg.eval.max_response_length) == (32, 1.0, 4096)
    assert len(cfg.eval.files) == 5
    assert cfg.model.hf_path.startswith("/models/"), "placeholders users replace with their checkpoints"


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.name)
def test_parallel_layout_fits_nodes_and_model(path):
    """The layout divides the GPUs named in the header, the model's heads and layers, and the batch."""
    cfg = load_config(path)
    header = path.read_text().split("\n\n")[0]
    m = re.search(r"Hardware: (\d+) nodes? x (\d+) H100", header)
    assert m, f"{path.name}: header must name its hardware ('Hardware: N node(s) x 8 H100')"
    world = int(m.group(1)) * int(m.group(2))
    layers, heads, kv_heads = MODELS[Path(cfg.model.hf_path).name]
    p = cfg.parallel
    tp, pp, ep = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size
    etp = p.expert_tensor_parallel_size or tp
    assert world % (tp * pp) == 0 and world % (etp * ep * pp) == 0
    assert heads % tp == 0 and kv_heads % tp == 0 and layers % pp == 0
    assert tp <= int(m.group(2)), "tensor parallelism stays inside a node"
    dp = world // (tp * pp)
    assert (cfg.trainer.prompts_per_iteration * cfg.rollout.sampling.n) % (dp * cfg.trainer.updates_per_iteration) == 0
    if cfg.perturbation.enabled and cfg.perturbation.layers not in ("all", "logits"):
        parse_layer_selection(cfg.perturbation.layers, layers)
    assert cfg.rollout.tensor_parallel_size <= int(m.group(2))


def test_layer_ablations_match_the_paper():
    chosen = {}
    for path in PAPER:
        if "ablation" in path.stem:
            cfg = load_config(path)
            chosen[path.stem] = parse_layer_selection(cfg.perturbation.layers, 28)
    assert sorted(chosen.values(), key=lambda s: -1 if s is None else min(s)) == [
        None, set(range(0, 5)), set(range(12, 17)), set(range(19, 24))]


def test_tir_and_moe_specifics():
    tir = load_config(ROOT / "configs" / "qwen2.5-7b_tir_seq_alp.yaml")
    assert tir.tir.enabled and tir.tir.max_turns == 5 and tir.tir.mask_void_turns
    assert tir.trainer.prompts_per_iteration // tir.trainer.updates_per_iteration == 32  # mini-update size
    moe = load_config(ROOT / "configs" / "qwen3-30b-a3b_seq_alp.yaml")
    assert moe.parallel.expert_model_parallel_size == 8


def test_tir_system_prompt_and_warm_start_format():
    """TIR runs tell the model about the interpreter unless the config says otherwise; the TIR warm
    start needs TIR rollouts."""
    tir = load_config(ROOT / "configs" / "qwen2.5-7b_tir_seq_alp.yaml")
    assert tir.data.system_prompt == TIR_SYSTEM_PROMPT and not tir.data.replace_system_prompt
    quick = load_config(ROOT / "configs" / "quickstart_tir_cpu.yaml")
    assert "```python" in quick.data.system_prompt and "```output" in quick.data.system_prompt
    assert quick.data.replace_system_prompt and quick.tir.enabled and quick.tir.tool_format == "inline"
    assert quick.trainer.sft_warmup_format == "tir" and quick.loss.name == "alp_seq"
    default = load_config(ROOT / "configs" / "quickstart_tir_cpu.yaml", ["data.system_prompt=null"])
    assert default.data.system_prompt is None
    unset = config_from_dict({"model": {"tiny": "qwen2"}, "tir": {"enabled": True}})
    assert unset.data.system_prompt == TIR_SYSTEM_PROMPT
    single = load_config(ROOT / "configs" / "quickstart_cpu.yaml")
    assert single.data.system_prompt == DataConfig().system_prompt
    with pytest.raises(ConfigError, match="sft_warmup_format=tir .* needs tir.enabled"):
        load_config(ROOT / "configs" / "quickstart_tir_cpu.yaml", ["tir.enabled=false"])


def test_bad_config_names_the_key(tmp_path):
    text = (ROOT / "configs" / "qwen2.5-math-1.5b_token_alp.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("clip_high: 0.28", "clip_hgh: 0.28").replace("n: 8", "n: 0"))
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert "loss.clip_hgh: unknown key" in str(err.value)
    assert "rollout.sampling.n" in str(err.value)


def test_configuration_docs_up_to_date(tmp_path):
    """docs/configuration.md is generated; regenerate with `megatron-alp config-docs --out docs/configuration.md`."""
    out = tmp_path / "configuration.md"
    assert cli_main(["config-docs", "--out", str(out)]) == 0
    assert out.read_text() == config_docs()
    assert (ROOT / "docs" / "configuration.md").read_text() == config_docs(), (
        "docs/configuration.md is stale: run `megatron-alp config-docs --out docs/configuration.md`")


# ------------------------------------------------------------------- launch scripts, Dockerfile


def _sh(script, *args, env=None, cwd=None):
    import os
    import subprocess

    full_env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR")}
    full_env.update(env or {})
    return subprocess.run(["bash", str(ROOT / "launch" / script), *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd or ROOT, timeout=60)


@pytest.mark.parametrize("script", ["torchrun_multinode.sh", "slurm.sbatch", "ngc_run.sh"])
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
