"""Program slot reserve: an endpoint's last free batch slots kept, inside one tenant, for its programs
under their share while a wide program of the same tenant runs beside them.

Program-fair queueing (`programs.py`) decides who *waits* least; it cannot make a small program's
calls run fast once they start. On an engine every sequence of a batch pays for the others: a decode
step reads every running sequence's KV cache, so with the batch full of a wide program's long
contexts each token of a one-call program takes longer (`backends/perf/roofline.py`, Llama-3.1-8B on
an H100 at 8K contexts: 7.3 ms a step alone, 11.8 ms at a batch of 8), and the wide program's next
prompts are prefilled in the same steps. The tenant slot reserve (`reserve.py`) keeps slots free for
*tenants* under their share; inside one tenant everything is one flood to it.

With `program_reserve_slots: k` (per pool, gateway.yaml; 0: off) and program fairness on for the
tenant, a request of a program that would hold, after it, more than an equal share of its tenant's
requests in flight in the pool (`over_share`) may start only on an endpoint that keeps at least `k`
free slots after it (`keeps_reserve`), and only while another program of the tenant is light
(`light_others`: active in the pool and nothing of it waiting, so the slots are kept for its next
call; a program with calls waiting is served by the room's order, least attained service first). The
engines that serve the small programs' calls thus run batches of at most `max_num_seqs - k` of the
wide program's sequences, and a small program's next call finds a free slot at once. The cost is
those slots left to the small programs while they are active: the wide program's share of the pool
shrinks by `k` per endpoint, and nothing more once they are done (`program_active_s` after their
last call).

Equal shares: programs have no weights of their own; the tenant's weight is the tenants' business.
Every input here is a count the caller keeps up to date (`gateway/flow/program_activity.py`), so a
decision is a few integer comparisons, never a walk over the tenant's programs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Standing:
    """A program's place in its tenant, in one pool: its requests in flight, the tenant's, the
    tenant's programs active there (the program itself counted), and how many of the others are light
    (active, nothing waiting)."""

    inflight: int
    tenant_inflight: int
    active: int
    light_others: int


def over_share(standing: Standing) -> bool:
    """Whether, after one more request, the program would hold more than an equal share of its
    tenant's requests in flight: `(own + 1) * programs > tenant + 1`."""
    return (standing.inflight + 1) * max(standing.active, 1) > standing.tenant_inflight + 1


def held(standing: Standing) -> bool:
    """Whether the program reserve applies to the program's next request: it is over its share and
    another program of its tenant is light, so that the reserve is kept for someone."""
    return standing.light_others > 0 and over_share(standing)


def keeps_reserve(free_slots: int, reserve_slots: int) -> bool:
    """Whether an endpoint with `free_slots` keeps `reserve_slots` free after one more request."""
    return free_slots - 1 >= reserve_slots
