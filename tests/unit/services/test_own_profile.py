"""Where a worker's cost-model profile comes from (own_profile.py): the configured file when it has this worker's
key, else the cache, else measured once and cached; workers starting together measure one at a time and the
second reads what the first wrote."""

from __future__ import annotations

import threading
import time

import pytest
from engine_testing import one_torch_thread  # noqa: F401 - fixture

from kunserve.services.worker.build import worker_profile
from kunserve.services.worker.own_profile import ProfileKey, find_own_profile
from kunserve.shared.config import config_from_dict
from kunserve.shared.model.weights import load_model_source
from kunserve.shared.policy.costmodel import ConServeLatencyModel, KunServeCostModel
from kunserve.shared.profile_files import Profile, device_signature, read_profiles, write_profile

KEY = ProfileKey("kunserve-tiny", "float32", (0, 4), device_signature("cpu", 1))


def _profile(key: ProfileKey = KEY, k5: float = 3e-3) -> Profile:
    return Profile(model=key.model, dtype=key.dtype, layers=key.layers, device=key.device_sig,
                   kunserve=KunServeCostModel(1e-7, 1e-4, 1e-3), conserve=ConServeLatencyModel(1e-4, 1e-7, 0.0, 1e-6, k5),
                   fit={}, samples=[])


class Measure:
    def __init__(self, key: ProfileKey = KEY, delay_s: float = 0.0) -> None:
        self.key = key
        self.calls = 0
        self.delay_s = delay_s

    def __call__(self) -> Profile:
        self.calls += 1
        time.sleep(self.delay_s)
        return _profile(self.key, k5=4e-3)


def test_the_configured_file_wins_then_the_cache_then_one_measurement(tmp_path):
    configured, cache = tmp_path / "ops.json", tmp_path / "cache" / "profiles.json"
    write_profile(configured, _profile())
    other = ProfileKey(KEY.model, KEY.dtype, (0, 2), KEY.device_sig)  # the file has no profile for this one
    m = Measure(other)
    prof, why = find_own_profile(KEY, configured=str(configured), cache=cache, measure=m)
    assert prof == _profile() and why == f"profile {KEY} from {configured}" and m.calls == 0

    prof, why = find_own_profile(other, configured=str(configured), cache=cache, measure=m)
    assert m.calls == 1 and prof is not None and prof.conserve.k5 == 4e-3
    assert "has no profile for" in why and "measured at start-up" in why
    assert list(read_profiles(cache)) == [str(other)]

    prof2, why = find_own_profile(other, configured=str(configured), cache=cache, measure=m)
    assert m.calls == 1 and prof2 == prof and f"from the cache {cache}" in why


def test_self_profiling_off_or_an_unusable_cache_falls_back_with_the_reason(tmp_path):
    m = Measure()
    prof, why = find_own_profile(KEY, configured="", cache=None, measure=m)
    assert prof is None and why.startswith("fallback") and "profile_cache is off" in why
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    prof, why = find_own_profile(KEY, configured="", cache=blocker / "profiles.json", measure=m)
    assert prof is None and why.startswith("fallback: cannot use the profile cache") and m.calls == 0


