"""The batch sources (megatron_alp/batches/sources.py) driven in seconds, without a model.

The sources are the real ones, over the real PromptSampler, Scorer, share_work and fill_batch, with
configs from the real loader. Only the engine is the test's: :class:`ScriptedEngine` answers each
prompt by a rule of this file (so rewards are known in advance) and writes into every response which
of its calls generated it. Most tests give the sources a :class:`ScriptedRollout`, the surface of
DistributedRollout they use (version, rank, generate, submit, collect, fetch_routing, broadcast)
over that engine, which also lets a test say which weight version generated each group of a
submitted batch. Two tests run AheadByK on the real DistributedRollout and its background
RolloutProducer, the engine registered for it as any engine is.

Every expected value (prompts, seeds, versions, stale groups, sampler states) is derived here: from a
reference PromptSampler of the same seed, from derive_seed, and from the answer rule.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path

import pytest

from megatron_alp.batches.scoring import Scorer
from megatron_alp.batches.sources import AheadByK, DynamicSampling, OnPolicy, build_batch_source
from megatron_alp.data.prompts import Prompt, PromptDataset, PromptSampler
from megatron_alp.resolve import load_config
from megatron_alp.rewards import RewardFn
from megatron_alp.rollout.base import ENGINES, Completion, RolloutEngine, register_engine
from megatron_alp.rollout.distributed import Batch, generate_work
from megatron_alp.sync import AdapterWeights, WeightSync
from megatron_alp.runtime.seeding import derive_seed

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart_cpu.yaml"
N = 4  # rollout.sampling.n
PROMPTS = 3  # trainer.prompts_per_iteration
ITERATIONS = 6
FIRST_ID = 1000  # prompt p's token ids are [FIRST_ID + p, 5, 6]

# What the engine answers to prompt p (the pattern repeats): "mixed" gets one right answer of n,
# "partial" one half-credit answer and no right one, "right" all right, "wrong" none.
KINDS = ("right", "mixed", "wrong", "partial", "mixed", "right", "mixed")


def kind(p: int) -> str:
    return KINDS[p % len(KINDS)]


def answer(p: int, j: int) -> str:
    k = kind(p)
    if k == "right" or (k == "mixed" and j == 0):
        return str(p)
    if k == "partial" and j == 0:
        return f"~{p}"
    return "nope"


def expected_rewards(p: int) -> list[float]:
    return [1.0 if answer(p, j) == str(p) else 0.5 if answer(p, j) == f"~{p}" else 0.0 for j in range(N)]


def response_length(p: int) -> int:
    return 3 + p % 3


def passes(p: int, by: str) -> bool:
    """Whether prompt p's group passes dynamic sampling's filter ``by``, from the answer rule."""
    if by == "correct":
        return kind(p) == "mixed"
    return kind(p) in ("mixed", "partial")


def index(prompt: Prompt) -> int:
    return prompt.prompt_ids[0] - FIRST_ID


def indices(prompts) -> list[int]:
    return [index(p) for p in prompts]


# ---------------------------------------------------------------------------- the test's side


class ScriptedEngine(RolloutEngine):
    """An engine answering by :func:`answer`; response tokens are ``[call, key, sample]`` then padding
    (``response_length(p)`` tokens in all), so a test can tell which call generated a trajectory."""

    def __init__(self, cfg=None, model_dir=None, seed=0, placement=None, delay: float = 0.0):
        self.delay = delay
        self.calls: list[tuple[list[int], object, list[int]]] = []  # (prompt indices, params, keys)
        self.updates = 0
        self.closed = False

    def generate(self, prompts, params, keys=None):
        keys = list(range(len(prompts))) if keys is None else list(keys)
        call = len(self.calls)
        self.calls.append(([ids[0] - FIRST_ID for ids in prompts], params, keys))
        time.sleep(self.delay)
        groups = []
        for ids, key in zip(prompts, keys):
            p = ids[0] - FIRST_ID
            groups.append([Completion(list(ids), [call, key, j] + [0] * (response_length(p) - 3),
                                      [-0.5] * response_length(p), "stop", text=answer(p, j))
                           for j in range(params.n)])
        return groups

    def update_weights(self, weights):
        for _ in weights:
            pass
        self.updates += 1

    def update_adapter(self, tensors, config):
        for _ in tensors:
            pass
        self.updates += 1

    def shutdown(self):
        self.closed = True


class ScriptedRollout:
    """DistributedRollout's surface as the sources use it, one replica in process over a
    :class:`ScriptedEngine`. ``version`` is the weight version the engine holds; a submitted batch is
    generated at once (as an idle background producer would), each group by ``version`` unless the
    test listed other versions for that iteration's batch in ``generated_by`` (per-sample seed ->
    one version per group; used for the first submission with that seed only)."""

    rank = 0

    def __init__(self, engine: ScriptedEngine, version: int = 0, seconds: float = 0.25):
        self.engine, self.version, self.seconds = engine, version, seconds
        self.generated: list[tuple[list[int], object]] = []  # generate calls: (prompt indices, params)
        self.submitted: list[tuple[list[int], object]] = []  # submit calls: (prompt indices, params)
        self.wanted: list = []  # the weight version each submit call named (None: any)
        self.cuts: list = []  # and its fixed cut (None: none)
        self.collected: list[Batch] = []
        self.fetched: list = []  # the items of each fetch_routing call
        self.generated_by: dict[int, list[int]] = {}

    def broadcast(self, obj):
        return obj

    def generate(self, prompts, params):
        self.generated.append(([ids[0] - FIRST_ID for ids in prompts], params))
        return self.engine.generate(prompts, params)

    def submit(self, prompts, params, work=None, version=None, cut=None):
        self.submitted.append(([ids[0] - FIRST_ID for ids in prompts], params))
        self.wanted.append(version)
        self.cuts.append(cut)
        batch = Batch(prompts, params, work or generate_work(params), [list(range(len(prompts)))])
        made_by = self.version if version is None else version  # a producer waits for the version named
        versions = self.generated_by.pop(params.seed, [made_by] * len(prompts))
        assert len(versions) == len(prompts)
        batch.future = Future()
        batch.future.set_result((list(versions), batch.work(self.engine, prompts, list(range(len(prompts))))))
        return batch

    def collect(self, batch: Batch) -> Batch:
        assert all(batch is not b for b in self.collected), "a batch was collected twice"
        batch.versions, batch.results = batch.future.result()
        batch.seconds = self.seconds
        self.collected.append(batch)
        return batch

    def fetch_routing(self, items):
        self.fetched.append(list(items))


class ExactAnswer(RewardFn):
    """1.0 for the ground truth, 0.5 for ``~truth`` (partial credit: not correct), else 0.0."""

    def __init__(self, delay: float = 0.0):
        self.delay = delay

    def __call__(self, responses, ground_truths):
        time.sleep(self.delay)
        return [1.0 if r == t else 0.5 if r == f"~{t}" else 0.0 for r, t in zip(responses, ground_truths)]


def config(*overrides: str, staleness: int = 0, iterations: int = ITERATIONS):
    base = [f"trainer.iterations={iterations}", f"trainer.prompts_per_iteration={PROMPTS}",
            f"rollout.sampling.n={N}", "rollout.sampling.per_sample_seeds=true"]
    if staleness:
        base += ["rollout.placement=separate", f"trainer.max_staleness={staleness}"]
    return load_config(QUICKSTART, base + list(overrides))


def dataset(size: int) -> PromptDataset:
    return PromptDataset([Prompt([FIRST_ID + p, 5, 6], str(p), [{"role": "user", "content": f"q{p}"}], f"test:{p}")
                          for p in range(size)])


def sampler(cfg, size: int = 11) -> PromptSampler:
    return PromptSampler(dataset(size), seed=cfg.data.seed, shuffle=cfg.data.shuffle)


def seed(cfg, *keys: int) -> int:
    return derive_seed(cfg.trainer.seed, *keys)


def draws(cfg, count: int, size: int = 11) -> tuple[list[list[int]], list[dict]]:
    """A reference sampler's first ``count`` batches (prompt indices) and its state before each of
    them and after the last (``count + 1`` states)."""
    ref = sampler(cfg, size)
    batches, states = [], [ref.state_dict()]
    for _ in range(count):
        batches.append(indices(ref.next_batch(PROMPTS)))
        states.append(ref.state_dict())
    return batches, states


def check_groups(groups, prompts: list[int], versions: list[int]) -> None:
    """``groups`` holds ``prompts`` in order, n trajectories each, rewards and correctness by the
    answer rule, and group g's trajectories stamped with ``versions[g]``."""
    assert indices(groups.prompts) == prompts
    assert len(groups.trajectories) == N * len(prompts)
    for g, p in enumerate(prompts):
        group = groups.trajectories[g * N:(g + 1) * N]
        assert [t.prompt_ids[0] - FIRST_ID for t in group] == [p] * N
        assert [t.response_text for t in group] == [answer(p, j) for j in range(N)]
        assert [t.policy_version for t in group] == [versions[g]] * N
        assert groups.rewards[g * N:(g + 1) * N].tolist() == expected_rewards(p)
        assert groups.correct[g * N:(g + 1) * N].tolist() == [r == 1.0 for r in expected_rewards(p)]


