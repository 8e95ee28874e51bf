"""`python -m bench`: the throughput benchmark (bench/bench.py)."""

import sys

from bench.bench import main

sys.exit(main())
