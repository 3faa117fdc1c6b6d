"""Process-level choices every service and tool makes the same way: dying with the launcher, the device,
the torch thread count. Here (not in the CLI or a service) so that neither imports the other."""

from __future__ import annotations

import ctypes
import os
import signal

from kunserve.shared.config import ClusterConfig

PR_SET_PDEATHSIG = 1
PARENT_PID_ENV = "KUNSERVE_PARENT_PID"  # children ask the kernel for SIGTERM when this process dies


class DeviceError(RuntimeError):
    """The configured device does not exist on this machine."""


def die_with_parent_if_asked() -> None:
    """Called first thing in every service process. Done in the child rather than in a Popen
    preexec_fn because forking a process with live gRPC threads (the tests have some) can crash the
    child; without preexec_fn, subprocess uses vfork/posix_spawn."""
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent:
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        return
    if os.getppid() != int(parent):  # the launcher died before the prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def pick_device(setting: str) -> str:
    """``auto`` is CUDA when there is one, else the CPU; an explicit ``cuda`` without one is an error."""
    import torch  # lazily: the launcher and the CLI import this module and never need torch

    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cuda" and not torch.cuda.is_available():
        raise DeviceError("model.device = 'cuda' but no CUDA device is available")
    return setting


def thread_share(cfg: ClusterConfig) -> int:
    """Torch threads for one worker: the configured number, else an even share of the cores.

    Oversubscribed OpenMP threads make CPU inference several times slower (MEASURED.md)."""
    if cfg.engine.threads > 0:
        return cfg.engine.threads
    return max(1, (os.cpu_count() or 1) // max(1, len(cfg.workers)))