def tokens(prompts: list[int]) -> float:
    return float(N * sum(response_length(p) for p in prompts))


def ahead(cfg, rollout, s):
    return AheadByK(cfg, rollout, s, Scorer(cfg, ExactAnswer()), tokenizer=None)


# ----------------------------------------------------------------------------------- on-policy


def test_on_policy_draws_generates_now_and_tallies():
    cfg = config()
    engine = ScriptedEngine(delay=0.05)
    rollout = ScriptedRollout(engine, version=3)
    s = sampler(cfg)
    source = OnPolicy(cfg, rollout, s, Scorer(cfg, ExactAnswer(delay=0.03)), tokenizer=None)
    batches, _ = draws(cfg, 2)

    stats = {"timing/rollout_s": 100.0, "timing/reward_s": 10.0, "rollout/response_tokens": 7.0}
    groups = source.next_batch(5, stats)
    check_groups(groups, batches[0], [3] * PROMPTS)
    assert rollout.submitted == [] and len(rollout.generated) == 1
    prompts, params = rollout.generated[0]
    assert prompts == batches[0]
    assert params.seed == seed(cfg, 5) and params.seed != seed(cfg, 4)
    assert (params.n, params.temperature, params.max_tokens) == (N, cfg.rollout.sampling.temperature,
                                                                 cfg.rollout.sampling.max_response_length)
    # added to what the stats held: generation (the engine sleeps 0.05 s) and scoring (0.03 s) apart
    assert stats["timing/rollout_s"] >= 100.05
    assert stats["timing/reward_s"] >= 10.03
    assert stats["rollout/response_tokens"] == 7.0 + tokens(batches[0])

    rollout.version = 4
    check_groups(source.next_batch(6, stats), batches[1], [4] * PROMPTS)
    assert rollout.generated[1][0] == batches[1] and rollout.generated[1][1].seed == seed(cfg, 6)
    assert stats["rollout/response_tokens"] == 7.0 + tokens(batches[0]) + tokens(batches[1])


