"""KunServe: cluster LLM serving that keeps tail latency flat under memory-overloading bursts."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kunserve")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
