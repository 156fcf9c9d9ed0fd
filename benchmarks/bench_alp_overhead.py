"""What ALP costs: a training step, a policy update and a whole training iteration, side by side.

``--mode iteration``: whole ``megatron-alp train`` iterations of ``--config`` (the CPU quickstart),
one run per arm (``--arms``: losses, default GRPO, Token-ALP, Seq-ALP) from one shared warm-started
base model with the same seed and data, in ``--rounds`` rounds whose arm order rotates, so a slow
spell of the machine hits every arm. Per arm: the median s/iteration over every round's iterations
but each run's first (engine warm-up), its interquartile range, the ratio to the first arm, and the
median of each phase's ``timing/*_s`` (rollout, reward, old_logprob, calibration, ref_logprob,
update, sync). The rollout differs between arms only as much as their policies do; the trainer
phases (old_logprob to sync) are where ALP's own cost lives, so their sum is compared too. The
old-policy and reference passes are the same unperturbed work in every arm: the spread of their
times between arms is the machine's noise, and the update measured in units of them (per iteration)
is the estimate that survives a loaded machine.

``--mode update``: in one process, one learner per arm on the same weights (a tiny qwen2 of
``--tiny-config``, 104M parameters by default), each doing one iteration's policy update
(``trainer.updates_per_iteration`` optimizer steps: forward, backward, optimizer step) on the same
synthetic rollout batch of ``--config``'s size; the arms alternate in ``--reps`` rounds. For a model
whose whole iteration is too slow on a few cores.

``--mode step`` (the default): one forward + backward, unperturbed vs ALP on every layer.

One model and one batch (a random Megatron-Core GPT built by the project's builder, Qwen3 layout,
one rank in a 1-process group), three variants of the same step:

- ``unperturbed``: the forward + backward outside ``perturbed_step`` (the ALP hooks are attached
  but inactive, so the same weights and batch serve all three variants);
- ``alp-saved-eps``: every layer perturbed, autograd saving eps for sigma's gradient
  (``megatron_alp.training.perturbation.REGENERATE_EPS = False``, the former implementation);
- ``alp-regen-eps``: every layer perturbed, eps redrawn in the backward (the default).

Time: the variants alternate within each of ``--reps`` rounds (their order rotates), after
``--warmup`` untimed rounds; median and best per variant, and each ALP variant's ratio to the
unperturbed step. The cost of the second draw is shown on its own: the time of ``torch.randn`` of
one perturbed activation, times the number of perturbed layers.

Memory:
- saved for backward: bytes of every tensor autograd saves in the forward, counted with
  ``torch.autograd.graph.saved_tensors_hooks`` (exact and deterministic, any device);
- CUDA: ``torch.cuda.max_memory_allocated`` over one step, absolute (weights, gradients, batch
  included) and as the increase over what was allocated before the step;
- CPU: the peak RSS increase of one step, each variant in its own subprocess with
  ``MALLOC_MMAP_THRESHOLD_=65536`` (so glibc maps and unmaps every buffer of 64 KiB and more and RSS
  follows the live tensors), measured after two warm-up steps by resetting the kernel's high-water
  mark (``/proc/self/clear_refs``) and reading ``VmHWM`` minus ``VmRSS`` before the step.

The issue's targets: time <= 1.02x and memory <= 1.01x of the unperturbed step.

    python benchmarks/bench_alp_overhead.py --threads 1                     # CPU, fp32, hidden 256 x 4 layers
    python benchmarks/bench_alp_overhead.py --device cuda --dtype bf16 --hidden 2048 --layers 16 \\
        --seq 4096 --batch 1                                                # ~1B model, TE spec if importable
    python benchmarks/bench_alp_overhead.py --mode iteration --rounds 3 --iterations 6   # quickstart, ~10 min
    python benchmarks/bench_alp_overhead.py --mode update --reps 6 trainer.prompts_per_iteration=4 \\
        rollout.sampling.n=4 trainer.updates_per_iteration=1 trainer.micro_batch_size=16   # 104M, ~5 min
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from train_run import train  # noqa: E402  (benchmarks/ is not a package)

VARIANTS = ("unperturbed", "alp-saved-eps", "alp-regen-eps")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# the 104M qwen2 of bench_sync (docs/scaling.md)
MODEL_100M = ('{"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12, '
              '"num_key_value_heads": 4}')
PHASES = ("rollout", "reward", "old_logprob", "calibration", "ref_logprob", "update", "sync")
TRAINER_PHASES = PHASES[2:]
# every run: no validation or checkpoint inside the timed iterations, the arm's own perturbation
RUN_KEYS = ["trainer.eval_interval=0", "trainer.validate_base=false", "trainer.save_interval=100000",
            "trainer.progress_bar=false", "perturbation.enabled=null"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["step", "update", "iteration"], default="step")
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart_cpu.yaml",
                   help="update, iteration: the run's config")
    p.add_argument("--arms", nargs="+", default=["grpo", "alp_token", "alp_seq"],
                   help="update, iteration: loss.name of each arm; ratios are to the first")
    p.add_argument("--rounds", type=int, default=3, help="iteration: runs per arm")
    p.add_argument("--iterations", type=int, default=6, help="iteration: iterations per run (the first is not timed)")
    p.add_argument("--out", type=Path, default=Path("/tmp/bench_alp_overhead"),
                   help="update, iteration: the model and the runs")
    p.add_argument("--tiny-config", default=MODEL_100M, help="update: the tiny qwen2's sizes (JSON)")
    p.add_argument("--prompt-len", type=int, default=40, help="update: prompt tokens of every synthetic row")
    p.add_argument("--response-len", type=int, default=24, help="update: longest response (1..this, uniform)")
    p.add_argument("overrides", nargs="*", help="update, iteration: KEY=VALUE config overrides for every arm")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ffn", type=int, default=None, help="MLP intermediate size (default 3 x hidden)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default hidden / 64)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default heads / 2)")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--shape", choices=["scalar", "vector"], default="scalar", help="sigma per layer or per dimension")
    p.add_argument("--spec", choices=["auto", "local", "te"], default="auto",
                   help="Megatron layer spec (auto: TE on a GPU with Transformer Engine, else local)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--no-rss", action="store_true", help="CPU: skip the per-variant peak-RSS subprocesses")
    p.add_argument("--json", default=None, help="also write the numbers to this file")
    p.add_argument("--rss-child", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


class Bench:
    """The model, the batch and one forward + backward step per variant."""

    def __init__(self, args):
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        if args.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device here")
        if args.device == "cpu" and torch.cuda.is_available():
            raise SystemExit("--device cpu on a GPU machine: the project's builder places the model on the GPU")
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        import megatron_alp.training.perturbation as alp
        from megatron_alp.config import ModelConfig, ParallelConfig, PerturbationConfig
        from megatron_alp.models.families import hf_to_megatron
        from megatron_alp.models.tiny import tiny_hf_config
        from megatron_alp.runtime.parallel import init_distributed
        from megatron_alp.training.builder import build_gpt_model

        self.torch, self.alp, self.ce = torch, alp, vocab_parallel_cross_entropy
        par = ParallelConfig()
        init_distributed(par)
        heads = args.heads or max(1, args.hidden // 64)
        hf = tiny_hf_config(
            "qwen3", hidden_size=args.hidden, num_hidden_layers=args.layers,
            intermediate_size=args.ffn or 3 * args.hidden, num_attention_heads=heads,
            num_key_value_heads=args.kv_heads or max(1, heads // 2), head_dim=args.hidden // heads,
            vocab_size=args.vocab, max_position_embeddings=max(1024, args.seq),
        )
        torch.manual_seed(0)
        self.model = build_gpt_model(
            hf_to_megatron(hf), ModelConfig(tiny="qwen3", dtype=DTYPES[args.dtype], layer_spec=args.spec), par,
            PerturbationConfig(enabled=True, layers="all", shape=args.shape),
        )
        self.model.train()
        self.device = next(self.model.parameters()).device
        self.sites = len(alp.controller_of(self.model).sites)
        self.params = sum(p.numel() for p in self.model.parameters())
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(self.device)
        self.pos = torch.arange(args.seq).unsqueeze(0).expand(args.batch, -1).to(self.device)
        self.labels = torch.roll(self.tokens, -1, 1)
        self.act_shape = (args.seq, args.batch, args.hidden)  # Megatron's [s, b, h]
        self.step_no = 0

    def sync(self):
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def step(self, variant: str, pack=None) -> None:
        """One forward + backward of the LM loss; ``pack``: a saved_tensors_hooks pack function."""
        torch, alp = self.torch, self.alp
        self.model.zero_grad(set_to_none=True)
        self.step_no += 1
        alp.REGENERATE_EPS = variant != "alp-saved-eps"
        perturb = alp.perturbed_step(self.model, self.step_no) if variant != "unperturbed" else contextlib.nullcontext()
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if pack else contextlib.nullcontext()
        try:
            with perturb:
                with hooks:
                    alp.next_microbatch(self.model)
                    logits = self.model(self.tokens, self.pos, None)
                    loss = self.ce(logits.float(), self.labels).mean()
                del logits
                # The engine directly, as Megatron's schedule does (custom_backward).
                torch.autograd.Variable._execution_engine.run_backward(
                    tensors=(loss,), grad_tensors=(torch.ones_like(loss),), keep_graph=False, create_graph=False,
                    inputs=(), allow_unreachable=True, accumulate_grad=True,
                )
        finally:
            alp.REGENERATE_EPS = True

    def timed(self, variant: str) -> float:
        self.sync()
        t = time.perf_counter()
        self.step(variant)
        self.sync()
        return time.perf_counter() - t

    def saved_bytes(self, variant: str) -> int:
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        self.step(variant, pack)
        return total[0]

    def cuda_peak(self, variant: str) -> dict:
        torch = self.torch
        self.model.zero_grad(set_to_none=True)
        self.sync()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        self.step(variant)
        self.sync()
        peak = torch.cuda.max_memory_allocated()
        return {"peak_bytes": peak, "step_increase_bytes": peak - base}

    def site_seconds(self, variant: str, reps: int) -> float:
        """Median forward + backward time of one ALP site alone on a perturbed activation (the model's
        dtype, an upstream gradient given), in the ``variant``'s eps path."""
        torch, alp = self.torch, self.alp
        site = alp.controller_of(self.model).sites[0]
        g = torch.Generator().manual_seed(1)
        dtype = next(self.model.parameters()).dtype
        base = torch.randn(self.act_shape, generator=g).to(self.device, dtype)
        upstream = torch.randn(self.act_shape, generator=g).to(self.device, dtype)
        times = []
        alp.REGENERATE_EPS = variant != "alp-saved-eps"
        try:
            with alp.perturbed_step(self.model, 0):
                for _ in range(reps + 2):
                    hidden = base.detach().requires_grad_(True)
                    alp.next_microbatch(self.model)
                    self.sync()
                    t = time.perf_counter()
                    out = site(hidden)
                    torch.autograd.Variable._execution_engine.run_backward(
                        tensors=(out,), grad_tensors=(upstream,), keep_graph=False, create_graph=False,
                        inputs=(), allow_unreachable=True, accumulate_grad=True,
                    )
                    self.sync()
                    times.append(time.perf_counter() - t)
        finally:
            alp.REGENERATE_EPS = True
        site.log_sigma.grad = None
        return statistics.median(times[2:])

    def redraw_seconds(self, reps: int) -> float:
        """Median time of one float32 ``randn`` of a perturbed activation (what a backward redraw costs)."""
        torch, times = self.torch, []
        for _ in range(reps + 2):
            self.sync()
            t = time.perf_counter()
            torch.randn(self.act_shape, device=self.device, dtype=torch.float32)
            self.sync()
            times.append(time.perf_counter() - t)
        return statistics.median(times[2:])


