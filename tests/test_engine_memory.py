"""The rollout engines' GPU memory (megatron_alp/rollout/engine_memory.py) through every transition of
the phase table (megatron_alp/trainer/phases.py), on the CPU.

The libraries are replaced by stand-ins of their sleep/wake APIs, written here from the rules of the
pinned versions (vLLM 0.33's executor and CuMemAllocator, SGLang 0.5.23's memory saver): what each
call frees, keeps and wakes, and what a second call on memory already asleep does. The trainer's
real :class:`PhaseRunner` moves a real :class:`DistributedRollout` whose engine holds the real state
machine on a stand-in; every phase then has to find the library holding what the table says, and an
engine that generates has to have its weights whole. A unit test of our logic: the engines'
integration tests keep the real vLLM.
"""

import pytest
import torch

from megatron_alp.config import RolloutConfig
from megatron_alp.rollout import replicas
from megatron_alp.rollout.base import RolloutEngine
from megatron_alp.rollout.distributed import DistributedRollout
from megatron_alp.rollout.replicas import probe_leader
from megatron_alp.rollout.engine_memory import SGLangMemory, VLLMMemory
from megatron_alp.rollout.placement import ReplicaLayout
from megatron_alp.rollout.sglang_engine import server_command
from megatron_alp.rollout.vllm.worker import WorkerExtension, read_captured
from megatron_alp.plan.phases import PHASES
from megatron_alp.trainer.phases import STRICT_ENV, PhaseRunner

# The trainer's phases in its own order (trainer.py): an iteration with a layer probe, a verified sync,
# validation and a save, then a rollout whose engine crashed, resynced and verified
ROUTE = ["engine_start", "rollout", "layer_probe", "logprob", "policy_update", "weight_sync", "sync_verification",
         "weight_sync", "validation", "checkpoint_save", "rollout", "engine_restart_resync", "sync_verification",
         "engine_restart_resync", "rollout"]
WITH_ENGINE = [name for name, spec in PHASES.items() if spec.engine != "none"]


class VLLMLibrary:
    """vLLM 0.33's ``LLM`` sleep/wake API as its executor and CuMemAllocator behave. Each kind is on
    the ``gpu``, offloaded to the ``host`` (level-1 weights) or ``gone`` (discarded).

    - ``sleep(level)`` pauses scheduling; from level 1 on the executor sleeps unless its ``weights``
      already sleep ("Executor is already sleeping"), and the allocator skips what already sleeps.
      Level 1 offloads the weights and discards the KV cache; level 2 discards both.
    - ``release_kv_cache_memory()`` needs a completed pause and every kind resident, and discards
      the KV cache only.
    - ``wake_up(tags)`` wakes those kinds (all for None), or nothing at all when one of them does not
      sleep; scheduling resumes when nothing sleeps after it.
    """

    def __init__(self):
        self.where = {"weights": "gpu", "kv_cache": "gpu"}
        self.sleeping: set[str] = set()
        self.paused = False
        self.intact = True  # the weights hold the last ones loaded
        self.calls: list[tuple] = []

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))
        self.paused = True
        if level == 0 or "weights" in self.sleeping:
            return
        for kind, where in self.where.items():
            if where == "gpu":
                self.where[kind] = "host" if kind == "weights" and level == 1 else "gone"
        self.intact = self.intact and self.where["weights"] == "host"
        self.sleeping |= {"weights", "kv_cache"}

    def release_kv_cache_memory(self) -> None:
        self.calls.append(("release_kv_cache_memory",))
        assert self.paused and not self.sleeping, "release_kv_cache_memory() requires a completed pause and all " \
                                                  "executor memory to be resident"
        self.where["kv_cache"] = "gone"
        self.sleeping.add("kv_cache")

    def wake_up(self, tags=None) -> None:
        self.calls.append(("wake_up", tuple(tags) if tags is not None else None))
        tags = sorted(self.sleeping) if tags is None else tags
        if self.sleeping and all(t in self.sleeping for t in tags):
            for kind in tags:
                self.where[kind] = "gpu"
                self.sleeping.discard(kind)
        self.paused = self.paused and bool(self.sleeping)

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache",))

    def load(self, every_weight: bool) -> None:
        """A weight sync into the weights on the GPU: every weight, or adapters only (the base stays)."""
        assert self.where["weights"] == "gpu", f"weights loaded into weights on the {self.where['weights']}"
        self.intact = self.intact or every_weight

    def generate(self) -> None:
        assert self.state == "awake" and not self.paused, (self.where, self.paused)
        assert self.intact, "generated from weights that a sleep discarded"

    @property
    def state(self) -> str:
        on_gpu = [k for k in ("weights", "kv_cache") if self.where[k] == "gpu"]
        return "asleep" if not on_gpu else "awake" if len(on_gpu) == 2 else on_gpu[0]