def test_on_policy_resume_state_is_the_samplers_state_and_draws_the_same_prompts_again():
    cfg = config()
    s = sampler(cfg)
    source = OnPolicy(cfg, ScriptedRollout(ScriptedEngine()), s, Scorer(cfg, ExactAnswer()), tokenizer=None)
    batches, states = draws(cfg, ITERATIONS)
    assert source.resume_state() == states[0]
    for i in range(ITERATIONS - 1):
        source.next_batch(i, {})
        state = source.resume_state()
        assert state == s.state_dict() == states[i + 1]
        restored = sampler(cfg)
        restored.load_state_dict(state)
        assert indices(restored.next_batch(PROMPTS)) == batches[i + 1]  # what the next iteration draws
    assert states[-1]["epoch"] >= 1  # the draws crossed an epoch boundary


# ----------------------------------------------------------------------------------- ahead by k


@pytest.mark.parametrize("k", [1, 2, 3])
def test_ahead_by_k_queues_the_next_k_batches_once_each_up_to_the_last_iteration(k):
    cfg = config(staleness=k)
    rollout = ScriptedRollout(ScriptedEngine())
    source = ahead(cfg, rollout, sampler(cfg))
    batches, _ = draws(cfg, ITERATIONS)
    iteration_of = {seed(cfg, i): i for i in range(ITERATIONS)}
    for i in range(ITERATIONS):
        rollout.version = i  # the trainer synced the weights of i updates
        stats = {}
        groups = source.next_batch(i, stats)
        queued = [iteration_of[params.seed] for _, params in rollout.submitted]
        assert queued == list(range(min(i + k, ITERATIONS - 1) + 1)), f"iteration {i}"
        assert [prompts for prompts, _ in rollout.submitted] == batches[:len(queued)]
        assert rollout.generated == []  # nothing generated on-policy
        # batch i was submitted at iteration max(0, i - k), when the engine held that version
        check_groups(groups, batches[i], [max(0, i - k)] * PROMPTS)
        assert stats["staleness/regenerated_groups"] == 0.0
        assert stats["timing/rollout_s"] == rollout.seconds
        assert stats["rollout/response_tokens"] == tokens(batches[i])
        assert "timing/reward_s" in stats and "timing/rollout_wait_s" in stats
    assert len(rollout.collected) == ITERATIONS


