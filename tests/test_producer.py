"""Background generation on a replica leader (megatron_alp/rollout/producer.py), and partial
rollouts through a real vLLM engine on the CPU.

The producer's contract is about order and exclusion (jobs one at a time in submission order, a
weight update never overlapping a job, each job's weight version), which the first tests check with
plain Python jobs; the partial-rollout tests run a real engine.
"""

import threading
import time
from concurrent.futures import CancelledError

import pytest
import torch

from megatron_alp.config import RolloutConfig, SamplingConfig
from megatron_alp.models.tiny import make_tiny_model
from megatron_alp.rollout import SamplingParams, build_engine
from megatron_alp.rollout.base import EngineRestarted, RolloutError
from megatron_alp.rollout.producer import RolloutProducer


class _Log:
    """Records what ran when, from any thread."""

    def __init__(self):
        self.events = []
        self.lock = threading.Lock()

    def add(self, *event):
        with self.lock:
            self.events.append(event)


def test_jobs_run_in_order_and_an_update_waits_for_the_running_job():
    log = _Log()
    started = threading.Event()
    producer = RolloutProducer(engine="engine", version=5)

    def job(name, seconds=0.0, signal=None):
        def work(engine):
            assert engine == "engine"
            log.add("start", name)
            if signal is not None:
                signal.set()
            time.sleep(seconds)
            log.add("end", name)
            return name
        return work

    first = producer.submit(job("a", 0.5, started))
    second = producer.submit(job("b"))
    started.wait(5)
    with producer.updating(6):  # "a" is running: the update waits for it, "b" waits for the update
        log.add("update")
    third = producer.submit(job("c"))
    assert first.result(5) == (5, "a")
    assert second.result(5) == (6, "b")  # queued before the update, started after it
    assert third.result(5) == (6, "c")
    assert log.events == [("start", "a"), ("end", "a"), ("update",), ("start", "b"), ("end", "b"),
                          ("start", "c"), ("end", "c")]
    assert producer.run(lambda engine: "x") == (6, "x")
    producer.close()
    producer.join(5)


def test_errors_reach_the_waiter_and_a_restarted_engine_generates_nothing_until_resynced():
    producer = RolloutProducer(engine=None, version=0)

    def boom(engine):
        raise ValueError("bad request")

    with pytest.raises(ValueError, match="bad request"):
        producer.run(boom)

    def restarted(engine):
        raise EngineRestarted("engine restarted: weights lost")

    ran = []
    with pytest.raises(EngineRestarted):
        producer.run(restarted)
    # a job queued after the restart must not generate from the engine's initial weights
    with pytest.raises(EngineRestarted, match="weights lost"):
        producer.run(lambda engine: ran.append(1))
    assert ran == []
    with producer.updating(3):
        pass
    assert producer.run(lambda engine: ran.append(1) or "ok") == (3, "ok") and ran == [1]
    blocker = threading.Event()
    producer.submit(lambda engine: blocker.wait(5))
    queued = producer.submit(lambda engine: "never")
    producer.close()
    blocker.set()
    with pytest.raises(CancelledError):
        queued.result(5)
    producer.join(5)


def test_a_job_named_for_a_version_runs_under_it_whatever_the_timing():
    """The deterministic schedule: a job naming weight version v waits for v even when the engine is
    idle, and an update away from v waits until every job naming v has run, however early it is asked
    for and however slow the jobs are."""
    for slow in (0.0, 0.3):  # the trainer ahead of the engine, then the engine ahead of the trainer
        log = _Log()
        producer = RolloutProducer(engine="engine", version=0)

        def job(name):
            def work(engine):
                log.add("start", name)
                time.sleep(slow)
                log.add("end", name)
                return name
            return work

        a = producer.submit(job("a"), version=0)
        b = producer.submit(job("b"), version=1)
        c = producer.submit(job("c"))  # no version named: after b, whichever version then
        time.sleep(0.1)
        assert not b.running() and ("start", "b") not in log.events  # the engine waits for version 1
        with producer.updating(1):  # waits for "a", which v0 owes
            log.add("update", 1)
        d = producer.submit(job("d"), version=1)
        with producer.updating(2):  # waits for "b" and "d"; "c" names no version, so it may go either side
            log.add("update", 2)
        assert [f.result(5) for f in (a, b, d)] == [(0, "a"), (1, "b"), (1, "d")]
        assert c.result(5)[1] == "c"
        events = [e for e in log.events if e[-1] != "c"]
        assert events == [("start", "a"), ("end", "a"), ("update", 1), ("start", "b"), ("end", "b"),
                          ("start", "d"), ("end", "d"), ("update", 2)], (slow, log.events)
        late = producer.submit(job("late"), version=1)  # its version is gone: refused, never run on v2
        with pytest.raises(RolloutError, match="scheduled for weight version 1 found the engine at version 2"):
            late.result(5)
        producer.close()
        producer.join(5)