class UpdateBench:
    """One iteration's policy update (``trainer.updates_per_iteration`` optimizer steps) on one
    synthetic rollout batch of the config's size, by one learner per arm on the same weights."""

    def __init__(self, args):
        import torch

        from megatron_alp.commands.context import one_process
        from megatron_alp.data.prompts import load_tokenizer, pad_id
        from megatron_alp.models.families import hf_to_megatron, load_hf_config
        from megatron_alp.models.tiny import make_tiny_model
        from megatron_alp.resolve import load_config
        from megatron_alp.training.learner import Learner
        from megatron_alp.training.rl_batch import RLBatch

        if args.threads:
            torch.set_num_threads(args.threads)
        self.process = one_process(0)
        self.process.__enter__()
        model_dir = args.out / "model"
        if not (model_dir / "config.json").is_file():
            make_tiny_model("qwen2", model_dir, seed=0, **json.loads(args.tiny_config))
        hf_args = hf_to_megatron(load_hf_config(model_dir))
        pad = pad_id(load_tokenizer(model_dir))
        common = ["model.tiny=null", f"model.hf_path={model_dir}", "trainer.sft_warmup_steps=0",
                  "perturbation.enabled=null", *args.overrides]
        self.learners = {}
        for arm in args.arms:
            cfg = load_config(args.config, [*common, f"loss.name={arm}"])
            self.learners[arm] = Learner.from_weights(hf_args, cfg, model_dir, pad, perturbation=cfg.perturbation,
                                                      optimizer_state=False)
        t = cfg.trainer
        self.rows = t.prompts_per_iteration * cfg.rollout.sampling.n
        self.sizes = [self.rows // t.updates_per_iteration] * t.updates_per_iteration
        self.params = sum(p.numel() for p in self.learners[args.arms[0]].module.parameters())
        g = torch.Generator().manual_seed(0)
        width = args.prompt_len + args.response_len
        lengths = args.prompt_len + torch.randint(1, args.response_len + 1, (self.rows,), generator=g)
        pos = torch.arange(width)
        tokens = torch.randint(3, hf_args.vocab_size, (self.rows, width), generator=g)
        tokens = torch.where(pos < lengths[:, None], tokens, pad)
        mask = ((pos >= args.prompt_len - 1) & (pos < lengths[:, None] - 1)).float()
        rollout = -2 * torch.rand(self.rows, width, generator=g) * mask
        targets = torch.nn.functional.pad(tokens[:, 1:], (0, 1), value=pad)
        self.batch = RLBatch(tokens, targets, mask, rollout, torch.randn(self.rows, generator=g), lengths,
                             old_logprobs=rollout + 0.01 * mask, ref_logprobs=rollout - 0.01 * mask)
        self.tokens = int(lengths.sum())

    def timed(self, arm: str) -> tuple[float, float]:
        """Wall and CPU seconds (this process, all threads) of one update."""
        t, c = time.perf_counter(), time.process_time()
        self.learners[arm].update(self.batch, self.sizes)
        return time.perf_counter() - t, time.process_time() - c


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q1, med, q3 = statistics.quantiles(xs, n=4) if len(xs) > 1 else (xs[0],) * 3
    return q1, statistics.median(xs), q3


def _table(arms: list[str], times: dict[str, list[float]], what: str) -> None:
    """Per arm: median, quartiles, the ratio of medians to the first arm's, and the median and
    quartiles of the paired ratios (entry k of an arm over entry k of the first: same round, same
    iteration, so a slow spell of the machine cancels)."""
    first = arms[0]
    print(f"\n{'arm':<12} {'median':>10} {'q1':>9} {'q3':>9} {'n':>4} {'x ' + first:>9}   "
          f"{'paired x':>9} {'q1':>7} {'q3':>7}   ({what})")
    ref = statistics.median(times[first])
    for arm in arms:
        q1, med, q3 = _quartiles(times[arm])
        p1, pmed, p3 = _quartiles([a / b for a, b in zip(times[arm], times[first])])
        print(f"{arm:<12} {med:9.3f}s {q1:8.3f}s {q3:8.3f}s {len(times[arm]):>4} {med / ref:9.4f}   "
              f"{pmed:9.4f} {p1:7.4f} {p3:7.4f}")


def update_main(args) -> None:
    bench = UpdateBench(args)
    print(f"model: qwen2 {args.tiny_config}, {bench.params / 1e6:.1f}M parameters; batch: {bench.rows} rows, "
          f"{bench.tokens} tokens, {len(bench.sizes)} optimizer steps of {bench.sizes[0]} rows; "
          f"{args.warmup} warm-up + {args.reps} timed rounds, arms alternating")
    wall, cpu = {a: [] for a in args.arms}, {a: [] for a in args.arms}
    for r in range(args.warmup + args.reps):
        k = r % len(args.arms)
        for arm in args.arms[k:] + args.arms[:k]:
            w, c = bench.timed(arm)
            if r >= args.warmup:
                wall[arm].append(w)
                cpu[arm].append(c)
    _table(args.arms, wall, "wall s per iteration's update")
    _table(args.arms, cpu, "CPU s per iteration's update: the work, less sensitive to a loaded machine")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "wall_s": wall, "cpu_s": cpu}, indent=1, default=str))
    bench.process.__exit__(None, None, None)