@pytest.mark.parametrize("k", [1, 2])
def test_groups_more_than_k_versions_old_are_generated_again_with_the_current_weights(k):
    cfg = config(staleness=k)
    engine = ScriptedEngine()
    rollout = ScriptedRollout(engine)
    source = ahead(cfg, rollout, sampler(cfg))
    batches, _ = draws(cfg, ITERATIONS)
    target = k + 1  # its batch is submitted at iteration 1
    # groups 0 and 2 of the target batch were generated by version 0 (k + 1 old when it trains),
    # group 1 by version 1 (exactly k old: kept)
    rollout.generated_by[seed(cfg, target)] = [target - k - 1, target - k, target - k - 1]
    stale = [0, 2]
    for i in range(target):
        rollout.version = i
        source.next_batch(i, {})
    calls = len(engine.calls)
    first_call = next(c for c, (prompts, _, _) in enumerate(engine.calls) if prompts == batches[target])

    rollout.version = target
    stats = {}
    groups = source.next_batch(target, stats)
    assert stats["staleness/regenerated_groups"] == float(len(stale))
    check_groups(groups, batches[target], [target, target - k, target])
    # the stale groups went back to the engine once, with this iteration's seed, in one more submission
    regenerated = [(prompts, params.seed) for prompts, params in rollout.submitted[-1:]]
    assert regenerated == [([batches[target][g] for g in stale], seed(cfg, target))]
    new_calls = engine.calls[calls:]
    # batch target + k was queued first (target + k < ITERATIONS), then the stale groups went again
    assert [prompts for prompts, _, _ in new_calls] == [batches[target + k], [batches[target][g] for g in stale]]
    regen_call = calls + len(new_calls) - 1
    made_by = [groups.trajectories[g * N].response_ids[0] for g in range(PROMPTS)]
    assert made_by == [regen_call, first_call, regen_call]
    assert stats["rollout/response_tokens"] == tokens(batches[target])
    assert stats["timing/rollout_s"] == pytest.approx(2 * rollout.seconds)  # the batch, then its stale groups

    rollout.version = target + 1  # the next batch (submitted at target + 1 - k) is exactly k old
    stats = {}
    check_groups(source.next_batch(target + 1, stats), batches[target + 1], [target + 1 - k] * PROMPTS)
    assert stats["staleness/regenerated_groups"] == 0.0


def test_ahead_by_k_resume_state_is_before_the_oldest_batch_not_yet_trained_on():
    k = 2
    cfg = config(staleness=k)
    s = sampler(cfg)
    rollout = ScriptedRollout(ScriptedEngine())
    source = ahead(cfg, rollout, s)
    batches, states = draws(cfg, ITERATIONS)
    assert source.resume_state() == states[0]
    trained, resumed_at, saved = [], 1, None
    for i in range(ITERATIONS):
        rollout.version = i
        trained.append(indices(source.next_batch(i, {}).prompts))
        if i == resumed_at:
            saved = source.resume_state()  # what a checkpoint after iteration 1 holds
        # batches i+1 .. i+k are generating: a resume draws them again, from the state before i+1
        assert source.resume_state() == states[i + 1], f"iteration {i}"
        if i < ITERATIONS - 1:
            assert s.state_dict() == states[min(i + k, ITERATIONS - 1) + 1]
    assert s.state_dict() == states[ITERATIONS]  # nothing pending after the last iteration

    # a run resumed after iteration 1 trains on the batches the first run trained on next
    s2 = sampler(cfg)
    s2.load_state_dict(saved)
    rollout2 = ScriptedRollout(ScriptedEngine())
    source2 = ahead(cfg, rollout2, s2)
    for i in range(resumed_at + 1, ITERATIONS):
        rollout2.version = i
        assert indices(source2.next_batch(i, {}).prompts) == trained[i] == batches[i]
    assert [params.seed for _, params in rollout2.submitted] == [seed(cfg, i) for i in range(resumed_at + 1,
                                                                                             ITERATIONS)]