def test_an_update_away_from_a_cut_job_waits_for_its_cut_and_the_job_for_the_update():
    """A job for version 0 with a fixed cut pauses there: the update to 1 goes ahead of its end (not of
    its cut), the job goes on under version 1, and the next job (for version 1) only after it.
    requested() never asks a job of the schedule to stop: its cut does not depend on timing."""
    log = _Log()
    producer = RolloutProducer(engine="engine", version=0)

    def cut_job(engine):
        log.add("start", producer.cut_after(), producer.requested())
        time.sleep(0.2)
        log.add("cut")
        log.add("continue", producer.pause())
        log.add("end")
        return "a"

    a = producer.submit(cut_job, version=0, cut=8)
    b = producer.submit(lambda engine: log.add("b", producer.cut_after()) or "b", version=1)
    with producer.updating(1):  # asked for at once: waits for the cut, not for the end
        log.add("update", producer.requested())
    assert a.result(5) == (0, "a") and b.result(5) == (1, "b")
    assert log.events == [("start", 8, False), ("cut",), ("update", False), ("continue", 1), ("end",), ("b", None)]
    producer.close()
    producer.join(5)


# ---------------------------------------------------------------------------- partial rollouts

FP32_TOL = 1e-4  # float32 engine vs float32 transformers on the same tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("qwen2", tmp_path_factory.mktemp("partial") / "m", seed=5)


def _engine(model_dir, **kw):
    cfg = RolloutConfig(dtype="float32", max_model_len=256, request_timeout_s=120.0, max_retries=0,
                        sampling=SamplingConfig(max_prompt_length=64, max_response_length=160), **kw)
    return build_engine(cfg, str(model_dir), seed=0)


def _hf(model_dir, state=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state)
    return model


def _score(model, c):
    """Full-vocabulary logprobs (temperature 1, no filters) of ``c``'s response tokens."""
    ids = c.prompt_ids + c.response_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    p = len(c.prompt_ids)
    return torch.log_softmax(logits[p - 1:-1], -1).gather(-1, torch.tensor(c.response_ids)[:, None])[:, 0]


def _changed_weights(model_dir):
    """The tiny model with every weight moved by a random amount: a clearly different policy."""
    model = _hf(model_dir)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():  # tied embeddings are one parameter: moved once
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model.state_dict()


class _UpdateAfter:
    """An Interruption that asks for an update after ``steps`` decoding steps and, when paused,
    loads ``weights`` into the engine itself (deterministic: no second thread)."""

    def __init__(self, engine, weights, steps):
        self.engine, self.weights, self.steps = engine, weights, steps
        self.version = 0
        self.asked = 0
        self.pauses = 0

    def requested(self):
        self.asked += 1
        return self.pauses == 0 and self.asked > self.steps

    def cut_after(self):
        return None  # cut where requested() says

    def pause(self):
        self.pauses += 1
        self.engine.update_weights(list(self.weights.items()))
        self.version = 1
        return 1


