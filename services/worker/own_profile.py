"""The cost-model profile a worker runs its SLO-aware token budget and its lookahead microbatches under.

ConServe's budget is only as good as the latency model behind it, and a worker must not silently fall back to
a fixed budget because nobody ran `kunserve profile` on this machine. So with engine.budget = "auto" a worker
looks, in order, in:

1. engine.profile, the file an operator wrote with `kunserve profile` (their grid, their repeats);
2. engine.profile_cache (default ``~/.cache/kunserve/profiles.json``), profiles workers measured themselves;
3. nowhere: it measures itself now, on the quick grid (seconds on a CPU, most of it the first forward passes),
   and adds the result to the cache, so the next start on this machine with the same model, dtype, layer
   range and device (a CPU's chip and thread count) reads it back.

Workers of one machine start together and would time each other's forward passes: measuring holds an
exclusive lock on the cache (``<cache>.lock``), and a worker that waited for it reads the cache again before
measuring (its peer may have written exactly its key). An empty engine.profile_cache turns self-profiling
off: without a profile file the worker uses the fixed budget and says so.
"""

from __future__ import annotations

import fcntl
import os
import pathlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from kunserve.shared.log import get_logger
from kunserve.shared.profile_files import Profile, ProfileError, find_profile, profile_key, write_profile


@dataclass(frozen=True)
class ProfileKey:
    model: str
    dtype: str
    layers: tuple[int, int]
    device_sig: str

    def __str__(self) -> str:
        return profile_key(self.model, self.dtype, self.layers, self.device_sig)


def cache_path(setting: str) -> pathlib.Path | None:
    """engine.profile_cache with ``~`` expanded; None when self-profiling is off."""
    return pathlib.Path(os.path.expanduser(setting)) if setting else None


def find_own_profile(key: ProfileKey, *, configured: str, cache: pathlib.Path | None,
                     measure: Callable[[], Profile]) -> tuple[Profile | None, str]:
    """The profile for `key` and where it came from (a line for the start-up log; "fallback: ..." when there is
    none, or the configured file could not be used and nothing replaced it). `measure` runs only when neither
    file holds the key."""
    why = ""
    if configured:
        try:
            return _find(configured, key), f"profile {key} from {configured}"
        except ProfileError as exc:
            why = f"{exc}; "
    if cache is None:
        return None, f"fallback: {why or 'no engine.profile and '}engine.profile_cache is off"
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        with _locked(cache):
            try:
                return _find(str(cache), key), f"{why}profile {key} from the cache {cache}"
            except ProfileError:
                pass
            log = get_logger()
            log.info("self_profiling", key=str(key), cache=str(cache))
            t0 = time.perf_counter()
            prof = measure()
            write_profile(cache, prof)
            seconds = time.perf_counter() - t0
            log.info("self_profiled", key=str(key), seconds=round(seconds, 1))
            return prof, f"{why}profile {key} measured at start-up ({seconds:.1f} s), cached in {cache}"
    except OSError as exc:
        return None, f"fallback: {why}cannot use the profile cache {cache}: {exc}"


def _find(path: str, key: ProfileKey) -> Profile:
    return find_profile(path, model=key.model, dtype=key.dtype, layers=key.layers, device_sig=key.device_sig)


class _locked:
    """An exclusive flock on ``<path>.lock`` for the duration of the block (released when the process dies)."""

    def __init__(self, path: pathlib.Path) -> None:
        self.lock = path.with_name(path.name + ".lock")
        self.fd = -1

    def __enter__(self) -> None:
        self.fd = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