def test_ahead_by_k_on_the_distributed_rollout_and_its_background_producer():
    """AheadByK (``trainer.async_schedule: free``) on the real DistributedRollout (background=True:
    one RolloutProducer thread), the test's engine registered as any engine is; weight versions move
    by the rollout's own sync (an adapter sync: a stream the engine takes, no model needed)."""
    name = "scripted-test-engine"
    register_engine(name)(type("RegisteredScriptedEngine", (ScriptedEngine,), {}))
    rollout = None
    try:
        from megatron_alp.rollout.distributed import DistributedRollout

        k = 1
        cfg = config(f"rollout.engine={name}", "trainer.async_schedule=free", staleness=k, iterations=4)
        rollout = DistributedRollout(cfg.rollout, "unused-model-dir", seed=0, version=0, background=True)
        assert rollout.producer is not None
        engine = rollout.engine
        source = ahead(cfg, rollout, sampler(cfg))
        batches, _ = draws(cfg, 4)
        weights = WeightSync(rollout, AdapterWeights(lambda model, leaders: {}, {}))

        def sync(version):
            weights.sync(None, version=version)

        def wait_for_calls(count):
            deadline = time.time() + 10
            while len(engine.calls) < count and time.time() < deadline:
                time.sleep(0.01)
            return len(engine.calls)

        check_groups(source.next_batch(0, {}), batches[0], [0] * PROMPTS)
        # batch 1 generates in the background while iteration 0 trains, with version 0
        assert wait_for_calls(2) == 2 and engine.calls[1][0] == batches[1]
        assert engine.calls[1][1].seed == seed(cfg, 1)
        sync(1)
        stats = {}
        check_groups(source.next_batch(1, stats), batches[1], [0] * PROMPTS)  # exactly k old: kept
        assert stats["staleness/regenerated_groups"] == 0.0
        assert wait_for_calls(3) == 3  # batch 2, by version 1
        # no sync after iteration 1 (the engine lags): batch 3, queued at iteration 2, is generated by version 1
        stats = {}
        check_groups(source.next_batch(2, stats), batches[2], [1] * PROMPTS)
        assert stats["staleness/regenerated_groups"] == 0.0
        assert wait_for_calls(4) == 4
        sync(3)  # batch 3 is now 2 > k versions old: all its groups are generated again, by version 3
        stats = {}
        check_groups(source.next_batch(3, stats), batches[3], [3] * PROMPTS)
        assert stats["staleness/regenerated_groups"] == float(PROMPTS)
        assert len(engine.calls) == 5 and engine.calls[-1][0] == batches[3]
        assert engine.calls[-1][1].seed == seed(cfg, 3)
        assert engine.updates == 2
    finally:
        if rollout is not None:
            rollout.shutdown()
        ENGINES.pop(name, None)
    assert engine.closed