def test_a_partial_rollout_continues_across_a_weight_update_and_records_its_spans(model_dir):
    """Samples stopped between decoding steps by an update continue from their tokens: each token's
    logprob is that of the weights that sampled it (old before the span boundary, new after)."""
    new_state = _changed_weights(model_dir)
    old_model, new_model = _hf(model_dir), _hf(model_dir, new_state)
    engine = _engine(model_dir, partial_rollout=False)
    prompts = [[5, 9, 13, 17, 21], [7, 8, 30]]
    params = SamplingParams(n=2, temperature=1.0, max_tokens=40, seed=3)
    try:
        engine.interruption = _UpdateAfter(engine, new_state, steps=6)
        groups = engine.generate(prompts, params)
        assert engine.interruption.pauses == 1
        completions = [c for g in groups for c in g]
        split = 0
        for c in completions:
            assert len(c.response_ids) == len(c.logprobs) <= 40 and c.finish_reason in ("stop", "length")
            if c.version_spans is None:  # finished before the update
                assert len(c.response_ids) <= 7
                continue
            (start0, v0), (boundary, v1) = c.version_spans
            assert (start0, v0, v1) == (0, 0, 1) and 1 <= boundary < len(c.response_ids), c.version_spans
            engine_lp = torch.tensor(c.logprobs, dtype=torch.float64)
            old, new = _score(old_model, c), _score(new_model, c)
            assert torch.allclose(engine_lp[:boundary], old[:boundary], atol=FP32_TOL)
            assert torch.allclose(engine_lp[boundary:], new[boundary:], atol=FP32_TOL)
            assert (engine_lp[boundary:] - old[boundary:]).abs().max() > 100 * FP32_TOL  # the policies differ
            split += 1
        assert split >= 3, [c.version_spans for c in completions]

        # seeded samples replay exactly under the same interruption
        engine.update_weights(list(_hf(model_dir).state_dict().items()))
        engine.interruption = _UpdateAfter(engine, new_state, steps=6)
        again = [c for g in engine.generate(prompts, params) for c in g]
        assert [c.response_ids for c in again] == [c.response_ids for c in completions]
        assert [c.version_spans for c in again] == [c.version_spans for c in completions]
    finally:
        engine.shutdown()


def test_a_producer_update_pauses_a_partial_rollout_instead_of_waiting_for_it(model_dir):
    """Through the producer's threads: the update lands while the job is still generating, and the
    samples then carry two versions; without partial rollouts the update waits for the whole job."""
    new_state = _changed_weights(model_dir)
    prompts = [[5, 9, 13, 17, 21], [7, 8, 30], [40, 41, 42, 43]]
    params = SamplingParams(n=2, temperature=1.0, max_tokens=150, seed=1)
    for partial in (True, False):
        engine = _engine(model_dir, partial_rollout=partial)
        producer = RolloutProducer(engine, version=0, partial_rollouts=partial)
        try:
            progress = []
            job = producer.submit(lambda e: e.generate(prompts, params))
            while not producer._running:
                time.sleep(0.01)
            time.sleep(0.3)  # some decoding steps
            with producer.updating(1):
                progress.append(job.done())
                engine.update_weights(list(new_state.items()))
            version, groups = job.result(120)
            spans = [c.version_spans for g in groups for c in g]
            assert version == 0
            if partial:
                assert progress == [False]  # the update did not wait for the generation to end
                assert any(s is not None and [v for _, v in s] == [0, 1] for s in spans), spans
            else:
                assert progress == [True] and all(s is None for s in spans)
        finally:
            producer.close()
            engine.shutdown()
            producer.join(10)


def test_a_fixed_cut_makes_a_partial_rollout_independent_of_when_the_update_comes(model_dir):
    """The deterministic schedule's partial rollouts: a job for version 0 with a cut of 8 tokens.
    However early or late the update is asked for, it lands when every response has its first 8
    tokens, and the rest comes from the new weights: the same tokens and spans both times."""
    new_state = _changed_weights(model_dir)
    prompts = [[5, 9, 13, 17, 21], [7, 8, 30], [40, 41, 42, 43]]
    params = SamplingParams(n=2, temperature=1.0, max_tokens=40, seed=1)
    cut = 8
    outcomes = []
    for delay in (0.0, 1.0):  # the update asked for at once, then a second later
        engine = _engine(model_dir, partial_rollout=True)
        producer = RolloutProducer(engine, version=0, partial_rollouts=True)
        try:
            job = producer.submit(lambda e: e.generate(prompts, params), version=0, cut=cut)
            time.sleep(delay)
            with producer.updating(1):
                assert not job.done()  # the update waited for the first span only
                engine.update_weights(list(new_state.items()))
            version, groups = job.result(120)
            assert version == 0
            outcomes.append([(c.response_ids, c.version_spans) for g in groups for c in g])
        finally:
            producer.close()
            engine.shutdown()
            producer.join(10)
    assert outcomes[0] == outcomes[1]
    for tokens, spans in outcomes[0]:
        assert spans == ([(0, 0), (cut, 1)] if len(tokens) > cut else None), (len(tokens), spans)
    assert any(len(tokens) > cut for tokens, _ in outcomes[0])