def test_workers_starting_together_measure_once(tmp_path):
    cache = tmp_path / "profiles.json"
    m = Measure(delay_s=0.2)  # the first holds the lock while "measuring"; the second must then read its result
    results: list[tuple[Profile | None, str]] = []
    threads = [threading.Thread(target=lambda: results.append(find_own_profile(KEY, configured="", cache=cache,
                                                                               measure=m))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert m.calls == 1 and len(results) == 2 and results[0][0] == results[1][0]


def test_a_worker_measures_its_own_layer_range_on_this_machine(tmp_path, one_torch_thread):  # noqa: F811
    cfg = config_from_dict({"engine": {"profile_cache": str(tmp_path / "profiles.json")}})
    source = load_model_source(None)
    prof, why = worker_profile(cfg, source, (0, 2), "cpu", 1)
    assert prof is not None and prof.layers == (0, 2) and prof.device == device_signature("cpu", 1)
    assert "measured at start-up" in why and prof.samples, why
    assert prof.conserve.k1 > 0 and prof.kunserve.beta > 0, "a fit of real timings"
    again, why = worker_profile(cfg, source, (0, 2), "cpu", 1)
    assert again is not None and again.conserve == prof.conserve and "from the cache" in why
    off = config_from_dict({"engine": {"budget": "fixed", "lookahead": False, "profile_cache": str(tmp_path / "x")}})
    assert worker_profile(off, source, (0, 2), "cpu", 1) == (None, "no profile needed")


class _Measured:
    def __init__(self, profile: Profile) -> None:
        self.profile = profile


def _fake_gpu(monkeypatch, *, fail: bool) -> list[str]:
    """worker_profile on "cuda" with the measurement and the CUDA calls replaced: what ran, in order."""
    import kunserve.services.worker.build as build

    ran: list[str] = []

    def profile_layers(*args, **kwargs):
        ran.append("measure")
        if fail:
            raise RuntimeError("out of memory while profiling")
        return _Measured(_profile(ProfileKey(KEY.model, KEY.dtype, (0, 2), "cuda[fake]")))

    monkeypatch.setattr(build, "profile_layers", profile_layers)
    monkeypatch.setattr(build, "device_signature", lambda device, threads: "cuda[fake]")
    monkeypatch.setattr(build.torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(build.torch.cuda, "empty_cache", lambda: ran.append("empty_cache"))
    return ran


def test_self_profiling_on_a_gpu_returns_its_cached_memory_before_the_pool_is_built(tmp_path, monkeypatch):
    """The profiling forwards leave activations in PyTorch's CUDA cache; the memory pool is sized right after, so the
    cache is emptied once measuring ends, whether it succeeded or raised. On a CPU there is no such cache."""
    cfg = config_from_dict({"engine": {"profile_cache": str(tmp_path / "profiles.json")}})
    source = load_model_source(None)
    ran = _fake_gpu(monkeypatch, fail=False)
    prof, why = worker_profile(cfg, source, (0, 2), "cuda", 1)
    assert prof is not None and "measured at start-up" in why
    assert ran == ["measure", "empty_cache"]

    ran = _fake_gpu(monkeypatch, fail=True)
    cfg = config_from_dict({"engine": {"profile_cache": str(tmp_path / "other.json")}})
    with pytest.raises(RuntimeError, match="out of memory while profiling"):
        worker_profile(cfg, source, (0, 2), "cuda", 1)
    assert ran == ["measure", "empty_cache"], "emptied when the measurement raised too"

    ran = _fake_gpu(monkeypatch, fail=False)
    monkeypatch.setattr("kunserve.services.worker.build.device_signature", lambda device, threads: "cpu[fake]x1t")
    worker_profile(config_from_dict({"engine": {"profile_cache": str(tmp_path / "cpu.json")}}), source, (0, 2), "cpu", 1)
    assert ran == ["measure"], "no CUDA call on a CPU worker"


def test_a_padded_pool_has_a_profile_of_its_own_measured_on_the_padded_mlp(tmp_path, monkeypatch):
    """A worker whose pool holds the padded MLP computes it per shard: its profile is measured on that MLP (the
    runner's weights carry `mlp.shards`, no gate / up / down) under its own name, not taken from the unpadded one's
    cache entry."""
    import kunserve.services.worker.build as build

    seen: list[tuple[str, list[str]]] = []

    def profile_layers(cfg, weights, *, model, layers, device_sig, **kwargs):
        seen.append((model, sorted({k.split(".", 3)[-1] for k in weights if ".mlp." in k})))
        return _Measured(_profile(ProfileKey(model, "float32", layers, device_sig)))

    monkeypatch.setattr(build, "profile_layers", profile_layers)
    cfg = config_from_dict({"engine": {"profile_cache": str(tmp_path / "profiles.json")}})
    source = load_model_source(None)
    plain, _ = worker_profile(cfg, source, (0, 2), "cpu", 1)
    padded, why = worker_profile(cfg, source, (0, 2), "cpu", 1, padded=True)
    assert "measured at start-up" in why and padded is not None and padded.model == "kunserve-tiny+padded-mlp"
    assert plain is not None and plain.model == "kunserve-tiny"
    assert seen == [("kunserve-tiny", ["mlp.down_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight"]),
                    ("kunserve-tiny+padded-mlp", ["mlp.shards"])]
