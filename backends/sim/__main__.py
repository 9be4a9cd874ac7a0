"""`python -m backends.sim [serve] [MODEL] [vLLM flags]`: see backends/sim/cli.py."""

from backends.sim.cli import main

raise SystemExit(main())
