"""Weight sync Megatron -> rollout engine, and engine-vs-trainer mismatch statistics.

The check jobs (tests/dist/check_weight_sync.py, run in the session's batched launches:
helpers.dist_job) compare a real vLLM engine with the real Megatron model on the same tokens; the
unit tests cover the stream, the on-disk hand-over and the statistics themselves.
"""

import json
import pickle
from pathlib import Path

import pytest
import torch
from helpers import dist_job, read_results
from safetensors.torch import load_file

from megatron_alp.algorithms.mismatch import format_mismatch, mismatch_stats
from megatron_alp.models.hf_weights import INDEX_FILE
from megatron_alp.config import LoRAConfig, RolloutConfig
from megatron_alp.rollout.weight_sync import BucketWriter, SyncFolder, WeightStream, layer_buckets, write_hf_checkpoint
from megatron_alp.sync import AdapterWeights, FullWeights, weight_source


def _weights(n=6, size=1000):
    g = torch.Generator().manual_seed(0)
    return [(f"model.layers.{i}.mlp.down_proj.weight", torch.randn(size, generator=g)) for i in range(n)]


def test_stream_skips_sigmas_counts_and_drains():
    source = _weights(4)
    sigma = ("decoder.layers.1.alp_perturbation.log_sigma", torch.zeros(3))
    consumed = []

    def collective():  # stands in for a collective iterator: records how far it was driven
        for item in [source[0], sigma, *source[1:]]:
            consumed.append(item[0])
            yield item

    stream = WeightStream(collective())
    first = next(iter(stream))
    assert first[0] == source[0][0]
    stream.drain()  # the consumer stopped early; the source must still reach its end
    assert len(consumed) == 5
    assert stream.tensors == 4 and stream.bytes == 4 * 1000 * 4 and stream.skipped == [sigma[0]]
    assert list(WeightStream(iter([sigma]))) == []


