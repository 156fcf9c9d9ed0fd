"""The broadcast weight transport between processes, without an engine: the receiving end runs in
a child process that takes control calls on its stdin (as vLLM's workers take ``collective_rpc``
calls) and joins the group the sender builds. The vLLM engine on this transport is tested in
tests/test_vllm_engine.py, a torchrun trainer feeding it in tests/test_weight_sync.py.
"""

import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from megatron_alp.rollout.weight_broadcast import BroadcastError, BroadcastSender

# The engine worker's stand-in: control calls in, replies out, one hex-encoded pickle per line.
_WORKER = """
import pickle, sys, time, torch
from megatron_alp.rollout.weight_broadcast import BroadcastReceiver
receiver, seen = None, {}
def load(weights):
    for name, t in weights:
        if name == "reject":
            raise ValueError("this worker rejects the weight 'reject'")
        seen[name] = t.clone()
for line in sys.stdin:
    call, arg = pickle.loads(bytes.fromhex(line))
    try:
        if call == "join":
            receiver, out = BroadcastReceiver(arg, 0), None
        elif call == "receive":
            out = receiver.receive(arg, load)
        elif call == "refuse":
            raise RuntimeError("refused before receiving")
        elif call == "ready":
            out = None
        elif call == "hang":
            time.sleep(3600)
        elif call == "seen":
            torch.save(seen, arg)
            out = None
        reply = ("ok", out)
    except Exception as err:
        reply = ("error", f"{type(err).__name__}: {err}")
    print(pickle.dumps(reply).hex(), flush=True)
"""