def _iteration_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("iteration", -1) >= 0]


def iteration_main(args) -> None:
    from megatron_alp.resolve import load_config
    from megatron_alp.trainer.base_model import make_base_model

    base = args.out / "base_model"
    if not (base / "config.json").is_file():
        cfg = load_config(args.config, [f"trainer.output_dir={args.out}", "perturbation.enabled=null",
                                        *args.overrides])
        make_base_model(cfg, base)
    print(f"{args.config.name}: arms {' '.join(args.arms)}, {args.rounds} rounds x {args.iterations} iterations "
          f"(the first of each run not timed), arm order rotating; base model {base}")
    rows = {a: [] for a in args.arms}
    for r in range(args.rounds):
        k = r % len(args.arms)
        for arm in args.arms[k:] + args.arms[:k]:
            run_dir = args.out / f"{arm}-round{r}"
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)
            train(args.config, run_dir, ["model.tiny=null", f"model.hf_path={base}", "trainer.sft_warmup_steps=0",
                                         f"loss.name={arm}", f"trainer.iterations={args.iterations}", *RUN_KEYS,
                                         *args.overrides])
            got = _iteration_rows(run_dir)[1:]
            rows[arm] += got
            print(f"round {r} {arm:<10} " + " ".join(f"{x['timing/total_s']:.2f}" for x in got), flush=True)
    iteration_report(args.arms, rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "iterations": rows}, indent=1, default=str))