def test_checkpoint_folder_is_sharded_by_bucket_and_atomic(tmp_path, tiny_model):
    model_dir = tiny_model("qwen3", seed=1)
    weights = _weights(6, 1000)  # 4000 bytes each
    # Views of one flat buffer, as the collective exporter yields them.
    flat = torch.cat([t for _, t in weights])
    views = [(n, flat[i * 1000:(i + 1) * 1000]) for i, (n, _) in enumerate(weights)]
    out = write_hf_checkpoint(views, tmp_path / "w1", bucket_bytes=9000, config_dir=model_dir)
    index = json.loads((out / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 3 and index["metadata"]["total_size"] == 6 * 4000
    loaded = {}
    for s in shards:
        loaded.update(load_file(out / s))
    assert all(torch.equal(loaded[n], t) for n, t in weights)
    assert (out / "config.json").read_text() == (model_dir / "config.json").read_text()
    assert not list(tmp_path.glob("w1.tmp*"))

    def broken():
        yield weights[0]
        raise RuntimeError("trainer died mid-sync")

    with pytest.raises(RuntimeError, match="mid-sync"):
        write_hf_checkpoint(broken(), tmp_path / "w2", bucket_bytes=9000, config_dir=model_dir)
    assert not (tmp_path / "w2").exists() and not list(tmp_path.glob("w2*"))
    with pytest.raises(ValueError, match="appears twice"):
        write_hf_checkpoint([weights[0], weights[0]], tmp_path / "w3", bucket_bytes=9000, config_dir=model_dir)
    with pytest.raises(FileExistsError):
        write_hf_checkpoint(weights, out, bucket_bytes=9000, config_dir=model_dir)


def test_a_sync_folder_is_always_the_whole_model(tmp_path, tiny_model):
    """SyncFolder: a stream that leaves tensors out (a delta sync's changed tensors) is completed from
    the current folder; the folder before goes once the engine took the new one."""
    model_dir = tiny_model("qwen3", seed=1)
    folders = SyncFolder(str(tmp_path), model_dir, bucket_bytes=9000)
    weights = _weights(4, 1000)
    first = folders.write(weights)
    folders.commit(first)
    changed = [(weights[1][0], weights[1][1] + 1.0)]
    second = folders.write(changed)
    assert folders.current == first  # not current until committed
    folders.commit(second)
    assert folders.current == second and not first.exists()
    loaded = {}
    for shard in second.glob("*.safetensors"):
        loaded.update(load_file(shard))
    assert sorted(loaded) == sorted(n for n, _ in weights)
    for i, (name, tensor) in enumerate(weights):
        assert torch.equal(loaded[name], tensor + 1.0 if i == 1 else tensor), name
    folders.close()
    assert not folders.current and not second.exists()


def test_delta_sync_compares_in_the_dtype_the_engine_is_sent():
    """A casting engine (bf16): changes below bf16's precision are no change; a quantizing engine
    quantizes what it is sent, so its delta compares the trainer's own values; adapter sync wins."""
    bf16 = RolloutConfig(dtype="bfloat16", sync_delta=True)
    assert weight_source(bf16).export.dtype == torch.bfloat16
    assert weight_source(bf16.model_copy(update={"quantization": "fp8"})).export.dtype is None
    assert weight_source(bf16.model_copy(update={"dtype": "auto"})).export.dtype is None
    assert isinstance(weight_source(bf16.model_copy(update={"sync_delta": False})), FullWeights)
    adapter = LoRAConfig(enabled=True, rank=4, sync="adapter")
    assert isinstance(weight_source(bf16, adapter), AdapterWeights)


def test_mismatch_statistics():
    engine = [[-1.0, -2.0], [-0.5]]
    trainer = [[-1.1, -2.0], [-0.2]]
    s = mismatch_stats(engine, trainer)
    r = torch.tensor([-0.1, 0.0, 0.3], dtype=torch.float64)
    assert s["tokens"] == 3
    assert s["max"] == pytest.approx(0.3) and s["mean"] == pytest.approx(r.abs().mean().item())
    assert s["p98"] == pytest.approx(torch.quantile(r.abs(), 0.98).item())
    assert s["k3"] == pytest.approx((r.exp() - 1 - r).mean().item()) and s["k3"] > 0
    same = mismatch_stats(torch.tensor([-1.0, -3.0]), torch.tensor([-1.0, -3.0]))
    assert same["max"] == 0 and same["k3"] == 0
    assert "k3 KL" in format_mismatch("x", s)
    with pytest.raises(ValueError, match="differ in length"):
        mismatch_stats([-1.0], [-1.0, -2.0])
    with pytest.raises(ValueError, match="non-finite"):
        mismatch_stats([float("nan")], [-1.0])


ENGINE_VS_MEGATRON = dist_job("weight_sync_mismatch", "check_weight_sync.py", "mismatch", "{dir}", nproc=1)
SYNC_JOBS = {method: dist_job(f"weight_sync_{method}", "check_weight_sync.py", "sync", "{dir}", method)
             for method in ("memory", "broadcast")}


@ENGINE_VS_MEGATRON
def test_engine_matches_megatron_and_a_verified_sync_follows_the_trainer(dist_jobs):
    """One rank, an in-process engine: fp32 engine == fp32 Megatron (max |diff| < 1e-4) on the
    engine's samples; a verified in-memory sync follows a training-side weight change; an engine
    broken by a bad update is restarted and resynced. (bf16 and FP8 engines against Megatron:
    tests/test_mismatch.py.)"""
    r = read_results(dist_jobs.run("weight_sync_mismatch") / "r.json")
    assert r["mismatch"]["float32"]["max"] < 1e-4
    assert r["stale_max"] > 1e-2 and r["synced_max"] < 1e-4 and r["after_restart_max"] < 1e-4
    assert r["restarts"] == 1 and r["sync"]["sync/verify_mean_abs_diff"] < 1e-3


@pytest.mark.parametrize("method", [pytest.param("memory", marks=SYNC_JOBS["memory"]),
                                    pytest.param("broadcast", marks=[pytest.mark.slow, SYNC_JOBS["broadcast"]])])
def test_tp2_and_pp2_trainers_feed_one_engine(dist_jobs, method):
    """Two gloo ranks, TP=2 then PP=2: the engine (a subprocess of rank 0, the only rank the weight
    gather delivers to) follows every sync, by shared-memory buckets or by broadcast in a group of
    its own beside the trainer's, and its logprobs equal Megatron's; every rank reports the bytes the
    engine received; without a sync, verification fails on every rank."""
    folder = dist_jobs.run(f"weight_sync_{method}")
    r = read_results(folder / "r.json")
    expected_bytes = sum(t.numel() * t.element_size() for t in load_file(folder / "b" / "model.safetensors").values())
    for layout in ("tp2_pp1", "tp1_pp2"):
        assert r[layout]["max_diff"] < 1e-4
        assert r[layout]["sync/bytes"] == expected_bytes
        assert r[layout]["sync/verify_mean_abs_diff"] < 1e-3


DELTA = dist_job("weight_sync_delta", "check_weight_sync.py", "delta", "{dir}", nproc=1)


@DELTA
def test_delta_syncs_leave_the_engine_as_a_full_sync_would(dist_jobs):
    """tests/dist/check_weight_sync.py delta: N delta syncs, an engine restart, a fresh process and a
    drifted leader copy each end with the engine's parameters equal to a full sync's, bit for bit."""
    r = read_results(dist_jobs.run("weight_sync_delta") / "r.json")["delta"]
    for frac, nbytes in r["changed_frac_and_bytes"]:
        assert 0.005 < frac < 0.05 and nbytes < r["full_bytes"] / 4, (frac, nbytes, r["full_bytes"])


def test_layer_buckets_end_only_between_decoder_layers():
    names = ["model.embed_tokens.weight", "lm_head.weight"]
    for i in range(3):
        names += [f"model.layers.{i}.self_attn.{p}_proj.weight" for p in "qkv"]
        names += [f"model.layers.{i}.mlp.down_proj.weight"]
    names += ["model.norm.weight"]
    weights = [(n, torch.zeros(250)) for n in names]  # 1000 bytes each
    buckets = list(layer_buckets(weights, bucket_bytes=1500))
    assert [n for b in buckets for n, _ in b] == names
    for b in buckets:
        layers = {n.split(".")[2] if ".layers." in n else "top" for n, _ in b}
        assert len(layers) == 1, f"a bucket mixes layers: {[n for n, _ in b]}"
    assert [n for n, _ in buckets[0]] == names[:2]  # the tied head travels with the embedding
    big = list(layer_buckets(weights, bucket_bytes=1 << 30))
    assert len(big) == 1


_CONSUMER = """
import sys, torch
from megatron_alp.rollout.weight_sync import load_bucket
seen = {}
def load(weights):
    for name, t in weights:
        seen[name] = t.clone()
n = load_bucket(bytes.fromhex(sys.stdin.read()), load)
torch.save((n, seen), sys.argv[1])
"""


def test_shared_memory_bucket_reaches_another_process_intact(tmp_path):
    """A bucket packed by the trainer is read by another process (as vLLM's worker does) bit for
    bit, whatever the dtypes, strides and sizes; the segment outlives the reader and is gone after
    the writer closes."""
    import subprocess
    import sys
    from pathlib import Path

    g = torch.Generator().manual_seed(0)
    tensors = [
        ("model.layers.0.a", torch.randn(7, 5, generator=g).to(torch.bfloat16)),
        ("model.layers.0.b", torch.randn(3, 4, generator=g).t()),  # not contiguous
        ("model.layers.0.c", torch.arange(11, dtype=torch.int64)),
        ("model.layers.0.d", torch.zeros(0, 3)),
        ("model.layers.0.e", torch.randn(1, generator=g).half()),
    ]
    writer = BucketWriter(prefix="megatron-alp-test")
    handle = writer.pack(tensors)
    name = pickle.loads(handle)[1]
    out = tmp_path / "seen.pt"
    subprocess.run([sys.executable, "-c", _CONSUMER, str(out)], input=handle.hex(), text=True, check=True)
    nbytes, seen = torch.load(out)
    assert nbytes == sum(t.numel() * t.element_size() for _, t in tensors)
    for n, t in tensors:
        assert seen[n].dtype == t.dtype and seen[n].shape == t.shape and torch.equal(seen[n], t), n
    assert Path(f"/dev/shm/{name}").exists(), "the reader must not unlink the trainer's segment"
    bigger = [("model.layers.1.x", torch.ones(100_000))]
    handle2 = writer.pack(bigger)  # grows into a new segment, the old one is released
    assert not Path(f"/dev/shm/{name}").exists()
    writer.close()
    assert not Path(f"/dev/shm/{pickle.loads(handle2)[1]}").exists()


def test_a_killed_writers_segment_is_removed_by_the_next_writer():
    """A trainer killed by SIGKILL leaves its bucket segment in /dev/shm; the next writer with the
    same prefix unlinks it, and never touches a live writer's."""
    import subprocess
    import sys

    prefix = "megatron-alp-orphan-test"
    code = ("import sys, torch; from megatron_alp.rollout.weight_sync import BucketWriter; "
            f"w = BucketWriter(prefix={prefix!r}); print(w.pack([('x', torch.ones(1000))]).hex(), flush=True); "
            "sys.stdin.read()")
    victim = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    orphan = pickle.loads(bytes.fromhex(victim.stdout.readline().strip()))[1]
    live = BucketWriter(prefix=prefix)
    live.pack([("y", torch.ones(10))])
    mine = live._shm.name
    assert Path(f"/dev/shm/{orphan}").exists()
    BucketWriter(prefix=prefix)  # the victim is alive: its segment stays
    assert Path(f"/dev/shm/{orphan}").exists()
    import psutil

    for proc in [psutil.Process(victim.pid), *psutil.Process(victim.pid).children(recursive=True)]:
        proc.kill()  # the whole job, its resource tracker too (which would unlink the segment at its exit)
    victim.wait()
    BucketWriter(prefix=prefix)
    assert not Path(f"/dev/shm/{orphan}").exists() and Path(f"/dev/shm/{mine}").exists()
    live.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA IPC handover)")
def test_cuda_ipc_bucket_reaches_another_process_intact(tmp_path):
    """A bucket of CUDA tensors is handed to another process by CUDA IPC (as to a colocated vLLM
    worker): the reader sees the trainer's device memory bit for bit."""
    import subprocess
    import sys

    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = [("model.layers.0.a", torch.randn(64, 32, device="cuda", generator=g).to(torch.bfloat16)),
               ("model.layers.0.b", torch.randn(5, device="cuda", generator=g)),
               ("model.layers.0.c", torch.arange(7, device="cuda"))]
    writer = BucketWriter()
    handle = writer.pack(tensors)
    out = tmp_path / "seen.pt"
    subprocess.run([sys.executable, "-c", _CONSUMER, str(out)], input=handle.hex(), text=True, check=True)
    _, seen = torch.load(out)
    writer.close()
    for n, t in tensors:
        assert seen[n].is_cuda and torch.equal(seen[n].cpu(), t.cpu()), n


def test_a_tensor_parallel_worker_opens_the_leaders_bucket_from_its_own_gpu():
    """Issue 37 R3: the CUDA bucket lives on the replica's first GPU. A worker on another GPU opens
    it from its own device (peer access), making no CUDA context on the leader's GPU; device 0 is
    only the fallback where peer access is refused. The calls torch's rebuild receives, recorded."""
    from megatron_alp.rollout.weight_sync import open_cuda_bucket

    def rebuild(refuse_peer):
        calls = []

        def call(*args):
            calls.append(args[6])
            if refuse_peer and args[6] != 0:
                raise RuntimeError("peer access is not supported between these two devices")
            return f"opened on {args[6]}"
        return call, calls

    args = tuple(range(12))  # rebuild_cuda_tensor's arguments; [6] is storage_device
    for device, refuse, expected, opened in ((0, False, [0], "opened on 0"), (3, False, [3], "opened on 3"),
                                             (3, True, [3, 0], "opened on 0")):
        call, calls = rebuild(refuse)
        assert open_cuda_bucket(call, args, device) == opened and calls == expected

    def broken(*args):
        raise RuntimeError("invalid device pointer")

    with pytest.raises(RuntimeError, match="invalid device pointer"):  # failing on device 0 too: the real error
        open_cuda_bucket(broken, args, 3)