class Worker:
    """A child process holding the receiving end; :meth:`call` blocks until it answers (or dies)."""

    def __init__(self, **env_vars):
        env = {**os.environ, "OMP_NUM_THREADS": "1", **env_vars}
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.lock = threading.Lock()
        self.senders = []
        self.call("ready")  # imports done: the steps' time limits do not include them

    def sender(self, timeout_s):
        self.senders.append(BroadcastSender(workers=1, timeout_s=timeout_s, alive=self.alive))
        return self.senders[-1]

    def call(self, name, arg=None):
        with self.lock:
            self.proc.stdin.write(pickle.dumps((name, arg)).hex() + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise EOFError("the worker process ended")
        status, out = pickle.loads(bytes.fromhex(line))
        if status != "ok":
            raise RuntimeError(out)
        return out

    def alive(self):
        return self.proc.poll() is None

    def send(self, sender, bucket, receive="receive"):
        return sender.send(bucket, join=lambda spec: self.call("join", spec),
                           receive=lambda header: self.call(receive, header))

    def stop(self):
        """End the worker, then the senders: their part of a failed step ends with the worker."""
        if self.alive():
            self.proc.kill()
        self.proc.wait()
        for sender in self.senders:
            sender.close(grace_s=10.0)
            assert not sender._abandoned, "a broadcast thread outlived the worker"


@pytest.fixture
def worker():
    w = Worker()
    yield w
    w.stop()


def _bucket(layer, g):
    return [
        (f"model.layers.{layer}.a", torch.randn(7, 5, generator=g).to(torch.bfloat16)),
        (f"model.layers.{layer}.b", torch.randn(3, 4, generator=g).t()),  # not contiguous
        (f"model.layers.{layer}.c", torch.arange(11, dtype=torch.int64) * (layer + 1)),
        (f"model.layers.{layer}.d", torch.zeros(0, 3)),
        (f"model.layers.{layer}.e", torch.randn(1, generator=g).half()),
        (f"model.layers.{layer}.f", torch.randn(20_000 * (layer + 1), generator=g)),  # the buffers grow
    ]


def test_buckets_arrive_bit_for_bit_in_a_group_of_their_own(worker, tmp_path):
    """Several buckets of mixed dtypes, strides and sizes reach the other process intact through
    one gloo group (joined once), and no default process group is created on this side."""
    g = torch.Generator().manual_seed(0)
    buckets = [_bucket(layer, g) for layer in range(3)]
    default_group = dist.is_initialized()  # an earlier test of this process may have made one
    sender = worker.sender(timeout_s=60.0)
    sent = [worker.send(sender, b) for b in buckets]
    assert sender.backend == "gloo" and sender._store.port > 0
    worker.call("seen", str(tmp_path / "seen.pt"))
    sender.close()
    assert dist.is_initialized() == default_group, "the transport must not touch torch.distributed's default group"
    seen = torch.load(tmp_path / "seen.pt")
    for bucket, nbytes in zip(buckets, sent):
        assert nbytes >= sum(t.numel() * t.element_size() for _, t in bucket)
        for name, t in bucket:
            assert seen[name].dtype == t.dtype and seen[name].shape == t.shape, name
            assert torch.equal(seen[name], t), name


def test_worker_killed_mid_sync_fails_the_next_bucket_quickly(worker):
    g = torch.Generator().manual_seed(1)
    sender = worker.sender(timeout_s=120.0)
    worker.send(sender, _bucket(0, g))
    os.kill(worker.proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(BroadcastError, match="died|ended|closed"):
        worker.send(sender, _bucket(1, g))
    assert time.monotonic() - t0 < 10, "a dead engine must not be waited for until the timeout"
    assert sender._group is None  # closed: the next send builds a new group with a new engine


def test_failures_on_the_engine_side_are_reported_without_waiting_for_the_timeout(worker):
    """The worker's load rejects a bucket after receiving it, or refuses one before receiving it
    (the leader's broadcast is then left without a receiver): both raise at once, naming the side."""
    g = torch.Generator().manual_seed(2)
    sender = worker.sender(timeout_s=120.0)
    t0 = time.monotonic()
    with pytest.raises(BroadcastError, match="the engine side failed: RuntimeError: ValueError: this worker rejects"):
        worker.send(sender, [("reject", torch.ones(4))])
    with pytest.raises(BroadcastError, match="the engine side failed: RuntimeError: RuntimeError: refused"):
        worker.send(sender, _bucket(0, g), receive="refuse")
    assert time.monotonic() - t0 < 20
    worker.send(sender, _bucket(1, g))  # a new group with the same (live) worker works


def test_a_step_that_never_completes_ends_at_the_timeout(worker):
    """The worker never answers nor receives: the step ends at its limit; the leader's broadcast,
    left waiting for a receiver, ends when the worker does."""
    sender = worker.sender(timeout_s=3.0)
    worker.send(sender, [("model.layers.0.x", torch.ones(8))])  # joined
    t0 = time.monotonic()
    with pytest.raises(BroadcastError, match=r"not done after 3 s \(waiting for the engine and the leader\)"):
        worker.send(sender, [("model.layers.1.x", torch.ones(8))], receive="hang")
    assert 3.0 <= time.monotonic() - t0 < 10
    assert sender._abandoned and sender._abandoned[0].is_alive()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs 2 NVIDIA GPUs: NCCL cannot broadcast between two ranks on one GPU")
def test_cuda_buckets_go_by_nccl_to_a_process_on_another_gpu(tmp_path):
    """CUDA tensors on GPU 0 reach a process on GPU 1 by NCCL, bit for bit."""
    w = Worker(CUDA_VISIBLE_DEVICES="1")
    try:
        g = torch.Generator().manual_seed(3)
        buckets = [[(n, t.to("cuda:0")) for n, t in _bucket(layer, g)] for layer in range(2)]
        sender = w.sender(timeout_s=120.0)
        for b in buckets:
            w.send(sender, b)
        assert sender.backend == "nccl"
        w.call("seen", str(tmp_path / "seen.pt"))
        sender.close()
        seen = torch.load(tmp_path / "seen.pt", map_location="cpu")
        for b in buckets:
            for name, t in b:
                assert torch.equal(seen[name], t.cpu()), name
    finally:
        w.stop()