class SGLangLibrary:
    """SGLang 0.5.23's ``release_memory_occupation(tags)`` / ``resume_memory_occupation(tags)``: each
    pauses or resumes the memory saver's region of every kind named. Released weights come back as
    they were only when the server keeps a host copy (``--enable-weights-cpu-backup``); a kind is
    never released twice nor resumed awake (what torch_memory_saver does then is not known)."""

    def __init__(self, cpu_backup: bool):
        self.where = dict.fromkeys(SGLangMemory.kinds, "gpu")
        self.cpu_backup = cpu_backup
        self.intact = True
        self.calls: list[tuple] = []

    def release_memory_occupation(self, tags) -> None:
        self.calls.append(("release", tuple(tags)))
        for kind in tags:
            assert self.where[kind] == "gpu", f"{kind} released twice"
            self.where[kind] = "released"
        self.intact = self.intact and ("weights" not in tags or self.cpu_backup)

    def resume_memory_occupation(self, tags) -> None:
        self.calls.append(("resume", tuple(tags)))
        for kind in tags:
            assert self.where[kind] == "released", f"{kind} resumed awake"
            self.where[kind] = "gpu"

    def load(self, every_weight: bool) -> None:
        assert self.where["weights"] == "gpu"
        self.intact = self.intact or every_weight

    def generate(self) -> None:
        assert self.state == "awake" and self.intact, (self.where, self.intact)

    @property
    def state(self) -> str:
        on_gpu = {k for k, w in self.where.items() if w == "gpu"}
        return "awake" if len(on_gpu) == 3 else "weights" if on_gpu == {"weights"} else "asleep" if not on_gpu \
            else "+".join(sorted(on_gpu))


class StandInEngine(RolloutEngine):
    """A replica's engine reduced to its memory, calling it as the real engines do."""

    def __init__(self, memory, library, adapters: bool = False):
        self.memory, self.library, self.adapters = memory, library, adapters

    def generate(self, prompts, params, keys=None):
        self.memory.move("awake")
        self.library.generate()
        return []

    def update_weights(self, weights):
        self.memory.wake_weights()
        self.library.load(every_weight=True)
        self.memory.synced()

    def update_adapter(self, tensors, config):
        self.memory.wake_weights()
        self.library.load(every_weight=False)

    def sync(self) -> None:
        """What a weight sync phase does with the engine."""
        if self.adapters:
            self.update_adapter({}, {})
        else:
            self.update_weights([])


def _vllm(adapters: bool = False) -> StandInEngine:
    library = VLLMLibrary()
    return StandInEngine(VLLMMemory(library, adapters=adapters), library, adapters)


def _sglang() -> StandInEngine:
    cpu_backup = "--enable-weights-cpu-backup" in server_command(RolloutConfig(engine="sglang"), "/m", "/m", 256, 0)
    library = SGLangLibrary(cpu_backup)
    return StandInEngine(SGLangMemory(library), library)


ENGINES = {"vllm": _vllm, "vllm_lora_adapter_sync": lambda: _vllm(adapters=True), "sglang": _sglang}


@pytest.fixture
def colocated(monkeypatch):
    """A one-rank DistributedRollout (colocated, freeing its memory while Megatron trains) around the
    engine a test gives it, and the phase runner the trainer uses, strict about the engine's memory."""
    monkeypatch.setenv(STRICT_ENV, "1")

    def make(engine: StandInEngine) -> PhaseRunner:
        monkeypatch.setattr(replicas, "build_engine", lambda *args, **kwargs: engine)
        rollout = DistributedRollout(RolloutConfig(), "unused", seed=0)
        assert rollout.sleeps and rollout.engine is engine
        runner = PhaseRunner()
        runner.attach(rollout=rollout)
        return runner

    return make


def enter(runner: PhaseRunner, name: str) -> None:
    """Enter a phase and do the engine's part of its work: generate, sync the weights, or nothing."""
    runner.enter(name)
    engine, spec = runner.rollout.engine, PHASES[name]
    if spec.work == "bucket":
        engine.sync()
    elif spec.engine == "awake":
        engine.generate([], None)
    assert engine.library.state == spec.engine, (name, engine.library.where)


