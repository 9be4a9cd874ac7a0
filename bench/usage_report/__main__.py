"""`python -m bench.usage_report`: the benchmark of run.py (`--help` lists its options)."""

import os

from bench.usage_report.run import main

os.environ.setdefault("PYTHONHASHSEED", "0")  # as run.py's own entry: the report processes it starts
raise SystemExit(main())