def iteration_report(arms: list[str], rows: dict[str, list[dict]]) -> None:
    """The side-by-side tables of ``rows``: per arm, the metrics records of its timed iterations."""

    def phase(arm, name):
        return [x.get(f"timing/{name}_s", 0.0) for x in rows[arm]]

    def trainer_s(arm):
        return [sum(x.get(f"timing/{p}_s", 0.0) for p in TRAINER_PHASES) for x in rows[arm]]

    first = arms[0]
    _table(arms, {a: phase(a, "total") for a in arms}, "s per iteration")
    _table(arms, {a: trainer_s(a) for a in arms}, f"trainer phases: {' + '.join(TRAINER_PHASES)}")
    print(f"\nmedian seconds per phase\n{'phase':<12}" + "".join(f"{a:>12}" for a in arms)
          + "".join(f"{a + ' - ' + first:>22}" for a in arms[1:]))
    for name in PHASES:
        med = {a: statistics.median(phase(a, name)) for a in arms}
        print(f"{name:<12}" + "".join(f"{med[a]:12.3f}" for a in arms)
              + "".join(f"{med[a] - med[first]:+22.3f}" for a in arms[1:]))
    # The old-policy and reference passes are the same unperturbed work in every arm, seconds before the
    # update: the update's time in units of theirs cancels most of a loaded machine's slowdown.
    units = {a: [u / max(o + f, 1e-9) for u, o, f in zip(phase(a, "update"), phase(a, "old_logprob"),
                                                          phase(a, "ref_logprob"))] for a in arms}
    share = statistics.median(u / t for u, t in zip(phase(first, "update"), phase(first, "total")))
    print(f"\nupdate / (old_logprob + ref_logprob), per iteration (the same unperturbed passes in every arm); "
          f"the update is {share:.1%} of {first}'s iteration")
    for arm in arms:
        q1, med, q3 = _quartiles(units[arm])
        extra = med / statistics.median(units[first]) - 1
        print(f"{arm:<12} median {med:.4f} (q1 {q1:.4f}, q3 {q3:.4f}): update {extra:+.2%} vs {first}, "
              f"iteration {extra * share:+.2%}")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def rss_child(args) -> None:
    bench = Bench(args)
    for _ in range(2):
        bench.step(args.rss_child)
    bench.model.zero_grad(set_to_none=True)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    base = _status_kib("VmRSS")
    bench.step(args.rss_child)
    print(json.dumps({"rss_increase_bytes": _status_kib("VmHWM") - base}))


