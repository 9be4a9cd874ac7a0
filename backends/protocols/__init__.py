"""Pure translations between the client APIs tokenway speaks and chat completions.

Why in `backends/`: the simulated engine serves `/v1/responses` and `/v1/messages` by these same
translations (as vLLM serves them over its chat path), and the gateway uses them both to read those
APIs (token estimates, prefix hashing) and to serve them on engines that only speak chat
completions. Sharing one rendering keeps the gateway's prompt ids and the simulator's identical.
Everything here is a function of plain dicts: no sockets, no clocks, no state beyond one stream.
"""