@pytest.mark.parametrize("kind", ENGINES)
def test_every_transition_of_the_phase_table_leaves_the_library_holding_what_the_table_says(colocated, kind):
    """From every phase, reached the trainer's way, into every phase: the library holds the table's
    memory (the runner checks the engine's own books against the table too). The only transitions
    refused are those that would generate from weights a level-2 sleep discarded before any weight
    sync re-sent them: from the phases whose table row promises that sync (``resync``) into a phase
    that generates. The trainer never takes them."""
    refused = set()
    for a in WITH_ENGINE:
        for b in WITH_ENGINE:
            runner = colocated(ENGINES[kind]())
            for name in ROUTE[:ROUTE.index(a) + 1]:
                enter(runner, name)
            library = runner.rollout.engine.library
            if not library.intact and PHASES[b].engine == "awake":
                with pytest.raises(RuntimeError, match="weights were discarded"):
                    runner.enter(b)
                refused.add((a, b))
                continue
            enter(runner, b)
    resync = {name for name in WITH_ENGINE if PHASES[name].resync}
    generating = {name for name in WITH_ENGINE if PHASES[name].engine == "awake"}
    assert resync == {"logprob", "policy_update"}
    assert refused == ({(a, b) for a in resync for b in generating} if kind == "vllm" else set())


def test_an_engine_woken_for_its_weights_goes_back_to_sleep(colocated):
    """Issue 37 N1a: a sync wakes the weights only; the checkpoint save after it puts them back to
    sleep (the executor sleeps because its weights are awake; the allocator skips the KV cache, which
    already sleeps), on both engines."""
    vllm = colocated(_vllm())
    for name in ("rollout", "logprob", "policy_update", "weight_sync", "checkpoint_save", "rollout"):
        calls = len(vllm.rollout.engine.library.calls)
        enter(vllm, name)
        if name == "checkpoint_save":
            assert vllm.rollout.engine.library.calls[calls:] == [("sleep", 1)]
            assert vllm.rollout.engine.library.where == {"weights": "host", "kv_cache": "gone"}
    sglang = colocated(_sglang())
    for name in ("rollout", "logprob", "policy_update", "weight_sync", "checkpoint_save", "rollout"):
        enter(sglang, name)
    assert sglang.rollout.engine.library.calls == [
        ("release", ("cuda_graph", "kv_cache", "weights")), ("resume", ("weights",)),
        ("release", ("weights",)), ("resume", ("cuda_graph", "kv_cache", "weights"))]


def test_the_trainer_s_iteration_calls_vllm_like_this(colocated):
    """The calls of every phase entry on vLLM: level 2 where the weight sync re-sends every weight
    (issue 37 N6b: no host copy of weights about to be overwritten), level 1 before a save (the
    next rollout needs them), and a sync verification's round trip drops only the KV cache (N6c)."""
    runner = colocated(_vllm())
    seen = []
    for name in ROUTE:
        library = runner.rollout.engine.library
        calls = len(library.calls)
        enter(runner, name)
        seen.append((name, library.calls[calls:]))
    wake_kv = [("wake_up", ("kv_cache",)), ("reset_prefix_cache",)]
    drop_kv = [("sleep", 0), ("release_kv_cache_memory",)]
    assert seen == [
        ("engine_start", []), ("rollout", []), ("layer_probe", []),
        ("logprob", [("sleep", 2)]), ("policy_update", []), ("weight_sync", [("wake_up", ("weights",))]),
        ("sync_verification", wake_kv), ("weight_sync", drop_kv), ("validation", wake_kv),
        ("checkpoint_save", [("sleep", 1)]),
        ("rollout", [("wake_up", ("weights", "kv_cache")), ("reset_prefix_cache",)]),
        ("engine_restart_resync", drop_kv), ("sync_verification", wake_kv), ("engine_restart_resync", drop_kv),
        ("rollout", wake_kv)]


def test_the_sleep_level_keeps_the_weights_unless_a_full_sync_re_sends_them():
    assert VLLMMemory().sleep_level(resync=True) == 2
    assert VLLMMemory().sleep_level(resync=False) == 1
    assert VLLMMemory(adapters=True).sleep_level(resync=True) == 1  # lora.sync: adapter never re-sends the base
    memory = VLLMMemory()
    memory.move("asleep", resync=True)
    assert memory.dropped and memory.state == "asleep"
    with pytest.raises(RuntimeError, match="no weight sync came before it was woken to generate"):
        memory.move("awake")
    memory.wake_weights()
    memory.synced()
    memory.move("awake")
    assert memory.state == "awake" and not memory.dropped