def cpu_peak_rss(variant: str, argv: list[str]) -> dict | None:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT)}
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, __file__, *argv, "--rss-child", variant], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        print(f"peak RSS of {variant} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _mib(n) -> str:
    return f"{n / 2**20:10.2f} MiB"


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.mode == "update":
        return update_main(args)
    if args.mode == "iteration":
        return iteration_main(args)
    if args.overrides:
        raise SystemExit(f"--mode step takes no config overrides (got {' '.join(args.overrides)})")
    if args.rss_child:
        return rss_child(args)
    bench = Bench(args)
    torch = bench.torch
    print(f"model: Qwen3-layout GPT, hidden {args.hidden}, {args.layers} layers, {bench.params / 1e6:.1f}M parameters, "
          f"{args.dtype} on {bench.device}, spec {args.spec}, {torch.get_num_threads()} CPU threads")
    print(f"batch: {args.batch} x {args.seq} tokens; ALP on {bench.sites} sites, sigma {args.shape}; "
          f"{args.warmup} warm-up + {args.reps} timed rounds, variants alternating")

    times = {v: [] for v in VARIANTS}
    for r in range(args.warmup + args.reps):
        order = VARIANTS[r % 3:] + VARIANTS[: r % 3]
        for v in order:
            t = bench.timed(v)
            if r >= args.warmup:
                times[v].append(t)
    saved = {v: bench.saved_bytes(v) for v in VARIANTS}
    peaks = {}
    if bench.device.type == "cuda":
        peaks = {v: bench.cuda_peak(v) for v in VARIANTS}
    elif not args.no_rss:
        peaks = {v: cpu_peak_rss(v, argv) for v in VARIANTS}
    redraw = bench.redraw_seconds(args.reps) * bench.sites
    site = {v: bench.site_seconds(v, max(args.reps, 20)) * bench.sites for v in VARIANTS[1:]}

    base_med, base_best = statistics.median(times["unperturbed"]), min(times["unperturbed"])
    print()
    print(f"{'variant':<15} {'median':>10} {'best':>10} {'x median':>9} {'x best':>8}   "
          f"{'saved for backward':>18} {'x':>7}")
    for v in VARIANTS:
        med, best = statistics.median(times[v]), min(times[v])
        print(f"{v:<15} {med * 1e3:8.2f}ms {best * 1e3:8.2f}ms {med / base_med:9.4f} {best / base_best:8.4f}   "
              f"{_mib(saved[v]):>18} {saved[v] / saved['unperturbed']:7.4f}")
    if peaks:
        print()
        if bench.device.type == "cuda":
            print(f"{'variant':<15} {'peak allocated':>16} {'x':>7}   {'step increase':>16} {'x':>7}")
            for v in VARIANTS:
                peak, inc = peaks[v]["peak_bytes"], peaks[v]["step_increase_bytes"]
                peak0, inc0 = peaks["unperturbed"]["peak_bytes"], peaks["unperturbed"]["step_increase_bytes"]
                print(f"{v:<15} {_mib(peak):>16} {peak / peak0:7.4f}   {_mib(inc):>16} {inc / inc0:7.4f}")
        elif all(peaks.values()):
            print(f"{'variant':<15} {'peak RSS increase of a step':>28} {'x':>7}")
            for v in VARIANTS:
                n, n0 = peaks[v]["rss_increase_bytes"], peaks["unperturbed"]["rss_increase_bytes"]
                print(f"{v:<15} {_mib(n):>28} {n / n0:7.4f}")
    regen_minus_saved = statistics.median(times["alp-regen-eps"]) - statistics.median(times["alp-saved-eps"])
    print()
    print(f"eps redraw: randn of {list(bench.act_shape)} float32 x {bench.sites} sites = {redraw * 1e3:.2f} ms "
          f"({redraw / base_med * 100:.2f}% of the unperturbed median); measured regen - saved median: "
          f"{regen_minus_saved * 1e3:+.2f} ms")
    print(f"ALP sites alone (forward + backward of {bench.sites} sites on {list(bench.act_shape)}): saved-eps "
          f"{site['alp-saved-eps'] * 1e3:.2f} ms, regen-eps {site['alp-regen-eps'] * 1e3:.2f} ms "
          f"({(site['alp-regen-eps'] - site['alp-saved-eps']) / base_med * 100:+.2f}% of the unperturbed median)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "args": vars(args), "times_s": times, "saved_bytes": saved, "peaks": peaks, "redraw_s": redraw,
            "sites_fwd_bwd_s": site,
        }, indent=1))


if __name__ == "__main__":
    main()