@pytest.mark.parametrize("k", [1, 2])
def test_a_checkpoint_holds_the_batches_generated_ahead_and_a_resume_trains_on_them(k, tmp_path):
    """state_dict after iteration r carries batches r+1 .. r+k as generated (groups, versions, their
    sampler states), through torch.save; a source loaded from it trains on exactly those groups
    without generating them again, then draws and generates on as the uninterrupted source does."""
    import torch

    cfg = config(staleness=k)
    rollout = ScriptedRollout(ScriptedEngine())
    source = ahead(cfg, rollout, sampler(cfg))
    batches, states = draws(cfg, ITERATIONS)
    r = 1
    for i in range(r + 1):
        rollout.version = i
        source.next_batch(i, {})
    rollout.version = r + 1  # the sync after iteration r
    state = source.state_dict()
    held = list(range(r + 1, r + k + 1))
    assert state["sampler"] == states[r + 1]  # where a source that cannot take them draws again
    assert state["ahead_groups"] == k * PROMPTS
    assert state["ahead_versions"] == sorted({max(0, j - k) for j in held})
    assert [b["iteration"] for b in state["ahead"]["batches"]] == held
    assert state["ahead"]["sampler"] == states[r + k + 1]
    saved = [t for b in state["ahead"]["batches"] for g in b["results"] for t in g]
    assert rollout.fetched[-1] == saved  # rank 0 brings the routing of what it writes
    assert not any(t is u for t in saved for b in rollout.collected for g in b.results for u in g)  # copies
    torch.save(state, tmp_path / "extra.pt")
    state = torch.load(tmp_path / "extra.pt", weights_only=False)

    resumed_rollout = ScriptedRollout(ScriptedEngine(), version=r + 1)
    resumed = ahead(cfg, resumed_rollout, sampler(cfg))
    resumed.load_state_dict(state)
    for i in range(r + 1, ITERATIONS):
        rollout.version = resumed_rollout.version = i
        stats = {}
        a, b = source.next_batch(i, {}), resumed.next_batch(i, stats)
        assert indices(a.prompts) == indices(b.prompts) == batches[i]
        assert [t.policy_version for t in a.trajectories] == [t.policy_version for t in b.trajectories]
        check_groups(b, batches[i], [max(0, i - k)] * PROMPTS)
        if i in held:  # the very groups the first run generated, not generated again
            assert [t.response_ids for t in a.trajectories] == [t.response_ids for t in b.trajectories]
            assert stats["timing/rollout_s"] == rollout.seconds and stats["rollout/response_tokens"] == tokens(batches[i])
        assert resumed.resume_state() == source.resume_state()
    # the resumed run generated only the batches after those held ahead, each by the version it names
    assert [prompts for prompts, _ in resumed_rollout.submitted] == batches[r + k + 1:]
    assert resumed_rollout.wanted == [j - k for j in range(r + k + 1, ITERATIONS)]


@pytest.mark.parametrize("schedule", ["deterministic", "free"])
def test_partial_rollouts_cut_a_batch_at_a_fixed_point_when_the_next_one_needs_newer_weights(schedule):
    """Under the deterministic schedule batch i needs the weights of max(0, i - k); batches 0 .. k - 1
    share version 0 with the batch after them and run whole, every later one is cut at
    rollout.partial_cut_tokens (default: half the response budget) so its successor's version can
    come. The free schedule names neither."""
    k = 2
    cfg = config("rollout.partial_rollout=true", f"trainer.async_schedule={schedule}", staleness=k)
    rollout = ScriptedRollout(ScriptedEngine())
    source = ahead(cfg, rollout, sampler(cfg))
    for i in range(ITERATIONS):
        rollout.version = i
        source.next_batch(i, {})
    half = cfg.rollout.sampling.max_response_length // 2
    if schedule == "free":
        assert rollout.wanted == rollout.cuts == [None] * ITERATIONS
    else:
        assert rollout.wanted == [max(0, i - k) for i in range(ITERATIONS)]
        assert rollout.cuts == [None] * k + [half] * (ITERATIONS - k)
    cfg = config("rollout.partial_rollout=true", "rollout.partial_cut_tokens=5", staleness=k)
    rollout = ScriptedRollout(ScriptedEngine())
    ahead(cfg, rollout, sampler(cfg)).next_batch(0, {})
    assert rollout.cuts == [None, None, 5]