def test_without_a_library_the_moves_keep_the_books():
    """The CPU engines cannot sleep: the same moves, no call, the same states for the ledger."""
    for memory in (VLLMMemory(), SGLangMemory()):
        for state in ("asleep", "weights", "awake", "weights", "asleep", "awake"):
            memory.move(state)
            assert memory.state == state
    with pytest.raises(ValueError, match="engine memory state 'none'"):
        VLLMMemory().move("none")


def test_the_layer_probe_runs_on_the_first_live_replica():
    """Issue 37 N4: replica 0 may have been retired; its leader is the one that captures."""
    layout = ReplicaLayout(replicas=3, stride=2)
    assert probe_leader(layout, [0, 1, 2]) == 0
    assert probe_leader(layout, [1, 2]) == 2
    assert probe_leader(layout, [2]) == 4


class _Layer(torch.nn.Module):
    """A vLLM-style decoder layer: ``layer(positions, hidden, residual) -> (mlp out, stream before it)``."""

    def __init__(self):
        super().__init__()
        self.self_attn, self.mlp = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, positions, hidden_states, residual):
        stream = hidden_states if residual is None else hidden_states + residual
        stream = stream + self.self_attn(stream)
        return self.mlp(stream), stream


class _Worker(WorkerExtension):
    def __init__(self, rank: int):
        self.rank = rank
        model = torch.nn.Module()
        model.model = torch.nn.Module()
        model.model.layers = torch.nn.ModuleList([_Layer(), _Layer()])
        self.model_runner = type("Runner", (), {"get_model": lambda runner: model})()

    def forward(self, tokens: int) -> None:
        hidden, residual = torch.randn(tokens, 4), None
        for layer in self.model_runner.get_model().model.layers:
            hidden, residual = layer(None, hidden, residual)


def test_the_capture_ships_only_the_kinds_asked_from_the_first_worker_only():
    """Issue 37 N6a: calibration needs the layer inputs only; tensor-parallel workers hold the same
    states, so the others neither record nor answer."""
    first, other = _Worker(rank=0), _Worker(rank=1)
    assert first.capture_layers(["input"]) == 2 and other.capture_layers(["input"]) == 0
    first.forward(3)
    first.forward(2)
    other.forward(3)
    shapes = first.captured_layers()
    assert other.captured_layers() is None and other.captured_chunk("input", 0, 2) is None
    assert shapes == {"input": [2, 5, 4]}
    assert read_captured(first.captured_chunk, shapes)["input"].shape == (2, 5, 4)
    first.capture_layers(["residual", "attention", "mlp"])
    first.forward(3)
    assert sorted(first.captured_layers()) == ["attention", "mlp", "residual"]
    first.capture_layers(["input"])
    with pytest.raises(RuntimeError, match="no decoder layer ran while capturing"):
        first.captured_layers()


def test_the_capture_comes_back_in_chunks_of_whole_layers_under_the_limit():
    """Issue 37 N6: one long sequence on a large model is more than msgpack's 4 GiB a value, so the
    states come back a few layers per reply; the chunks put together are what was recorded, and the
    last chunk of a kind frees it on the worker."""
    worker = _Worker(rank=0)
    recorded = []
    worker.capture_layers(["input"])
    worker.forward(3)
    shapes = worker.captured_layers()
    whole = worker._layer_result["input"].clone()
    layer_bytes = 4 * 3 * 4  # [tokens=3, hidden=4] float32

    def call(kind, start, stop):
        recorded.append((start, stop))
        packed = worker.captured_chunk(kind, start, stop)
        assert len(packed[1]) <= layer_bytes * (stop - start)
        return packed

    got = read_captured(call, shapes, limit=layer_bytes + 1)
    assert recorded == [(0, 1), (1, 2)] and torch.equal(got["input"], whole)
    assert "input" not in worker._layer_result  # released with its last chunk
    with pytest.raises(RuntimeError, match="no captured input states"):
        worker.captured_chunk("input", 0, 1)
    recorded.clear()
    worker.capture_layers(["input"])
    worker.forward(3)
    assert read_captured(call, worker.captured_layers(), limit=10**9)["input"].shape == (2, 3, 4)
    assert recorded == [(0, 2)]  # under the limit: every layer in one reply
