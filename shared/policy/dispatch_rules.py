"""The dispatcher's rules for taking and placing a request, over the router's view (pure: no grpc, no clock).

The dispatcher service (`services/dispatcher/servicer.py`) and the simulator's dispatcher (`kunserve/sim/cluster.py`)
both call these, so a simulated request is refused, bounded and routed by the same rules as a real one:

* `prompt_too_long`: the message for a prompt over the token limit (the model context, or
  dispatcher.max_prompt_tokens when set below it);
* `capacity` and `admission_bounds`: the admission bounds scale with the live workers (in flight) and the routable
  units' KV capacity (queued prompt tokens), unless configured;
* `choose_worker` and `may_wait_for_route`: the most-free routable worker for a request (an offline one: where
  online work leaves the most room), and whether a request that found none should wait for one.
"""

from __future__ import annotations

from kunserve.shared.policy.router import FreenessRouter


def prompt_too_long(n: int, what: str, *, context_len: int, max_prompt_tokens: int, auto_prompt_tokens: bool) -> str:
    """The refusal of a prompt of `n` `what` (token ids, tokens) over the limit, naming the limit that applies."""
    bound = f"the model context of {context_len}" if auto_prompt_tokens else f"dispatcher.max_prompt_tokens = {max_prompt_tokens}"
    return f"prompt: {n} {what} exceed {bound} tokens"


def capacity(router: FreenessRouter) -> tuple[int, int]:
    """(live workers, the routable units' KV capacity in tokens). Every healthy worker counts, routable or not (a
    group's members serve through its head; a worker mid-drop serves again in a moment); a group's KV is its
    head's (the members share one block-id space)."""
    loads = router.workers
    live = sum(1 for w in loads.values() if w.healthy)
    tokens = sum(w.kv_blocks_total * w.block_size for wid, w in loads.items() if router.routable(wid))
    return live, tokens


def admission_bounds(
    *, max_inflight_per_worker: int, max_queued_prompt_tokens: int, max_prompt_tokens: int, live_workers: int, kv_tokens: int
) -> tuple[int, int]:
    """(max in flight, max queued prompt tokens): per live worker, and the configured token bound or else the KV
    capacity (never below one longest prompt, so any valid prompt can be admitted into an empty cluster)."""
    tokens = max_queued_prompt_tokens or max(kv_tokens, max_prompt_tokens)
    return max_inflight_per_worker * max(1, live_workers), tokens


def choose_worker(router: FreenessRouter, *, offline: bool, tokens: int, exclude: set[str] | frozenset[str] = frozenset()) -> str | None:
    """Where a request goes now: the most-free routable worker not in `exclude`; an offline request of `tokens`
    (its prompt, the tokens it has, the next one) where online work leaves the most room. None: none is routable."""
    if offline:
        return router.choose_offline(tokens, exclude=exclude)
    return router.choose(exclude=exclude)


def may_wait_for_route(router: FreenessRouter, now: float, deadline: float, exclude: set[str] | frozenset[str] = frozenset()) -> bool:
    """Whether a request that found no routable worker waits for one: some candidate is alive (forming a group,
    mid-transition, refusing a moment ago) or re-forming within its deadline, and the request's route deadline has
    not passed. False: it fails now."""
    return router.may_become_routable(exclude=exclude, now=now) and now < deadline


__all__ = ["admission_bounds", "capacity", "choose_worker", "may_wait_for_route", "prompt_too_long"]