@pytest.mark.parametrize("engine_delay,train_delay", [(0.15, 0.0), (0.0, 0.15)])
def test_the_deterministic_schedule_generates_batch_i_by_version_i_minus_k_whatever_the_timing(engine_delay,
                                                                                               train_delay):
    """``trainer.async_schedule: deterministic`` on the real DistributedRollout and its producer: with
    the engine slower than the trainer, and the other way round, batch i is generated by the weights
    of iteration max(0, i - k): a sync waits for the generation that still needs the old weights, and
    the engine waits for the weights a batch names."""
    name = "scripted-timing-engine"
    register_engine(name)(type("TimedScriptedEngine", (ScriptedEngine,), {"__init__": (
        lambda self, *a, **kw: ScriptedEngine.__init__(self, delay=engine_delay))}))
    rollout = None
    try:
        from megatron_alp.rollout.distributed import DistributedRollout

        k, iterations = 2, 5
        cfg = config(f"rollout.engine={name}", staleness=k, iterations=iterations)
        rollout = DistributedRollout(cfg.rollout, "unused-model-dir", seed=0, version=0, background=True)
        source = ahead(cfg, rollout, sampler(cfg))
        weights = WeightSync(rollout, AdapterWeights(lambda model, leaders: {}, {}))
        batches, _ = draws(cfg, iterations)
        for i in range(iterations):
            check_groups(source.next_batch(i, {}), batches[i], [max(0, i - k)] * PROMPTS)
            time.sleep(train_delay)  # the update
            weights.sync(None, version=i + 1)
        engine = rollout.engine
        assert [prompts for prompts, _, _ in engine.calls] == batches
    finally:
        if rollout is not None:
            rollout.shutdown()
        ENGINES.pop(name, None)


# ------------------------------------------------------------------------------ dynamic sampling


def first_passing(order: list[int], wanted: int, by: str) -> list[int]:
    return [p for p in order if passes(p, by)][:wanted]


@pytest.mark.parametrize("by", ["correct", "reward"])
def test_dynamic_sampling_adds_on_policy_rounds_until_enough_groups_pass(by):
    cfg = config("trainer.dynamic_sampling=true", f"trainer.dynamic_sampling_filter={by}", "data.shuffle=false")
    rollout = ScriptedRollout(ScriptedEngine(), version=2)
    s = sampler(cfg, size=40)
    source = build_batch_source(cfg, rollout, s, Scorer(cfg, ExactAnswer()), tokenizer=None)
    assert isinstance(source, DynamicSampling)
    stats = {}
    groups = source.next_batch(7, stats)

    # every round drew the sampler's next prompts: round 0 with (seed, 7), round r with (seed, 7, r)
    drawn = [p for prompts, _ in rollout.generated for p in prompts]
    assert drawn == list(range(len(drawn)))
    assert [params.seed for _, params in rollout.generated] == \
        [seed(cfg, 7)] + [seed(cfg, 7, r) for r in range(1, len(rollout.generated))]
    assert len(rollout.generated[0][0]) == PROMPTS
    # rounds went on while fewer than prompts_per_iteration groups passed, and no longer
    before_last = drawn[:len(drawn) - len(rollout.generated[-1][0])]
    assert sum(passes(p, by) for p in before_last) < PROMPTS <= sum(passes(p, by) for p in drawn)
    assert len(rollout.generated) > 1  # round 0 (prompts 0, 1, 2) holds one passing group under either filter
    assert rollout.submitted == []
    expected = first_passing(drawn, PROMPTS, by)
    check_groups(groups, expected, [2] * PROMPTS)
    assert stats["dynamic_sampling/rounds"] == float(len(rollout.generated) - 1)
    assert stats["dynamic_sampling/generated_groups"] == float(len(drawn))
    assert stats["dynamic_sampling/filled_groups"] == 0.0
    assert stats["rollout/response_tokens"] == tokens(drawn)
    assert source.resume_state() == s.state_dict()
    # the filters differ on "partial" groups: kept only by `reward`
    assert any(kind(p) == "partial" for p in expected) == (by == "reward")


