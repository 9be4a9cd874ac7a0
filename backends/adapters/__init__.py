"""Engine adapters: one module per engine kind (`vllm.py` also holds vllm-ascend's and the simulated
engine's; `hosted.py` the remote APIs'), on the contract of `base.py`. `ADAPTERS`, the one place that
lists them by kind, is in `backends/fleet.py` (a new engine is one module plus one line there).
"""
