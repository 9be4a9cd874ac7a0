"""`python -m sim [serve] [MODEL] [vLLM flags]`: see sim/cli.py."""

from sim.cli import main

raise SystemExit(main())