@pytest.mark.parametrize("max_rounds", [0, 2])
def test_dynamic_sampling_stops_at_max_rounds_and_fills_with_dropped_groups(max_rounds):
    cfg = config("trainer.dynamic_sampling=true", f"trainer.dynamic_sampling_max_rounds={max_rounds}",
                 "data.shuffle=false")
    rollout = ScriptedRollout(ScriptedEngine())
    # a data set of prompts nobody gets partly right: 0 ("right") and 2 ("wrong") of the pattern
    data = PromptDataset([p for p in dataset(40).prompts if kind(index(p)) in ("right", "wrong")])
    s = PromptSampler(data, seed=cfg.data.seed, shuffle=False)
    source = build_batch_source(cfg, rollout, s, Scorer(cfg, ExactAnswer()), tokenizer=None)
    stats = {}
    groups = source.next_batch(0, stats)
    assert len(rollout.generated) == 1 + max_rounds
    assert [params.seed for _, params in rollout.generated[1:]] == [seed(cfg, 0, r) for r in range(1, max_rounds + 1)]
    first = indices(data.prompts[:PROMPTS])
    check_groups(groups, first, [0] * PROMPTS)  # the earliest dropped groups complete the batch
    assert stats["dynamic_sampling/rounds"] == float(max_rounds)
    assert stats["dynamic_sampling/filled_groups"] == float(PROMPTS)
    assert stats["dynamic_sampling/kept_frac"] == 0.0


def test_dynamic_sampling_around_ahead_by_k():
    k = 1
    cfg = config("trainer.dynamic_sampling=true", "data.shuffle=false", staleness=k)
    rollout = ScriptedRollout(ScriptedEngine())
    s = sampler(cfg, size=40)
    source = build_batch_source(cfg, rollout, s, Scorer(cfg, ExactAnswer()), tokenizer=None)
    stats = {}
    groups = source.next_batch(0, stats)
    # round 0 is the batch generated ahead (prompts 0-2; batch 1, prompts 3-5, is queued behind it);
    # the extra rounds are on-policy and draw the prompts after the queued batch
    assert [prompts for prompts, _ in rollout.submitted] == [[0, 1, 2], [3, 4, 5]]
    assert [params.seed for _, params in rollout.submitted] == [seed(cfg, 0), seed(cfg, 1)]
    extra = [p for prompts, _ in rollout.generated for p in prompts]
    assert extra[:1] == [6] and extra == list(range(6, 6 + len(extra)))
    rounds = len(rollout.generated)
    assert [params.seed for _, params in rollout.generated] == [seed(cfg, 0, r) for r in range(1, rounds + 1)]
    expected = first_passing([0, 1, 2] + extra, PROMPTS, "correct")
    check_groups(groups, expected, [0] * PROMPTS)
    assert stats["staleness/regenerated_groups"] == 0.0 and stats["dynamic_sampling/rounds"] >= 1.0
    # a resume restarts before batch 1 (queued, not trained on), not after the extra rounds' prompts
    _, states = draws(cfg, 1, size=40)
    assert source.resume_state() == states[1] != s.state_dict()


# ------------------------------------------------------------------------------------ building


@pytest.mark.parametrize("staleness,dynamic", [(0, False), (2, False), (0, True), (2, True)])
def test_build_batch_source_composes_what_the_config_asks_for(staleness, dynamic):
    cfg = config(f"trainer.dynamic_sampling={str(dynamic).lower()}", "data.shuffle=false", staleness=staleness)
    rollout = ScriptedRollout(ScriptedEngine())
    s = sampler(cfg, size=40)
    scorer = Scorer(cfg, ExactAnswer())
    source = build_batch_source(cfg, rollout, s, scorer, tokenizer=None)
    base = source.inner if dynamic else source
    assert type(source) is (DynamicSampling if dynamic else type(base))
    assert type(base) is (AheadByK if staleness else OnPolicy)
    if dynamic:
        assert type(source.rounds) is OnPolicy and source.rounds.sampler is s
    assert (base.rollout, base.sampler, base.scorer) == (rollout, s, scorer)

    stats = {}
    source.next_batch(0, stats)
    # what each composition does with iteration 0: queue k + 1 batches, or generate one now; and
    # dynamic sampling's extra rounds (prompts 0-2 hold one passing group, so there is at least one)
    assert len(rollout.submitted) == (staleness + 1 if staleness else 0)
    extra_rounds = int(stats["dynamic_sampling/rounds"]) if dynamic else 0
    assert len(rollout.generated) == (0 if staleness else 1) + extra_rounds
    assert ("dynamic_sampling/rounds" in stats) == dynamic
    assert ("staleness/regenerated_groups" in stats) == bool(staleness)
    if dynamic:
        assert stats["dynamic_sampling/rounds"] >= 1.0
